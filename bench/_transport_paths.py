"""The two processes' shared pieces of ``bench/transport.py``: sockets per path, the
message the zpipe paths send, the command pipe between the processes, and the
spawned receiver (sink and echo for every path).

Split out of ``bench/transport.py`` (the sender is in ``bench/_transport_sender.py``,
the results in ``bench/_transport_results.py``) to keep the modules small.
"""

from __future__ import annotations

import asyncio
import faulthandler
import os
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import zmq
import zmq.asyncio

from bench._transport_results import UsageMark
from zpipe.log import configure_logging
from zpipe.transport import security
from zpipe.transport.allocator import retain_freed_memory
from zpipe.transport.codec import Message
from zpipe.transport.sockets import (
    COPY_BELOW_BYTES,
    SocketOptions,
    decode_frames,
    new_context,
    open_socket,
    recv_frames,
    send,
)

LOOPBACK = "tcp://127.0.0.1:*"
# The raw baseline's "small header": about as long as zpipe's msgpack header.
RAW_HEADER = b"\x00" * 48
SENDER_KEY = "sender"
RECEIVER_KEY = "receiver"
OPTIONS = SocketOptions()
MAX_BYTES = OPTIONS.max_message_bytes

Runner = Callable[[Coroutine[Any, Any, Any]], Any]


def loop_runner() -> tuple[Runner, bool]:
    """uvloop.run where importable (as zpipe's CLI), else asyncio.run."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run, False
    return uvloop.run, True


def make_tensor(size: int) -> torch.Tensor:
    return torch.arange(size // 4, dtype=torch.float32)


def raw_buffer(tensor: torch.Tensor) -> memoryview:
    return tensor.view(torch.uint8).numpy().data


def data_message(mb: int, tensor: torch.Tensor, src: str) -> Message:
    return Message("data", {"run": 0, "mb": mb, "src": src}, tensors=(tensor,))


async def pipe_recv(
    conn: Connection, timeout_s: float, what: str, alive: Callable[[], bool] | None = None
) -> dict[str, Any]:
    """Next command/reply from the other process, polled so the event loop keeps
    running (a CurveAuthenticator must answer handshakes meanwhile)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.0002
    while not conn.poll(0):
        if alive is not None and not alive():
            raise RuntimeError(f"the receiver process died while we waited for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:g} s")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.01)
    reply: dict[str, Any] = conn.recv()
    if "error" in reply:
        raise RuntimeError(f"receiver failed: {reply['error']}")
    return reply


@dataclass
class Channel:
    """One path's sockets in one process: ``push`` sends to the peer, ``pull`` receives."""

    path: str
    context: Any
    push: Any = None
    pull: Any = None
    authenticator: security.CurveAuthenticator | None = None
    allowed: security.PeerAllowList | None = None

    def close(self) -> None:
        for sock in (self.push, self.pull):
            if sock is not None:
                sock.close(linger=0)
        if self.authenticator is not None:
            self.authenticator.stop()
        self.context.term()


def open_channel_sockets(
    path: str, timeout_s: float, raw_hwm: int, keys_dir: Path | None, me: str, peer: str
) -> Channel:
    """A context and unattached PUSH/PULL for ``path``; CURVE set up where asked."""
    if path == "raw":
        ctx: Any = zmq.Context(io_threads=1)
        ch = Channel(path, ctx, ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL))
        for sock in (ch.push, ch.pull):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, raw_hwm)
            sock.setsockopt(zmq.RCVHWM, raw_hwm)
            sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
            sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        return ch
    if path == "raw_asyncio":
        # raw's sockets under zmq.asyncio: its own asyncio context, raw's options
        # but the timeouts (asyncio sockets never block in libzmq; every await has
        # a deadline instead)
        plain: Any = zmq.asyncio.Context(io_threads=1)
        ch = Channel(path, plain, plain.socket(zmq.PUSH), plain.socket(zmq.PULL))
        for sock in (ch.push, ch.pull):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, raw_hwm)
            sock.setsockopt(zmq.RCVHWM, raw_hwm)
        return ch
    actx = new_context()
    ch = Channel(path, actx, open_socket(actx, zmq.PUSH), open_socket(actx, zmq.PULL))
    if path == "zpipe_curve":
        assert keys_dir is not None
        mine = security.load_keypair(keys_dir, me)
        peer_public = security.load_keypair_public(keys_dir, peer)
        ch.allowed = security.PeerAllowList({peer: peer_public})
        ch.authenticator = security.CurveAuthenticator(actx, ch.allowed)
        ch.authenticator.start()
        security.secure_server(ch.pull, mine)
        security.secure_client(ch.push, mine, peer_public)
    return ch


