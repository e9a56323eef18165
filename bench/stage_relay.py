"""Per-message cost of a stage's data path: zpipe's relay against a raw pyzmq relay.

A *feeder* (this process, plain synchronous pyzmq) pushes data messages of one
float32 tensor (``--sizes``, default 64 KiB and 1 MiB) into a spawned *relay*
process over loopback TCP and receives what the relay forwards on a second
PUSH/PULL pair. The relay is one of:

``raw``
    The ceiling: a synchronous PULL -> PUSH loop, ``recv_multipart(copy=False)``
    then ``send_multipart(frames, copy=False)``; nothing decoded. It waits inside
    libzmq (blocking, GIL released), which no asyncio process can.
``raw-asyncio``
    The like-for-like baseline (``bench/_relay_raw.py``): raw's loop under
    ``zmq.asyncio`` on uvloop when it is importable, ``await
    recv_multipart(copy=False)`` then ``await send_multipart(frames, copy=False)``,
    nothing decoded, raw's socket options, one deadline over the whole relay.
``stage``
    What a running inference stage does with each message, in-process: the
    real :class:`~zpipe.stage.dataport.DataPort` (framing, kind, sender and
    epoch checks) feeding the real :class:`~zpipe.stage.executors.inference.InferenceLoop`
    (bounded inbox, compute thread, bounded outbox, send task with the link
    meter and its tracker) over a one-unit identity shard, on uvloop when it is
    importable, as the CLI runs stages.
``stage-sync``
    The ceiling of a synchronous data plane (issue 34; not what a stage runs
    today, so only on request): the event loop only answers the feeder, and one
    thread takes each message from the stage's own PULL socket (non-blocking,
    then a poll of ``SYNC_POLL_MS`` when none is queued), checks it with the real
    :meth:`~zpipe.stage.dataport.DataPort.accept` (framing, kind, sender, epoch),
    runs the real shard's forward, encodes and queues the output on the PUSH
    socket's synchronous shadow (polling for room under a deadline). One output
    in ``--sync-track-every`` (default ``SYNC_TRACK_EVERY``) goes tracked and its
    tracker is looked at, a stand-in for the link meter's delivery tracking; the
    rest go as an untracked send does. Over-bounds discards, the connection
    guard and an emulated link are left out. Summary keys: ``sync_ratio_X``,
    ``sync_cpu_ratio_X``.

Two measurements per size and path, with the relay's and the feeder's CPU time:

* ``tput``: the feeder keeps at most ``--window`` messages in the relay (as a
  client's ``max_in_flight`` does) and reports messages per second;
* ``rtt``: one message at a time; the median round trip through the relay.

Per path and size, ``relay_cpu_us_<role>`` and ``relay_switches_<role>`` split the
relay's CPU per message (``/proc/self/task/*/schedstat``) and its voluntary context
switches per message by thread: ``loop`` (the event loop, or the raw relay's only
thread), ``compute``, ``libzmq`` (its I/O and reaper threads), ``link_meter`` (the
link meter's waiter) and ``other`` (pyzmq's collector of zero-copy frames). The
relay process freezes its imports out of the cyclic collector first, as the stage
CLI does.

``--steps`` also splits the stage relay's loop thread by step (``loop_us_<step>``,
CPU per message, each step without the steps it calls): ``decode`` (the codec's
checks and tensors over the received frames), ``parse`` (the typed message),
``verdict`` (kind, sender and epoch), ``submit`` (the hand-off to the compute
thread), ``output`` and ``to_message`` (the message that goes on), ``encode``,
``zmq_queue`` (pyzmq's tracked send: its frame, tracker and collector entry, and
libzmq's queueing), ``zmq_recv`` (pyzmq's receive of the frames), ``meter_look``
and ``meter_track`` (the link meter), ``timeline`` (the spans recorded), and
``other``: the rest of the thread's CPU (waiting for the socket, the queues
between tasks, asyncio and uvloop, the wake-ups from the compute thread, counters,
and the steps' own clock reads: two per step, about a microsecond each). Leave it
off for the ratios.

For ``stage-sync`` (below) the steps are its data thread's: ``zmq_recv`` (the
non-blocking take of a queued message), ``decode``, ``parse``, ``verdict``,
``forward``, ``to_message``, ``encode``, ``outgoing`` (the frames and copy flag),
``zmq_queue`` (the non-blocking send), ``timeline``, and ``other`` (the polls
that wait for input or room, the counters, the loop itself).

``--profile FILE`` writes the stage relay's cProfile statistics for the last size,
timed by each thread's CPU clock (a wall clock would charge the loop for its waits
for the GIL while the compute thread or pyzmq's collector holds it).
``--inline-compute`` is a diagnostic: the relay's forwards run on its event loop, as
no stage runs them, so the difference to a normal run is what the hand-off to the
compute thread and back costs (the summary then says ``inline_compute``).

Summary keys (same-run ratios, stage over raw): ``ratio_64kb``, ``ratio_1mb``
(throughput), ``rtt_ratio_64kb``, ``rtt_ratio_1mb`` and ``cpu_ratio_X`` (CPU of
both processes per message), plus ``loadavg``. Like for like, stage over
raw-asyncio: ``ratio_X_vs_asyncio_raw``, ``rtt_ratio_X_vs_asyncio_raw``,
``cpu_ratio_X_vs_asyncio_raw``; what asyncio alone costs a relay, raw-asyncio
over raw: ``asyncio_raw_over_raw_X`` (throughput), ``rtt_asyncio_raw_over_raw_X``.
Every ratio is of the paths' medians over ``--repeats``.

    .venv/bin/python bench/stage_relay.py            # under a minute
    .venv/bin/python bench/stage_relay.py --quick    # a few seconds

Every wait has a deadline (``--timeout``); the relay is killed if anything fails.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import faulthandler
import gc
import multiprocessing as mp
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import torch
import zmq

from zpipe.log import configure_logging
from zpipe.stage.dataport import DataPort
from zpipe.stage.executors.inference import InferenceLoop
from zpipe.stage.lifecycle import StageLifecycle
from zpipe.stage.metrics import StageCounters
from zpipe.stage.shard import Shard
from zpipe.transport.allocator import retain_freed_memory
from zpipe.transport.codec import Message, encode
from zpipe.transport.emulation import LinkSpec
from zpipe.transport.sockets import new_context, open_socket

try:
    from bench._common import emit, loadavg, summary
    from bench._relay_parts import (
        EPOCH,
        LOOPBACK,
        OPTIONS,
        RUN,
        readable,
        running_lifecycle,
        timed,
        usage,
    )
    from bench._relay_raw import raw_asyncio_relay, raw_relay
    from bench._stage_sync import SYNC_TRACK_EVERY, stage_sync_relay
except ImportError:  # run as a script: bench/ itself is sys.path[0]
    from _common import emit, loadavg, summary  # type: ignore[no-redef]
    from _relay_parts import (  # type: ignore[no-redef]
        EPOCH,
        LOOPBACK,
        OPTIONS,
        RUN,
        readable,
        running_lifecycle,
        timed,
        usage,
    )
    from _relay_raw import raw_asyncio_relay, raw_relay  # type: ignore[no-redef]
    from _stage_sync import SYNC_TRACK_EVERY, stage_sync_relay  # type: ignore[no-redef]

BENCH = "stage_relay"
PATHS = ("raw", "raw-asyncio", "stage")  # the default; "stage-sync" on request (--paths)
KNOWN_PATHS = ("raw", "raw-asyncio", "stage", "stage-sync")
# ------------------------------------------------------------------------- relay


def _time_steps(compute: ThreadPoolExecutor) -> None:
    """Wrap the stage relay's per-message steps (sync calls on the loop thread)."""
    from zpipe.protocol import REGISTRY
    from zpipe.protocol.data_plane import Data
    from zpipe.stage.metrics import LinkMeter
    from zpipe.stage.timeline import Timeline
    from zpipe.transport import codec, sockets

    codec.decode = timed("decode", codec.decode)
    REGISTRY.parse_checked = timed("parse", REGISTRY.parse_checked)  # type: ignore[method-assign]
    StageLifecycle.data_verdict = timed("verdict", StageLifecycle.data_verdict)  # type: ignore[method-assign]
    compute.submit = timed("submit", compute.submit)  # type: ignore[method-assign]
    InferenceLoop._output = timed("output", InferenceLoop._output)  # type: ignore[method-assign]
    Data.to_message = timed("to_message", Data.to_message)  # type: ignore[method-assign]
    sockets.encode = timed("encode", sockets.encode)
    sockets._queue_now = timed("zmq_queue", sockets._queue_now)
    LinkMeter.has_room = timed("meter_look", LinkMeter.has_room)  # type: ignore[method-assign]
    LinkMeter._look_or_hand_off = timed("meter_look", LinkMeter._look_or_hand_off)  # type: ignore[method-assign]
    zmq.Socket.recv_multipart = timed("zmq_recv", zmq.Socket.recv_multipart)  # type: ignore[method-assign]
    Timeline.record = timed("timeline", Timeline.record)  # type: ignore[method-assign]
    LinkMeter.track = timed("meter_track", LinkMeter.track)  # type: ignore[method-assign]


