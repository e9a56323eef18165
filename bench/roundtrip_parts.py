"""Where one side's CPU goes in a round trip: raw pyzmq, zmq.asyncio, zpipe's layers.

This process pings spawned raw pyzmq echoes (which send each received frame
back, costing nothing in Python; one echo and socket pair per mode) with one
float32 tensor of ``--sizes`` bytes, one message at a time, in each of these
modes, each adding one layer:

``raw``        synchronous pyzmq: ``send_multipart(copy=True)``, blocking
               ``recv_multipart(copy=False)`` (the floor)
``asyncio``    a pre-encoded message sent through the shadow socket, then
               ``await`` a ``zmq.asyncio`` ``recv_multipart`` (its future machinery)
``recv_frames`` the same, received with zpipe's ``recv_frames``
``zpipe``      zpipe's whole path: ``Message``, ``send`` (encode, deadline) and
               ``recv_frames`` + ``decode_frames``, as a client or stage does

and reports per round trip this process's main-thread CPU (``thread_time``: the
Python layers), its CPU in all threads, its voluntary context switches and the
median wall time, median of ``--repeats`` runs, modes interleaved; the summary
has each mode's main-thread CPU over raw's. Counts and CPU move far less than
wall time when other work shares the cores.

    .venv/bin/python bench/roundtrip_parts.py            # about ten seconds
    .venv/bin/python bench/roundtrip_parts.py --quick

Every wait has a deadline (``--timeout``); the echo is killed if anything fails.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import multiprocessing as mp
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
import zmq
import zmq.asyncio

try:
    from bench._common import emit, loadavg, summary, thread_switches
except ImportError:  # run as a script: bench/ itself is sys.path[0]
    from _common import emit, loadavg, summary, thread_switches  # type: ignore[no-redef]

from zpipe.transport.allocator import retain_freed_memory
from zpipe.transport.codec import Message, encode
from zpipe.transport.sockets import decode_frames, new_context, open_socket, recv_frames, send

BENCH = "roundtrip_parts"
MODES = ("raw", "asyncio", "recv_frames", "zpipe")
LOOPBACK = "tcp://127.0.0.1:*"


def _echo(conn: Connection, timeout_s: float) -> None:
    faulthandler.dump_traceback_later(timeout_s * 20, exit=True)
    retain_freed_memory()
    ctx = zmq.Context(io_threads=1)
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (pull, push):
        sock.setsockopt(zmq.LINGER, 0)
    pull.bind(LOOPBACK)
    conn.send(pull.getsockopt_string(zmq.LAST_ENDPOINT))
    push.connect(conn.recv())
    pull.setsockopt(zmq.RCVTIMEO, 50)
    while True:
        try:
            frames = pull.recv_multipart(copy=False)
        except zmq.Again:
            if conn.poll(0) and conn.recv() == "stop":
                break
            continue
        push.send_multipart(frames, copy=False)
    pull.close()
    push.close()
    ctx.term()


def _message(mb: int, tensor: torch.Tensor) -> Message:
    return Message("data", {"run": 0, "mb": mb, "src": "bench"}, tensors=(tensor,))


class Pinger:
    """This process's side: zpipe's sockets; the raw mode uses their shadows."""

    def __init__(self, endpoint_for: Any, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.context = new_context()
        self.push = open_socket(self.context, zmq.PUSH)
        self.pull = open_socket(self.context, zmq.PULL)
        self.pull.bind(LOOPBACK)
        self.push.connect(endpoint_for(self.pull.getsockopt_string(zmq.LAST_ENDPOINT)))
        for sock in (self.push, self.pull):
            sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
            sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))

    async def trips(self, mode: str, tensor: torch.Tensor, count: int) -> list[float]:
        push, pull = self.push._shadow_sock, self.pull._shadow_sock
        encoded = encode(_message(0, tensor))
        walls: list[float] = []
        for mb in range(count):
            started = time.perf_counter()
            if mode == "raw":
                push.send_multipart(encoded, copy=True)
                back = pull.recv_multipart(copy=False)
            elif mode == "asyncio":
                push.send_multipart(encoded, copy=True)
                back = await asyncio.wait_for(self.pull.recv_multipart(copy=False), self.timeout_s)
            elif mode == "recv_frames":
                push.send_multipart(encoded, copy=True)
                back = await recv_frames(self.pull, timeout_s=self.timeout_s, peer="echo",
                                         awaited="pong")  # fmt: skip
            else:
                await send(self.push, _message(mb, tensor), timeout_s=self.timeout_s, peer="echo")
                back = await recv_frames(self.pull, timeout_s=self.timeout_s, peer="echo",
                                         awaited="pong")  # fmt: skip
                decode_frames(back, 1 << 31)
            walls.append(time.perf_counter() - started)
            if len(back) != 2 or len(back[1]) != tensor.nbytes:
                raise RuntimeError("the echo returned a different message")
        return walls

    def close(self) -> None:
        self.push.close(linger=0)
        self.pull.close(linger=0)
        self.context.term()


class Echo:
    """A spawned raw echo process and the pipe that sets it up."""

    def __init__(self, timeout_s: float) -> None:
        spawn = mp.get_context("spawn")
        self.timeout_s = timeout_s
        self.conn, child = spawn.Pipe()
        self.proc = spawn.Process(target=_echo, args=(child, timeout_s), daemon=True)
        self.proc.start()

    def endpoint_for(self, back: str) -> str:
        """The echo's endpoint, once it has been told where to send back."""
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError("the echo did not start")
        endpoint = str(self.conn.recv())
        self.conn.send(back)
        return endpoint

    def stop(self) -> None:
        try:
            self.conn.send("stop")
        except OSError:
            pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


