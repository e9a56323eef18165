"""Copy or share a tensor's buffer when sending it: what each costs per message.

pyzmq sends a Python buffer with ``copy=False`` by handing libzmq a pointer and a
free function; when libzmq's I/O thread has written the frame it calls that
function, which wakes pyzmq's garbage-collector thread ("gc"), which takes the
GIL to drop its reference. With ``copy=True`` (or below the socket's
``copy_threshold``) pyzmq instead allocates a libzmq message and copies the
bytes in (one memcpy, no thread). A received ``zmq.Frame`` sent on again is
neither: libzmq only counts one more reference.

This benchmark sends one float32 tensor buffer per message from this process
(plain synchronous pyzmq) to a spawned relay that forwards the frames it
receives (no gc there) straight back, for each size (``--sizes``) and mode:

``share``   ``send_multipart([header, buffer], copy=False)`` (zero-copy, gc wake)
``copy``    the same, ``copy=True`` (what zpipe's untracked sends do below
            ``COPY_BELOW_BYTES``)
``frame``   a received frame sent on (the relay's own way; the ceiling)

and reports per message: the round-trip time (one at a time), the throughput of
back-to-back sends (``--window`` in flight), this process's CPU time and its
voluntary context switches (every thread: each is one sleep some hand-off had
to end), medians of ``--repeats`` runs, modes interleaved. ``zpipe.transport.
sockets.COPY_BELOW_BYTES`` is chosen from these numbers.

    .venv/bin/python bench/send_copy.py              # about a minute
    .venv/bin/python bench/send_copy.py --quick      # a few seconds
"""

from __future__ import annotations

import argparse
import faulthandler
import multiprocessing as mp
import statistics
import sys
import time
from collections import deque
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import zmq

try:
    from bench._common import emit, loadavg, summary
except ImportError:  # run as a script: bench/ itself is sys.path[0]
    from _common import emit, loadavg, summary  # type: ignore[no-redef]

from zpipe.transport.allocator import retain_freed_memory

BENCH = "send_copy"
MODES = ("share", "copy", "frame")
LOOPBACK = "tcp://127.0.0.1:*"
HEADER = b"\x00" * 48
HWM = 16


def _switches() -> int:
    """Voluntary context switches of every thread of this process so far."""
    total = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
        except OSError:  # a thread that just ended
            continue
    return total


def _relay(conn: Connection, timeout_s: float) -> None:
    faulthandler.dump_traceback_later(timeout_s * 20, exit=True)
    retain_freed_memory()
    ctx = zmq.Context(io_threads=1)
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (pull, push):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, HWM)
        sock.setsockopt(zmq.RCVHWM, HWM)
    pull.bind(LOOPBACK)
    conn.send(pull.getsockopt_string(zmq.LAST_ENDPOINT))
    push.connect(conn.recv())
    pull.setsockopt(zmq.RCVTIMEO, 50)
    while True:
        try:
            frames = pull.recv_multipart(copy=False)
        except zmq.Again:
            if conn.poll(0):
                if conn.recv() == "stop":
                    break
                conn.send(time.process_time())
            continue
        push.send_multipart(frames, copy=False)
    pull.close()
    push.close()
    ctx.term()


def _run(
    push: zmq.Socket[Any],
    pull: zmq.Socket[Any],
    mode: str,
    buffer: memoryview,
    count: int,
    window: int,
) -> tuple[float, list[float]]:
    """Seconds for ``count`` messages with at most ``window`` in flight, and the
    round-trip time of each. In ``frame`` mode each message that comes back is
    sent on again (the first ``window`` are fresh copies)."""
    returned: deque[list[Any]] = deque()
    in_flight: deque[float] = deque()
    trips: list[float] = []
    sent = done = 0
    started = time.perf_counter()
    while done < count:
        while sent < count and sent - done < window:
            if mode != "frame":
                frames: list[Any] = [HEADER, buffer]
            elif not returned:
                frames = [HEADER, zmq.Frame(buffer, copy=True)]
            else:
                frames = returned.popleft()
            in_flight.append(time.perf_counter())
            push.send_multipart(frames, copy=mode == "copy")
            sent += 1
        back = pull.recv_multipart(copy=False)
        trips.append(time.perf_counter() - in_flight.popleft())
        if len(back) != 2 or len(back[1]) != len(buffer):
            raise RuntimeError("the relay returned a different message")
        if mode == "frame":
            returned.append(back)
        done += 1
    return time.perf_counter() - started, trips


