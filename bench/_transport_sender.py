"""The sender of ``bench/transport.py``: it opens every path's sockets, times the
throughput runs and round trips against the spawned receiver
(:mod:`bench._transport_paths`) and collects each path's :class:`Result`.

Split out of ``bench/transport.py`` (which keeps the notes, the summary and the
command line) to keep both modules under 600 lines; behaviour is unchanged but for
the ``raw_asyncio`` path.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import zmq

from bench._sodium import BoxTiming, Sodium
from bench._sodium import load as load_sodium
from bench._transport_paths import (
    LOOPBACK,
    MAX_BYTES,
    OPTIONS,
    RAW_HEADER,
    RECEIVER_KEY,
    SENDER_KEY,
    Channel,
    check_tensor,
    copy_below,
    data_message,
    make_tensor,
    open_channel_sockets,
    pipe_recv,
    raw_buffer,
    run_deadline,
)
from bench._transport_results import Result, Usage, UsageMark, round_trip_steps
from zpipe.transport.sockets import decode_frames, recv_frames, send


class Sender:
    def __init__(
        self, args: argparse.Namespace, conn: Connection, proc: Any, keys_dir: Path
    ) -> None:
        self.args = args
        self.conn = conn
        self.proc = proc
        self.keys_dir = keys_dir
        self.timeout_s: float = args.timeout
        self.channels: dict[str, Channel] = {}
        self.tensors: dict[int, torch.Tensor] = {}
        # libsodium's own speed per size (the CURVE limit), when it loads
        self.sodium: Sodium | None = load_sodium() if "zpipe_curve" in args.paths else None
        self.boxes: dict[int, BoxTiming] = {}

    def alive(self) -> bool:
        return bool(self.proc.is_alive())

    async def reply(self, what: str, timeout_s: float | None = None) -> dict[str, Any]:
        reply = await pipe_recv(self.conn, timeout_s or self.timeout_s, what, self.alive)
        if reply.get("ok") != what:
            raise RuntimeError(f"receiver answered {reply!r}, expected {what!r}")
        return reply

    async def setup(self, path: str) -> None:
        ch = open_channel_sockets(
            path,
            self.timeout_s,
            self.args.raw_hwm,
            self.keys_dir if path == "zpipe_curve" else None,
            SENDER_KEY,
            RECEIVER_KEY,
        )
        self.channels[path] = ch
        ch.pull.bind(LOOPBACK)
        back = ch.pull.getsockopt_string(zmq.LAST_ENDPOINT)
        keys = str(self.keys_dir) if path == "zpipe_curve" else None
        self.conn.send({"op": "setup", "path": path, "endpoint": back, "keys_dir": keys})
        reply = await self.reply("setup")
        ch.push.connect(reply["endpoint"])
        # Both directions up (and both CURVE handshakes done) before anything is timed.
        await self.echo(path, 64, 1)

    def tensor(self, size: int) -> torch.Tensor:
        if size not in self.tensors:
            self.tensors[size] = make_tensor(size)
        return self.tensors[size]

    async def throughput(self, path: str, size: int, count: int) -> tuple[float, Usage]:
        """Seconds from the first send to the receiver's ack of the last message, and
        what both processes spent meanwhile."""
        ch = self.channels[path]
        tensor = self.tensor(size)
        self.conn.send({"op": "tput", "path": path, "size": size, "count": count})
        await self.reply("armed")
        mark = UsageMark.now()
        if path == "raw":
            started = time.perf_counter()
            for _ in range(count):
                # A buffer per message, as a sender of a new tensor each time must
                # make (one reused buffer saves pyzmq's collector a release)
                ch.push.send_multipart([RAW_HEADER, raw_buffer(tensor)], copy=False)
            ch.pull.recv()
            elapsed = time.perf_counter() - started
        elif path == "raw_asyncio":
            # raw's messages under zmq.asyncio: each send awaited, the ack too, one
            # deadline over the run (as the zpipe path's receive loops have)
            async def stream() -> None:
                for _ in range(count):
                    await ch.push.send_multipart([RAW_HEADER, raw_buffer(tensor)], copy=False)
                await ch.pull.recv()

            started = time.perf_counter()
            await asyncio.wait_for(stream(), run_deadline(self.timeout_s, size, count))
            elapsed = time.perf_counter() - started
        else:
            started = time.perf_counter()
            for mb in range(count):
                await send(
                    ch.push,
                    data_message(mb, tensor, "bench"),
                    timeout_s=self.timeout_s,
                    peer=RECEIVER_KEY,
                    copy_below=copy_below(path, self.args.copy_below),
                )
            frames = await recv_frames(
                ch.pull, timeout_s=self.timeout_s, peer=RECEIVER_KEY, awaited="ack"
            )
            elapsed = time.perf_counter() - started
            if decode_frames(frames, MAX_BYTES).body["nonce"] != count:
                raise RuntimeError("the receiver acknowledged a different count")
        usage, _ = await self._usage(mark)
        return elapsed, usage

    async def _usage(self, mark: UsageMark) -> tuple[Usage, dict[str, Any]]:
        """This process's usage since ``mark`` plus the receiver's, from its reply
        (returned too)."""
        mine = mark.since("sender")
        done = await self.reply("done")
        theirs = Usage(
            float(done["cpu_s"]),
            int(done["switches"]),
            {str(k): float(v) for k, v in dict(done.get("cpu_by_thread") or {}).items()},
        )
        return mine.plus(theirs), done

    async def echo(
        self, path: str, size: int, count: int
    ) -> tuple[list[float], Usage, list[tuple[float, ...]]]:
        """Round-trip times of ``count`` ping-pongs of ``size`` bytes, what both
        processes spent on them, and each trip's steps (``RTT_STEPS``)."""
        ch = self.channels[path]
        tensor = self.tensor(size)
        self.conn.send({"op": "echo", "path": path, "size": size, "count": count})
        await self.reply("armed")
        mark = UsageMark.now()
        clock = time.perf_counter
        # per trip: started, sent (the send returned), received, decoded (both
        # paths take the same four readings of the clock)
        stamps: list[tuple[float, float, float, float]] = []
        if path == "raw":
            for _ in range(count):
                started = clock()
                ch.push.send_multipart([RAW_HEADER, raw_buffer(tensor)], copy=False)
                sent = clock()
                frames = ch.pull.recv_multipart(copy=False)
                received = clock()
                stamps.append((started, sent, received, received))
                if len(frames) != 2 or len(frames[1]) != size:
                    raise RuntimeError("raw echo came back with the wrong size")
        elif path == "raw_asyncio":

            async def ping_pong() -> None:
                for _ in range(count):
                    started = clock()
                    await ch.push.send_multipart([RAW_HEADER, raw_buffer(tensor)], copy=False)
                    sent = clock()
                    frames = await ch.pull.recv_multipart(copy=False)
                    received = clock()
                    stamps.append((started, sent, received, received))
                    if len(frames) != 2 or len(frames[1]) != size:
                        raise RuntimeError("raw_asyncio echo came back with the wrong size")

            await asyncio.wait_for(ping_pong(), run_deadline(self.timeout_s, size, count))
        else:
            # As the client's result loop: recv_frames(timeout_s=None), one deadline per run.
            async def loop() -> None:
                for mb in range(count):
                    started = clock()
                    await send(
                        ch.push,
                        data_message(mb, tensor, "bench"),
                        timeout_s=self.timeout_s,
                        peer=RECEIVER_KEY,
                        copy_below=copy_below(path, self.args.copy_below),
                    )
                    sent = clock()
                    frames = await recv_frames(
                        ch.pull, timeout_s=None, peer=RECEIVER_KEY, awaited="pong"
                    )
                    received = clock()
                    message = decode_frames(frames, MAX_BYTES)
                    stamps.append((started, sent, received, clock()))
                    check_tensor(message, size)

            await asyncio.wait_for(loop(), run_deadline(self.timeout_s, size, count))
        usage, done = await self._usage(mark)
        echo_stamps = [(float(a), float(b)) for a, b in done.get("stamps") or ()]
        steps = round_trip_steps(stamps, echo_stamps) if len(echo_stamps) == count else []
        return [s[3] - s[0] for s in stamps], usage, steps

    async def measure_size(self, size: int, paths: list[str]) -> dict[str, Result]:
        args = self.args
        results = {path: Result(path, size) for path in paths}
        # Warm-up, per path: enough messages to fill both queues (2 x HWM) a few times,
        # so every context's I/O thread has grown its heap; the raw rate picks N.
        warm = max(4 * OPTIONS.send_hwm, min(2000, (128 << 20) // size))
        if args.quick:
            warm = max(2, warm // 8)
        rates: dict[str, float] = {}
        for path in paths:
            seconds, _ = await self.throughput(path, size, warm)
            rates[path] = warm * size / seconds
            await self.echo(path, size, 3)
        rate = rates.get("raw") or max(rates.values())
        count = args.count or int(
            min(args.max_count, max(args.min_count, args.seconds * rate / size))
        )
        per_trip = 2 * size / rate + 100e-6
        trips = args.trips or int(min(2000, max(20, args.rtt_seconds / per_trip)))
        for rep in range(args.repeats):
            for path in rotate(paths, rep):
                results[path].count = count
                seconds, usage = await self.throughput(path, size, count)
                results[path].seconds.append(seconds)
                results[path].cpu_seconds.append(usage.cpu_s)
                results[path].switches.append(usage.switches)
                results[path].thread_seconds.append(usage.by_thread)
        chunks = max(1, min(args.rtt_rounds, trips))
        for rep in range(chunks):
            for path in rotate(paths, rep):
                n = trips // chunks + (1 if rep < trips % chunks else 0)
                rtts, usage, steps = await self.echo(path, size, n)
                results[path].rtts.extend(rtts)
                results[path].rtt_rounds.append(statistics.median(rtts))
                results[path].rtt_steps.extend(steps)
                results[path].add_rtt_usage(usage)
        if self.sodium is not None:
            # In this process, between the timed runs: what the cipher alone costs.
            self.boxes[size] = self.sodium.time_box(size, budget_s=0.05 if args.quick else 0.2)
        return results

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()
        self.channels.clear()


def rotate(paths: list[str], by: int) -> list[str]:
    """Interleave paths in a different order each repeat (no fixed position bias)."""
    k = by % len(paths)
    return paths[k:] + paths[:k]
