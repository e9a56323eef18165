"""Group all-reduce benchmark: zpipe's RingAllReduce against torch.distributed gloo.

What it measures: for world sizes 2, 3 and 4 (``--world-sizes``) it spawns that many
worker processes on this machine; each joins a gloo process group
(``init_process_group("gloo")`` over ``tcp://127.0.0.1``) and starts one
:class:`zpipe.stage.data_parallel.RingAllReduce` rank (plain TCP on loopback, zmq
sockets from ``open_socket``, uvloop where importable, as zpipe's CLI runs). Then, for
float32 buffers of 1 MiB, 16 MiB and 64 MiB (``--sizes``; ResNet-50 sends about
100 MB of gradients, BERT-base about 440 MB, a stage's share is a fraction of that),
the same processes time both paths on the same tensor:

``gloo``
    ``torch.distributed.all_reduce(t)`` (SUM), gloo's ring on CPU.
``zpipe``
    ``await ring.allreduce_([t], op="sum", round_id=i)``: the streamed reduce-scatter
    + all-gather in segments of ``--segment-bytes`` (default: zpipe's, 4 MiB), every
    message encoded, validated and decoded by zpipe's codec; ``t`` is one contiguous
    tensor, so it is reduced where it lies, as gloo does.

Both use SUM (gloo has no AVG), one torch thread per process (two cores shared by
up to four ranks) and glibc tuned to keep freed message memory as zpipe's stages do
(``--no-retain-memory`` turns that off for both). One timed run is: a gloo barrier,
``iters`` back-to-back all-reduces, a gloo barrier, timed on rank 0; ``iters`` is
picked from a warm-up so a run lasts about ``--seconds``, the same for both paths.
Runs are repeated ``--repeats`` times with the paths interleaved and the median
seconds per all-reduce is reported. After timing, rank 0 checks that both paths give
the same sums (allclose; the summation orders differ).

Output, on stdout, one JSON line per path, world size and size::

    {"bench": "allreduce", "path": "zpipe", "world_size": 3, "size_bytes": 16777216,
     "seconds": ..., "algbw_gbps": ..., "busbw_gbps": ..., "iters": ..., ...}

``algbw_gbps`` is size / seconds; ``busbw_gbps`` is what each rank's link carried,
2(n-1)/n * size / seconds, i.e. the bandwidth with which Asteroid's eq. (5)
(:func:`~zpipe.training.ring.ring_allreduce_cost_s`) predicts the measured time;
compare it with bench/transport.py's point-to-point GB/s. Then one summary line::

    {"bench": "allreduce", "summary": true, "ratio_vs_gloo_16mb_n3": ..., ...}

``ratio_vs_gloo_X_nN`` is zpipe throughput / gloo throughput (gloo seconds / zpipe
seconds) at size X among N ranks; 1.0 is parity, higher is faster than gloo.

Run it from the repository root::

    .venv/bin/python bench/allreduce.py            # full run, 30-60 s on 2 cores
    .venv/bin/python bench/allreduce.py --quick    # 1-16 MiB, 2-3 ranks, about 10 s

All ranks share the machine's cores, so with more ranks than cores both paths mostly
measure CPU contention (the reduction adds, memory copies and the kernel's loopback
work), not a network; numbers move by tens of percent between runs, so compare
ratios from the same run only. Every wait has a deadline (``--timeout``), the whole
run has one (``--deadline``), and workers are killed if anything fails.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import faulthandler
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from zpipe.log import configure_logging
from zpipe.stage.data_parallel import DEFAULT_SEGMENT_BYTES, RingAllReduce, RingPort
from zpipe.training.ring import ring_allreduce_cost_s
from zpipe.transport.allocator import retain_freed_memory
from zpipe.transport.sockets import SocketOptions, new_context

try:
    from bench._common import emit, summary
except ImportError:  # run as a script: bench/ itself is sys.path[0]
    from _common import emit, summary  # type: ignore[no-redef]

BENCH = "allreduce"
PATHS = ("gloo", "zpipe")
DEFAULT_SIZES = "1M,16M,64M"
DEFAULT_WORLD_SIZES = "2,3,4"
QUICK_SIZES = "1M,16M"
QUICK_WORLD_SIZES = "2,3"

Runner = Callable[[Coroutine[Any, Any, Any]], Any]


def parse_size(text: str) -> int:
    """``1M``, ``16M``, ``4096``: binary units, a positive multiple of 4 bytes."""
    text = text.strip().upper().removesuffix("B")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    scale = units.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in units else text
    try:
        size = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 1M, 16M, 64M") from None
    if size <= 0 or size % 4:
        raise argparse.ArgumentTypeError(f"size {text!r} must be a positive multiple of 4 bytes")
    return size


def size_label(size: int) -> str:
    """Key part in the summary: 1mb, 16mb, 64kb (or the byte count)."""
    if size % (1 << 20) == 0:
        return f"{size >> 20}mb"
    if size % (1 << 10) == 0:
        return f"{size >> 10}kb"
    return f"{size}b"


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


@dataclass(frozen=True)
class WorkerSettings:
    world_size: int
    # a file rendezvous for gloo, and every rank binds its ring port itself (port 0)
    # and learns the others' over gloo: a port picked in the parent could be taken
    # before the rank bound it
    gloo_init_method: str
    sizes: list[int]
    seconds: float
    repeats: int
    max_iters: int
    timeout_s: float
    deadline_s: float
    segment_bytes: int
    tune_malloc: bool


# ----------------------------------------------------------------------------- worker


def worker_main(rank: int, settings: WorkerSettings, conn: Connection) -> None:
    """One rank: joins gloo and the zpipe ring, times both, rank 0 reports lines."""
    faulthandler.dump_traceback_later(settings.deadline_s, exit=True)
    configure_logging(level="warning")
    torch.set_num_threads(1)  # two cores shared by up to four ranks
    if settings.tune_malloc:
        retain_freed_memory()
    try:
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    context = new_context()
    port = RingPort(context=context, bind="tcp://127.0.0.1:0", options=SocketOptions())
    ring: RingAllReduce | None = None
    try:
        dist.init_process_group(
            "gloo",
            init_method=settings.gloo_init_method,
            rank=rank,
            world_size=settings.world_size,
            timeout=datetime.timedelta(seconds=settings.timeout_s),
        )
        ring = RingAllReduce(
            context=context,
            rank=rank,
            endpoints=_ring_endpoints(port.port, settings.world_size),
            port=port,
            socket_options=SocketOptions(),
            timeout_s=settings.timeout_s,
            segment_bytes=settings.segment_bytes,
            name="bench",
        )
        loop.run_until_complete(ring.start())
        lines = Worker(rank, settings, loop, ring).run()
        conn.send({"ok": "finished", "lines": lines if rank == 0 else []})
        # Tear down only once every rank is past its last collective: a rank that
        # closes its gloo sockets early resets the connections its peers still read.
        if conn.poll(settings.timeout_s):
            conn.recv()
    except Exception as exc:
        conn.send({"error": f"rank {rank}: {exc!r}"})
    finally:
        if ring is not None:
            loop.run_until_complete(ring.close())
        port.close()  # (the ring closed it, if it was made)
        context.term()
        if dist.is_initialized():
            dist.destroy_process_group()
        loop.close()
        conn.close()


def _ring_endpoints(own_port: int, world_size: int) -> list[str]:
    """Every rank's ring endpoint: the ports the ranks bound, gathered over gloo."""
    ports = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(ports, torch.tensor([own_port], dtype=torch.int64))
    return [f"tcp://127.0.0.1:{int(p.item())}" for p in ports]