def relay_main(
    conn: Connection,
    path: str,
    profile: str | None,
    timeout_s: float,
    steps: bool = False,
    inline_compute: bool = False,
    track_every: int = SYNC_TRACK_EVERY,
) -> None:
    faulthandler.dump_traceback_later(timeout_s * 4, exit=True)
    configure_logging(level="warning")
    retain_freed_memory()
    torch.set_num_threads(1)
    # as the stage CLI does once its imports are done: torch's objects out of the
    # cyclic collector's way (without it, full collections over them were ~20 % of
    # the stage relay's loop thread)
    gc.collect()
    gc.freeze()
    if inline_compute:
        _compute_on_the_loop()
    if path == "raw":
        raw_relay(conn)
        return
    if path == "raw-asyncio":
        _run_on_uvloop(raw_asyncio_relay(conn, timeout_s * 4))
        return
    if path == "stage-sync":
        _run_on_uvloop(stage_sync_relay(conn, steps, track_every))
        return
    try:
        import uvloop

        run: Any = uvloop.run
    except ImportError:
        run = asyncio.run
    profiler = cProfile.Profile(time.thread_time) if profile else None
    try:
        run(_stage_relay(conn, profiler, steps))
    finally:
        if profiler is not None and profile:
            profiler.dump_stats(profile)


