"""bench/stage_relay.py's two raw relays: ``raw``, the blocking pyzmq ceiling, and
``raw-asyncio``, the same PULL -> PUSH loop under ``zmq.asyncio`` (the like-for-like
baseline of an asyncio process). Neither decodes anything; both answer the
feeder's requests (``usage``, ``stop``) between runs."""

from __future__ import annotations

import asyncio
from multiprocessing.connection import Connection
from typing import Any

import zmq
import zmq.asyncio

try:
    from bench._relay_parts import LOOPBACK, OPTIONS, readable, usage
except ImportError:  # run as a script: bench/ itself is sys.path[0]
    from _relay_parts import LOOPBACK, OPTIONS, readable, usage  # type: ignore[no-redef]


def _relay_sockets(ctx: Any) -> tuple[Any, Any]:
    """PULL and PUSH with zpipe's high-water marks and LINGER 0 (blocking or asyncio)."""
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (pull, push):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, OPTIONS.send_hwm)
        sock.setsockopt(zmq.RCVHWM, OPTIONS.recv_hwm)
    return pull, push


def raw_relay(conn: Connection) -> None:
    """raw: a blocking loop, ``recv_multipart(copy=False)`` then
    ``send_multipart(frames, copy=False)``; it waits inside libzmq (GIL released)."""
    ctx = zmq.Context(io_threads=1)
    pull, push = _relay_sockets(ctx)
    pull.bind(LOOPBACK)
    conn.send(pull.getsockopt_string(zmq.LAST_ENDPOINT))
    push.connect(conn.recv())
    pull.setsockopt(zmq.RCVTIMEO, 50)
    while True:
        try:
            frames = pull.recv_multipart(copy=False)
        except zmq.Again:  # idle: the feeder's requests come between runs
            if conn.poll(0):
                if conn.recv() == "stop":
                    break
                conn.send(usage())
            continue
        push.send_multipart(frames, copy=False)
    pull.close()
    push.close()
    ctx.term()


async def raw_asyncio_relay(conn: Connection, deadline_s: float) -> None:
    """raw-asyncio: raw's loop under ``zmq.asyncio`` on this event loop (uvloop when
    the caller runs it there), ``await recv_multipart(copy=False)`` then ``await
    send_multipart(frames, copy=False)``, nothing decoded. The forwarding task and
    the feeder's requests share the loop, as a stage's data and control do; the
    whole relay runs under one deadline (``deadline_s``), as a stage's receive
    loop has none per message."""
    ctx = zmq.asyncio.Context(io_threads=1)
    pull, push = _relay_sockets(ctx)

    async def forward() -> None:
        while True:
            frames = await pull.recv_multipart(copy=False)
            await push.send_multipart(frames, copy=False)

    relay: asyncio.Task[None] | None = None
    try:
        async with asyncio.timeout(deadline_s):
            pull.bind(LOOPBACK)
            conn.send(pull.getsockopt_string(zmq.LAST_ENDPOINT))
            await readable(conn)
            push.connect(conn.recv())
            relay = asyncio.create_task(forward())
            while True:
                await readable(conn)
                if relay.done():  # it failed: say so rather than starve the feeder
                    relay.result()
                if conn.recv() == "stop":
                    break
                conn.send(usage())
    finally:
        if relay is not None:
            relay.cancel()
            await asyncio.gather(relay, return_exceptions=True)
        pull.close(linger=0)
        push.close(linger=0)
        ctx.term()