def measure(args: argparse.Namespace) -> dict[tuple[str, int], dict[str, list[float]]]:
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    proc = spawn.Process(target=_relay, args=(child, args.timeout), daemon=True)
    proc.start()
    ctx = zmq.Context(io_threads=1)
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    rows: dict[tuple[str, int], dict[str, list[float]]] = {}
    try:
        for sock in (push, pull):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, HWM)
            sock.setsockopt(zmq.RCVHWM, HWM)
            sock.setsockopt(zmq.SNDTIMEO, int(args.timeout * 1000))
            sock.setsockopt(zmq.RCVTIMEO, int(args.timeout * 1000))
        pull.bind(LOOPBACK)
        if not parent.poll(args.timeout):
            raise TimeoutError("the relay did not start")
        push.connect(parent.recv())
        parent.send(pull.getsockopt_string(zmq.LAST_ENDPOINT))

        def relay_cpu() -> float:
            parent.send("cpu")
            if not parent.poll(args.timeout):
                raise TimeoutError("the relay did not answer")
            return float(parent.recv())

        for size in args.sizes:
            buffer = memoryview(bytearray(size))
            count = max(args.min_count, int(args.messages_mb * (1 << 20) / size))
            for mode in MODES:
                _run(push, pull, mode, buffer, min(count, 100), args.window)  # warm
            for rep in range(args.repeats):
                order = MODES[rep % 3 :] + MODES[: rep % 3]
                for mode in order:
                    row = rows.setdefault((mode, size), {})
                    relay0, cpu0, sw0 = relay_cpu(), time.process_time(), _switches()
                    seconds, _ = _run(push, pull, mode, buffer, count, args.window)
                    cpu, sw = time.process_time() - cpu0, _switches() - sw0
                    relay = relay_cpu() - relay0
                    _, trips = _run(push, pull, mode, buffer, max(20, count // 4), 1)
                    for key, value in (
                        ("msgs_per_s", count / seconds),
                        ("rtt_us", statistics.median(trips) * 1e6),
                        ("sender_cpu_us", cpu / count * 1e6),
                        ("relay_cpu_us", relay / count * 1e6),
                        ("sender_switches", sw / count),
                    ):
                        row.setdefault(key, []).append(value)
        parent.send("stop")
    finally:
        push.close()
        pull.close()
        ctx.term()
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join()
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/send_copy.py", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="64K,256K,1M,4M", help="buffer sizes, K or M")
    parser.add_argument("--window", type=int, default=4, help="messages in flight (throughput)")
    parser.add_argument("--messages-mb", type=float, default=200.0, help="MiB per run")
    parser.add_argument("--min-count", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=30.0, help="deadline of every wait, s")
    parser.add_argument("--quick", action="store_true", help="small runs, one repeat")
    args = parser.parse_args(argv)
    units = {"K": 1 << 10, "M": 1 << 20}
    args.sizes = [int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s)
                  for s in args.sizes.upper().split(",")]  # fmt: skip
    if args.quick:
        args.messages_mb, args.repeats, args.min_count = 20.0, 1, 20
    return args


def _label(size: int) -> str:
    return f"{size >> 20}mb" if size % (1 << 20) == 0 else f"{size >> 10}kb"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    retain_freed_memory()
    rows = measure(args)
    ratios: dict[str, Any] = {}
    for (mode, size), row in rows.items():
        med = {key: round(statistics.median(values), 3) for key, values in row.items()}
        emit({"bench": BENCH, "mode": mode, "size_bytes": size, **med})
        if mode == "copy":
            share = {k: statistics.median(v) for k, v in rows[("share", size)].items()}
            label = _label(size)
            ratios[f"copy_over_share_msgs_{label}"] = round(
                med["msgs_per_s"] / share["msgs_per_s"], 3
            )
            ratios[f"copy_over_share_rtt_{label}"] = round(med["rtt_us"] / share["rtt_us"], 3)
            ratios[f"copy_minus_share_cpu_us_{label}"] = round(
                med["sender_cpu_us"] - share["sender_cpu_us"], 1
            )
    summary(BENCH, **ratios, repeats=args.repeats, window=args.window, loadavg=loadavg())
    return 0


if __name__ == "__main__":
    sys.exit(main())