def copy_below(path: str, configured: int) -> int:
    """zpipe_shared is the zpipe path sharing every buffer from 64 KiB, as before copies."""
    return 0 if path == "zpipe_shared" else configured


def run_deadline(timeout_s: float, size: int, count: int) -> float:
    """Deadline of one whole run: the per-wait timeout plus time for >= 50 MB/s."""
    return timeout_s + count * size / 50e6


def check_tensor(message: Message, size: int) -> None:
    if len(message.tensors) != 1 or message.tensors[0].nbytes != size:
        raise RuntimeError(f"expected one tensor of {size} bytes, got {message.tensors!r:.80}")


def check_sender(ch: Channel, frame: zmq.Frame) -> None:
    """What a stage does on CURVE links: the sender's key, again on every message."""
    if ch.allowed is not None:
        key = security.sender_public_key(frame)
        if key is None or key not in ch.allowed:
            raise RuntimeError("message from a key that is not allowed")


# ---------------------------------------------------------------------------- receiver


@dataclass
class ReceiverSettings:
    timeout_s: float
    deadline_s: float
    raw_hwm: int
    tune_malloc: bool
    copy_below: int = COPY_BELOW_BYTES
    cpu: int | None = None  # pinned to this CPU (all threads), or not pinned


def receiver_main(conn: Connection, settings: ReceiverSettings) -> None:
    """Entry point of the spawned receiver process."""
    faulthandler.dump_traceback_later(settings.deadline_s, exit=True)
    if settings.cpu is not None:
        os.sched_setaffinity(0, {settings.cpu})  # before libzmq's threads start
    configure_logging(level="warning")
    if settings.tune_malloc:
        retain_freed_memory()
    runner, has_uvloop = loop_runner()
    try:
        runner(Receiver(conn, settings, has_uvloop).serve())
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the sender went away; nothing left to report to
    finally:
        conn.close()