def _run_on_uvloop(main: Any) -> None:
    try:
        import uvloop

        uvloop.run(main)
    except ImportError:
        asyncio.run(main)


def _compute_on_the_loop() -> None:
    """--inline-compute: each group's forwards run on the event loop's thread, as no
    stage runs them (a layer may run for seconds there): what the compute thread's
    hand-off costs, both ways (the submit, the worker's wake-up and GIL, the result's
    call into the loop)."""

    async def computed(
        self: InferenceLoop, loop: asyncio.AbstractEventLoop, group: list[Any]
    ) -> list[Any]:
        return self._forward_all(group)

    InferenceLoop._computed = computed  # type: ignore[method-assign]


async def _stage_relay(
    conn: Connection, profiler: cProfile.Profile | None, steps: bool = False
) -> None:
    ctx = new_context()
    data_in = open_socket(ctx, zmq.PULL, OPTIONS)
    data_in.bind(LOOPBACK)
    conn.send(data_in.getsockopt_string(zmq.LAST_ENDPOINT))
    await readable(conn)
    downstream = open_socket(ctx, zmq.PUSH, OPTIONS)
    downstream.connect(conn.recv())
    counters = StageCounters()
    lifecycle = running_lifecycle()
    compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute-relay")
    if steps:
        _time_steps(compute)
    loop = InferenceLoop(
        name="relay",
        run=RUN,
        epoch=EPOCH,
        shard=Shard([torch.nn.Identity()]),
        compute=compute,
        counters=counters,
        downstream=downstream,
        downstream_name="sink",
        link=LinkSpec(),
        send_timeout_s=30.0,
    )
    port = DataPort(
        socket=data_in,
        lifecycle=lifecycle,
        counters=counters,
        name="relay",
        max_message_bytes=OPTIONS.max_message_bytes,
    )
    tasks = [
        asyncio.create_task(port.serve(loop.deliver, upstream="client")),
        asyncio.create_task(loop.compute_loop()),
        asyncio.create_task(loop.send_loop()),
    ]
    if profiler is not None:
        profiler.enable()
    while True:
        await readable(conn)
        if conn.recv() == "stop":
            break
        conn.send(usage())
    if profiler is not None:
        profiler.disable()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await loop.close()
    compute.shutdown(wait=True)
    data_in.close(linger=0)
    downstream.close(linger=0)
    ctx.term()