async def measure(args: argparse.Namespace, echoes: dict[str, Echo]) -> dict[tuple[str, int], Any]:
    # Each mode has its own sockets (and echo): a socket zmq.asyncio has watched
    # once stays with zmq.asyncio, so recv_frames would not take its own path there.
    pingers = {mode: Pinger(echo.endpoint_for, args.timeout) for mode, echo in echoes.items()}
    rows: dict[tuple[str, int], dict[str, list[float]]] = {}
    try:
        for size in args.sizes:
            tensor = torch.arange(size // 4, dtype=torch.float32)
            for mode in MODES:
                await pingers[mode].trips(mode, tensor, 100)  # connections up, paths warm
            for rep in range(args.repeats):
                for mode in MODES[rep % 4 :] + MODES[: rep % 4]:
                    main0, cpu0, sw0 = time.thread_time(), time.process_time(), thread_switches()
                    walls = await pingers[mode].trips(mode, tensor, args.trips)
                    row = rows.setdefault((mode, size), {})
                    for key, value in (
                        ("main_cpu_us", (time.thread_time() - main0) / args.trips * 1e6),
                        ("cpu_us", (time.process_time() - cpu0) / args.trips * 1e6),
                        ("switches", (thread_switches() - sw0) / args.trips),
                        ("rtt_us", statistics.median(walls) * 1e6),
                    ):
                        row.setdefault(key, []).append(value)
    finally:
        for pinger in pingers.values():
            pinger.close()
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/roundtrip_parts.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--sizes", default="64K,1M", help="tensor sizes, K or M (default 64K,1M)")
    parser.add_argument("--trips", type=int, default=2000, help="round trips per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode, interleaved")
    parser.add_argument("--timeout", type=float, default=30.0, help="deadline of every wait, s")
    parser.add_argument("--quick", action="store_true", help="few trips, one repeat")
    args = parser.parse_args(argv)
    units = {"K": 1 << 10, "M": 1 << 20}
    args.sizes = [int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s)
                  for s in args.sizes.upper().split(",")]  # fmt: skip
    if args.quick:
        args.trips, args.repeats = 200, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    retain_freed_memory()
    echoes = {mode: Echo(args.timeout) for mode in MODES}
    try:
        rows = asyncio.run(measure(args, echoes))
    finally:
        for echo in echoes.values():
            echo.stop()
    ratios: dict[str, Any] = {}
    for (mode, size), row in rows.items():
        med = {key: round(statistics.median(values), 2) for key, values in row.items()}
        emit({"bench": BENCH, "mode": mode, "size_bytes": size, **med})
        raw = statistics.median(rows[("raw", size)]["main_cpu_us"])
        label = f"{size >> 20}mb" if size % (1 << 20) == 0 else f"{size >> 10}kb"
        if mode != "raw":
            ratios[f"{mode}_main_cpu_over_raw_{label}"] = round(med["main_cpu_us"] / raw, 3)
    summary(BENCH, **ratios, trips=args.trips, repeats=args.repeats, loadavg=loadavg())
    return 0


if __name__ == "__main__":
    sys.exit(main())