class Receiver:
    def __init__(self, conn: Connection, settings: ReceiverSettings, has_uvloop: bool) -> None:
        self.conn = conn
        self.settings = settings
        self.has_uvloop = has_uvloop
        self.channels: dict[str, Channel] = {}

    async def serve(self) -> None:
        self.conn.send({"ok": "hello", "uvloop": self.has_uvloop})
        try:
            while True:
                cmd = await pipe_recv(self.conn, self.settings.deadline_s, "a command")
                if cmd["op"] == "quit":
                    self.conn.send({"ok": "bye"})
                    return
                try:
                    reply = await self.handle(cmd)
                except Exception as exc:
                    reply = {"error": f"{cmd['op']} {cmd.get('path')}: {exc!r}"}
                self.conn.send(reply)
        finally:
            for ch in self.channels.values():
                ch.close()

    async def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op, path = cmd["op"], cmd["path"]
        if op == "setup":
            keys = Path(cmd["keys_dir"]) if cmd.get("keys_dir") else None
            ch = open_channel_sockets(
                path, self.settings.timeout_s, self.settings.raw_hwm, keys, RECEIVER_KEY, SENDER_KEY
            )
            self.channels[path] = ch
            ch.pull.bind(LOOPBACK)
            ch.push.connect(cmd["endpoint"])
            return {"ok": "setup", "endpoint": ch.pull.getsockopt_string(zmq.LAST_ENDPOINT)}
        ch = self.channels[path]
        size, count = int(cmd["size"]), int(cmd["count"])
        self.conn.send({"ok": "armed"})
        started = time.perf_counter()
        mark = UsageMark.now()
        # per round trip: when the ping was received and when its echo was queued
        # (perf_counter is the system's monotonic clock, the sender's too)
        stamps: list[tuple[float, float]] = []
        if op == "tput":
            if path == "raw":
                self.raw_sink(ch, count)
            elif path == "raw_asyncio":
                await self.raw_asyncio_sink(ch, size, count)
            else:
                await self.zpipe_sink(ch, size, count)
        elif op == "echo":
            if path == "raw":
                self.raw_echo(ch, count, stamps)
            elif path == "raw_asyncio":
                await self.raw_asyncio_echo(ch, size, count, stamps)
            else:
                await self.zpipe_echo(ch, size, count, stamps)
        else:
            raise ValueError(f"unknown op {op!r}")
        usage = mark.since("receiver")
        return {
            "ok": "done",
            "elapsed_s": time.perf_counter() - started,
            "cpu_s": usage.cpu_s,
            "switches": usage.switches,
            "cpu_by_thread": usage.by_thread,
            "stamps": stamps,
        }

    def raw_sink(self, ch: Channel, count: int) -> None:
        for _ in range(count):
            ch.pull.recv_multipart(copy=False)
        ch.push.send(b"ack")

    def raw_echo(self, ch: Channel, count: int, stamps: list[tuple[float, float]]) -> None:
        clock = time.perf_counter
        for _ in range(count):
            frames = ch.pull.recv_multipart(copy=False)
            got = clock()
            ch.push.send_multipart(frames, copy=False)
            stamps.append((got, clock()))

    async def raw_asyncio_sink(self, ch: Channel, size: int, count: int) -> None:
        # raw_sink under zmq.asyncio on this loop: nothing decoded, one deadline per run
        async def loop() -> None:
            for _ in range(count):
                await ch.pull.recv_multipart(copy=False)
            await ch.push.send(b"ack")

        await asyncio.wait_for(loop(), run_deadline(self.settings.timeout_s, size, count))

    async def raw_asyncio_echo(
        self, ch: Channel, size: int, count: int, stamps: list[tuple[float, float]]
    ) -> None:
        clock = time.perf_counter

        async def loop() -> None:
            for _ in range(count):
                frames = await ch.pull.recv_multipart(copy=False)
                got = clock()
                await ch.push.send_multipart(frames, copy=False)
                stamps.append((got, clock()))

        await asyncio.wait_for(loop(), run_deadline(self.settings.timeout_s, size, count))

    async def zpipe_sink(self, ch: Channel, size: int, count: int) -> None:
        # As a stage's receive loop: recv_frames without a per-message deadline
        # (timeout_s=None); the whole run has one instead.
        async def loop() -> None:
            for _ in range(count):
                frames = await recv_frames(
                    ch.pull, timeout_s=None, peer=SENDER_KEY, awaited="micro-batch"
                )
                check_sender(ch, frames[0])
                message = decode_frames(frames, MAX_BYTES)
                check_tensor(message, size)

        await asyncio.wait_for(loop(), run_deadline(self.settings.timeout_s, size, count))
        await send(
            ch.push,
            Message("probe_ack", {"nonce": count}),
            timeout_s=self.settings.timeout_s,
            peer=SENDER_KEY,
        )

    async def zpipe_echo(
        self, ch: Channel, size: int, count: int, stamps: list[tuple[float, float]]
    ) -> None:
        timeout = self.settings.timeout_s
        clock = time.perf_counter

        async def loop() -> None:
            for _ in range(count):
                frames = await recv_frames(ch.pull, timeout_s=None, peer=SENDER_KEY, awaited="ping")
                got = clock()
                check_sender(ch, frames[0])
                message = decode_frames(frames, MAX_BYTES)
                check_tensor(message, size)
                # Forward the received tensor (a view on the frame), as a stage
                # forwards its output: zero-copy both ways.
                await send(
                    ch.push,
                    data_message(int(message.body["mb"]), message.tensors[0], "echo"),
                    timeout_s=timeout,
                    peer=SENDER_KEY,
                    copy_below=copy_below(ch.path, self.settings.copy_below),
                )
                stamps.append((got, clock()))

        await asyncio.wait_for(loop(), run_deadline(timeout, size, count))