class Worker:
    def __init__(
        self,
        rank: int,
        settings: WorkerSettings,
        loop: asyncio.AbstractEventLoop,
        ring: RingAllReduce,
    ) -> None:
        self.rank = rank
        self.settings = settings
        self.loop = loop
        self.ring = ring
        self.round_id = 0

    def op(self, path: str, tensor: torch.Tensor) -> None:
        if path == "gloo":
            dist.all_reduce(tensor)
            return
        self.round_id += 1
        self.loop.run_until_complete(
            self.ring.allreduce_([tensor], op="sum", round_id=self.round_id)
        )

    def timed(self, path: str, tensor: torch.Tensor, iters: int) -> float:
        """Seconds per all-reduce over ``iters`` back-to-back ones, between two barriers."""
        dist.barrier()
        started = time.perf_counter()
        for _ in range(iters):
            self.op(path, tensor)
        dist.barrier()
        return (time.perf_counter() - started) / iters

    def agree(self, size: int) -> bool:
        """Both paths sum the same inputs to the same values (up to summation order)."""
        inputs = torch.randn(size // 4, generator=torch.Generator().manual_seed(self.rank))
        by_gloo, by_zpipe = inputs.clone(), inputs.clone()
        self.op("gloo", by_gloo)
        self.op("zpipe", by_zpipe)
        ok = torch.tensor([int(torch.allclose(by_gloo, by_zpipe, rtol=1e-5, atol=1e-5))])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok.item())

    def run(self) -> list[dict[str, Any]]:
        s = self.settings
        n = s.world_size
        lines: list[dict[str, Any]] = []
        for size in s.sizes:
            tensor = torch.ones(size // 4)
            warm: dict[str, float] = {}
            for path in PATHS:
                self.op(path, tensor)  # connections, allocations, first-touch pages
                warm[path] = self.timed(path, tensor, 1)
            # Rank 0 decides, so every rank runs the same number of all-reduces.
            iters = torch.tensor([int(s.seconds / max(max(warm.values()), 1e-6))])
            dist.broadcast(iters, src=0)
            count = int(min(s.max_iters, max(1, int(iters.item()))))
            runs: dict[str, list[float]] = {path: [] for path in PATHS}
            for rep in range(s.repeats):
                order = PATHS if rep % 2 == 0 else PATHS[::-1]  # no fixed position bias
                for path in order:
                    runs[path].append(self.timed(path, tensor, count))
            agree = self.agree(size)
            del tensor
            for path in PATHS:
                seconds = statistics.median(runs[path])
                # eq. (5) with bandwidth 1 byte/s and no latency is the bytes a link
                # carries; over the measured time that is the bandwidth eq. (5) implies.
                link_bytes = ring_allreduce_cost_s(size, n, 8.0)
                lines.append(
                    {
                        "bench": BENCH,
                        "path": path,
                        "world_size": n,
                        "size_bytes": size,
                        "seconds": _round(seconds, 6),
                        "algbw_gbps": _round(size / seconds / 1e9),
                        "busbw_gbps": _round(link_bytes / seconds / 1e9),
                        "seconds_runs": [_round(r, 6) for r in runs[path]],
                        "iters": count,
                        "agree": agree,
                    }
                )
        return lines


# ----------------------------------------------------------------------------- parent


def run_world(args: argparse.Namespace, n: int) -> list[dict[str, Any]]:
    """Spawn ``n`` ranks, wait for rank 0's lines; kill everything on any failure."""
    spawn = mp.get_context("spawn")
    rendezvous = tempfile.mkdtemp(prefix="zpipe-bench-allreduce-")
    settings = WorkerSettings(
        world_size=n,
        gloo_init_method=f"file://{rendezvous}/store",
        sizes=args.sizes,
        seconds=args.seconds,
        repeats=args.repeats,
        max_iters=args.max_iters,
        timeout_s=args.timeout,
        deadline_s=args.deadline,
        segment_bytes=args.segment_bytes,
        tune_malloc=args.tune_malloc,
    )
    pipes = [spawn.Pipe() for _ in range(n)]  # (parent's end, worker's end)
    procs = [
        spawn.Process(
            target=worker_main,
            args=(rank, settings, pipes[rank][1]),
            name=f"zpipe-bench-allreduce-{rank}",
            daemon=True,
        )
        for rank in range(n)
    ]
    for proc in procs:
        proc.start()
    for _, theirs in pipes:
        theirs.close()
    deadline = time.monotonic() + args.deadline
    lines: list[dict[str, Any]] = []
    try:
        waiting = set(range(n))
        while waiting:
            for rank in sorted(waiting):
                conn = pipes[rank][0]
                if conn.poll(0):
                    reply: dict[str, Any] = conn.recv()
                    if "error" in reply:
                        raise RuntimeError(reply["error"])
                    lines.extend(reply["lines"])
                    waiting.discard(rank)
            dead = [p.name for p in procs if not p.is_alive() and p.exitcode]
            if dead:
                raise RuntimeError(f"worker(s) {dead} died")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no result from {n} ranks within {args.deadline:g} s")
            if waiting:
                time.sleep(0.05)
        for conn, _ in pipes:
            conn.send("quit")
        return lines
    finally:
        for conn, _ in pipes:
            conn.close()
        for proc in procs:
            proc.join(timeout=args.timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        shutil.rmtree(rendezvous, ignore_errors=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/allreduce.py",
        description="zpipe's ring all-reduce vs torch.distributed gloo all_reduce among "
        "local processes on loopback; prints JSON lines.",
    )
    parser.add_argument(
        "--sizes",
        default=None,
        help=f"comma-separated float32 buffer sizes in bytes, K or M (default {DEFAULT_SIZES},"
        f" quick {QUICK_SIZES})",
    )
    parser.add_argument(
        "--world-sizes",
        default=None,
        help=f"comma-separated group sizes (default {DEFAULT_WORLD_SIZES}, quick "
        f"{QUICK_WORLD_SIZES})",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: fewer sizes and ranks, 1 repeat"
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="target duration of one timed run (default 0.4, quick 0.15)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed runs per path, median reported (default 3, quick 1)",
    )
    parser.add_argument("--max-iters", type=int, default=200, help="most all-reduces per run")
    parser.add_argument(
        "--segment-bytes",
        type=parse_size,
        default=DEFAULT_SEGMENT_BYTES,
        help=f"zpipe's message size (default {DEFAULT_SEGMENT_BYTES >> 20}M)",
    )
    parser.add_argument(
        "--no-retain-memory",
        dest="tune_malloc",
        action="store_false",
        help="let glibc return freed message memory at once (both paths)",
    )
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="deadline of every single wait, seconds"
    )
    parser.add_argument(
        "--deadline", type=float, default=600.0, help="abort a world size after this many seconds"
    )
    args = parser.parse_args(argv)
    try:
        sizes_text = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
        args.sizes = [parse_size(s) for s in sizes_text.split(",") if s.strip()]
        worlds_text = args.world_sizes or (QUICK_WORLD_SIZES if args.quick else DEFAULT_WORLD_SIZES)
        args.world_sizes = [int(w) for w in worlds_text.split(",") if w.strip()]
    except (argparse.ArgumentTypeError, ValueError) as exc:
        parser.error(str(exc))
    if not args.sizes or not args.world_sizes or min(args.world_sizes) < 2:
        parser.error("--sizes needs at least one size and --world-sizes sizes >= 2")
    if args.seconds is None:
        args.seconds = 0.15 if args.quick else 0.4
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.repeats < 1 or args.timeout <= 0 or args.max_iters < 1:
        parser.error("--repeats, --timeout and --max-iters must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(level="warning")  # zpipe logs go to stderr, JSON lines to stdout
    ratios: dict[str, Any] = {}
    agree = True
    started = time.monotonic()
    try:
        for n in args.world_sizes:
            lines = run_world(args, n)
            seconds: dict[tuple[str, int], float] = {}
            for line in lines:
                emit(line)
                seconds[(line["path"], line["size_bytes"])] = line["seconds"]
                agree = agree and bool(line["agree"])
            for size in args.sizes:
                gloo, zpipe = seconds[("gloo", size)], seconds[("zpipe", size)]
                ratios[f"ratio_vs_gloo_{size_label(size)}_n{n}"] = _round(gloo / zpipe, 3)
    except Exception as exc:
        print(f"bench/allreduce.py: failed: {exc!r}", file=sys.stderr)
        return 1
    values = [v for v in ratios.values() if v is not None]
    summary(
        BENCH,
        **ratios,
        geomean_ratio_vs_gloo=_round(statistics.geometric_mean(values), 3) if values else None,
        results_agree=agree,
        segment_bytes=args.segment_bytes,
        quick=bool(args.quick),
        repeats=args.repeats,
        torch_threads=1,
        cpus=os.cpu_count(),
        wall_s=round(time.monotonic() - started, 1),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