# ------------------------------------------------------------------------ feeder


def _headers(count: int, size: int) -> tuple[list[bytes], memoryview]:
    tensor = torch.arange(size // 4, dtype=torch.float32)
    headers = []
    for mb in range(count):
        frames = encode(
            Message("data", {"run": RUN, "mb": mb, "src": "client"}, epoch=EPOCH, tensors=(tensor,))
        )
        headers.append(bytes(frames[0]))
    return headers, frames[1]  # type: ignore[return-value]


def _feed(
    push: zmq.Socket[Any], pull: zmq.Socket[Any], size: int, count: int, window: int
) -> tuple[float, list[float]]:
    """Seconds for ``count`` messages with at most ``window`` in the relay, and each
    message's time from its send to its return."""
    headers, payload = _headers(count, size)
    sent_at: list[float] = []
    trips: list[float] = []
    started = time.perf_counter()
    sent = received = 0
    while received < count:
        while sent < count and sent - received < window:
            sent_at.append(time.perf_counter())
            push.send_multipart([headers[sent], payload], copy=False)
            sent += 1
        frames = pull.recv_multipart(copy=False)
        trips.append(time.perf_counter() - sent_at[received])
        if len(frames) != 2 or len(frames[1]) != size:
            raise RuntimeError("the relay returned a different message")
        received += 1
    return time.perf_counter() - started, trips


def _answered(conn: Connection, proc: Any, timeout_s: float) -> bool:
    """Whether the relay process answered on ``conn`` within ``timeout_s``; a
    RuntimeError at once when it exited instead (its traceback is on stderr), not a
    feeder's receive timing out a minute later."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(min(0.5, max(0.0, deadline - time.monotonic()))):
        if not proc.is_alive():
            raise RuntimeError(f"the relay process exited (code {proc.exitcode})")
        if time.monotonic() >= deadline:
            return False
    return True


def measure(
    path: str, sizes: list[int], args: argparse.Namespace, profile: str | None
) -> dict[int, dict[str, float]]:
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    proc = spawn.Process(
        target=relay_main,
        args=(
            child,
            path,
            profile,
            args.timeout,
            args.steps,
            args.inline_compute,
            args.sync_track_every,
        ),
        daemon=True,
    )
    proc.start()
    ctx = zmq.Context(io_threads=1)
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    results: dict[int, dict[str, float]] = {}
    try:
        for sock in (push, pull):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, int(args.timeout * 1000))
            sock.setsockopt(zmq.RCVTIMEO, int(args.timeout * 1000))
        pull.bind(LOOPBACK)
        if not _answered(parent, proc, args.timeout):
            raise TimeoutError("the relay did not start")
        push.connect(parent.recv())
        parent.send(pull.getsockopt_string(zmq.LAST_ENDPOINT))
        _feed(push, pull, 64, 50, 1)  # connections up, code paths warm

        def relay_usage() -> tuple[float, dict[str, int], dict[str, float], dict[str, float]]:
            parent.send("usage")
            if not _answered(parent, proc, args.timeout):
                raise TimeoutError("the relay did not answer")
            cpu, switches, by_role, steps = parent.recv()
            return float(cpu), dict(switches), dict(by_role), dict(steps)

        for size in sizes:
            count = max(args.min_count, int(args.messages_mb * (1 << 20) / size))
            _feed(push, pull, size, min(count, 200), args.window)
            (relay0, switches0, roles0, steps0), cpu0 = relay_usage(), time.process_time()
            seconds, _ = _feed(push, pull, size, count, args.window)
            cpu_feeder = time.process_time() - cpu0
            relay1, switches1, roles1, steps1 = relay_usage()
            step_us = {k: (v - steps0.get(k, 0.0)) / count * 1e6 for k, v in steps1.items()}
            if step_us:
                role = "compute" if path == "stage-sync" else "loop"  # the thread timed
                loop_us = (roles1.get(role, 0.0) - roles0.get(role, 0.0)) / count * 1e6
                step_us["other"] = loop_us - sum(step_us.values())
            cpu_relay = relay1 - relay0
            trips_n = max(20, count // 4)
            _, trips = _feed(push, pull, size, trips_n, 1)
            results[size] = {
                "msgs_per_s": count / seconds,
                "rtt_ms": statistics.median(trips) * 1e3,
                "cpu_us_per_message": (cpu_feeder + cpu_relay) / count * 1e6,
                "relay_cpu_us": cpu_relay / count * 1e6,
                "relay_switches": sum(switches1.values()) / count - sum(switches0.values()) / count,
                **{
                    f"relay_switches_{role}": (n - switches0.get(role, 0)) / count
                    for role, n in sorted(switches1.items())
                },
                **{
                    f"relay_cpu_us_{role}": (t - roles0.get(role, 0.0)) / count * 1e6
                    for role, t in sorted(roles1.items())
                },
                **{f"loop_us_{step}": us for step, us in step_us.items()},
                "count": count,
                "trips": trips_n,
            }
        parent.send("stop")
    except zmq.Again:  # a feed's receive timed out: say so if the relay died
        if not proc.is_alive():
            raise RuntimeError(f"the relay process exited (code {proc.exitcode})") from None
        raise
    finally:
        push.close()
        pull.close()
        ctx.term()
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join()
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/stage_relay.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--sizes", default="64K,1M", help="tensor sizes, K or M (default 64K,1M)")
    parser.add_argument("--window", type=int, default=4, help="messages in the relay at once")
    parser.add_argument(
        "--messages-mb", type=float, default=400.0, help="MiB per throughput run (default 400)"
    )
    parser.add_argument("--min-count", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3, help="runs per path, alternating")
    parser.add_argument("--timeout", type=float, default=60.0, help="deadline of every wait, s")
    parser.add_argument("--profile", default=None, help="write the stage relay's pstats here")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument(
        "--steps", action="store_true", help="split the stage loop thread's CPU by step"
    )
    parser.add_argument(
        "--inline-compute",
        action="store_true",
        help="diagnostic: the stage relay computes on its event loop (not what a stage "
        "does), to measure the compute thread's hand-off; not for the ratios",
    )
    parser.add_argument(
        "--sync-track-every",
        type=int,
        default=SYNC_TRACK_EVERY,
        help=f"stage-sync: one output in this many goes tracked (default {SYNC_TRACK_EVERY})",
    )
    parser.add_argument("--quick", action="store_true", help="small runs, one repeat")
    args = parser.parse_args(argv)
    units = {"K": 1 << 10, "M": 1 << 20}
    args.sizes = [int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s)
                  for s in args.sizes.upper().split(",")]  # fmt: skip
    args.paths = [p for p in args.paths.split(",") if p]
    unknown = set(args.paths) - set(KNOWN_PATHS)
    if unknown:
        parser.error(f"unknown paths {sorted(unknown)}; known: {', '.join(KNOWN_PATHS)}")
    if args.quick:
        args.messages_mb, args.repeats, args.min_count = 40.0, 1, 50
    return args


def _label(size: int) -> str:
    return f"{size >> 20}mb" if size % (1 << 20) == 0 else f"{size >> 10}kb"


def _asyncio_raw_ratios(
    med: dict[str, dict[int, dict[str, float]]], sizes: list[int]
) -> dict[str, float]:
    """Stage over raw-asyncio (like for like: both relays are asyncio processes)
    and raw-asyncio over raw (what asyncio alone costs a relay), medians' ratios."""
    ratios: dict[str, float] = {}
    for size in sizes:
        label, asyncio_raw = _label(size), med["raw-asyncio"][size]
        if "stage" in med:
            stage = med["stage"][size]
            ratios[f"ratio_{label}_vs_asyncio_raw"] = round(
                stage["msgs_per_s"] / asyncio_raw["msgs_per_s"], 4
            )
            ratios[f"rtt_ratio_{label}_vs_asyncio_raw"] = round(
                stage["rtt_ms"] / asyncio_raw["rtt_ms"], 4
            )
            ratios[f"cpu_ratio_{label}_vs_asyncio_raw"] = round(
                stage["cpu_us_per_message"] / asyncio_raw["cpu_us_per_message"], 4
            )
        if "raw" in med:
            raw = med["raw"][size]
            ratios[f"asyncio_raw_over_raw_{label}"] = round(
                asyncio_raw["msgs_per_s"] / raw["msgs_per_s"], 4
            )
            ratios[f"rtt_asyncio_raw_over_raw_{label}"] = round(
                asyncio_raw["rtt_ms"] / raw["rtt_ms"], 4
            )
    return ratios


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(level="warning")
    retain_freed_memory()
    runs: dict[str, list[dict[int, dict[str, float]]]] = {p: [] for p in args.paths}
    for rep in range(args.repeats):
        order = args.paths if rep % 2 == 0 else list(reversed(args.paths))
        for path in order:
            last = rep == args.repeats - 1
            runs[path].append(measure(path, args.sizes, args, args.profile if last else None))
    med: dict[str, dict[int, dict[str, float]]] = {}
    for path, path_runs in runs.items():
        med[path] = {}
        for size in args.sizes:
            rows = [r[size] for r in path_runs]
            m = {
                key: statistics.median(r[key] for r in rows)
                for key in rows[0]
                if key not in ("count", "trips") and all(key in r for r in rows)
            }
            med[path][size] = m
            emit({"bench": BENCH, "path": path, "size_bytes": size,
                  **{k: round(v, 4) for k, v in m.items()},
                  "msgs_per_s_runs": [round(r["msgs_per_s"], 1) for r in rows]})  # fmt: skip
    ratios: dict[str, Any] = {}
    if "raw" in med and "stage" in med:
        for size in args.sizes:
            raw, stage = med["raw"][size], med["stage"][size]
            label = _label(size)
            ratios[f"ratio_{label}"] = round(stage["msgs_per_s"] / raw["msgs_per_s"], 4)
            ratios[f"rtt_ratio_{label}"] = round(stage["rtt_ms"] / raw["rtt_ms"], 4)
            ratios[f"cpu_ratio_{label}"] = round(
                stage["cpu_us_per_message"] / raw["cpu_us_per_message"], 4
            )
    if "raw-asyncio" in med:
        ratios.update(_asyncio_raw_ratios(med, args.sizes))
    if "raw" in med and "stage-sync" in med:
        for size in args.sizes:
            raw, sync = med["raw"][size], med["stage-sync"][size]
            label = _label(size)
            ratios[f"sync_ratio_{label}"] = round(sync["msgs_per_s"] / raw["msgs_per_s"], 4)
            ratios[f"sync_cpu_ratio_{label}"] = round(
                sync["cpu_us_per_message"] / raw["cpu_us_per_message"], 4
            )
    if args.inline_compute:  # never mistaken for a stage's figures
        ratios["inline_compute"] = True
    summary(BENCH, **ratios, window=args.window, repeats=args.repeats, loadavg=loadavg())
    return 0


if __name__ == "__main__":
    sys.exit(main())
