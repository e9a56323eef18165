"""sockets.send on a full send-only socket waits on the socket's file descriptor
(no zmq.asyncio future, no wait left on the descriptor afterwards): every
message arrives whole and in order once the reader makes room, the deadline
still holds, and a socket zmq.asyncio already watches keeps zmq.asyncio's path."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio

from zpipe._errors import TransportTimeout
from zpipe.transport import fd_wait
from zpipe.transport.codec import Message
from zpipe.transport.fd_wait import ZpipeSocket
from zpipe.transport.sockets import SocketOptions, decode_frames, new_context, open_socket, send

MAX = 1 << 31
TIGHT = SocketOptions(send_hwm=1, recv_hwm=1)


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    context = new_context()
    yield context
    context.destroy(linger=0)


def data(mb: int, size: int) -> Message:
    # distinct bytes per message: a reordered or mixed-up frame would show
    tensor = (torch.arange(size // 4, dtype=torch.int32) * 7 + mb).contiguous()
    return Message("data", {"run": 0, "mb": mb, "src": "t"}, tensors=(tensor,))


@pytest.mark.parametrize("size", [1 << 10, 1 << 20])  # copied and shared buffers
async def test_a_full_queue_waits_for_room_and_delivers_every_byte_in_order(
    context: zmq.asyncio.Context, size: int
) -> None:
    tx = open_socket(context, zmq.PUSH, TIGHT)
    rx = open_socket(context, zmq.PULL, TIGHT)
    port = rx.bind_to_random_port("tcp://127.0.0.1")
    tx.connect(f"tcp://127.0.0.1:{port}")
    count = 24  # far more than both queues and the socket buffers hold at 1 MiB

    async def sender() -> None:
        for mb in range(count):
            await send(tx, data(mb, size), timeout_s=30.0, peer="rx")

    sending = asyncio.create_task(sender())
    shadow = rx._shadow_sock
    for mb in range(count):
        await asyncio.sleep(0.001 if mb % 4 == 0 else 0)  # a slow reader now and then
        while True:
            try:
                frames = shadow.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:
                await asyncio.sleep(0.0005)
        message = decode_frames(frames, MAX)
        assert message.body["mb"] == mb
        assert torch.equal(message.tensors[0], data(mb, size).tensors[0])
    await asyncio.wait_for(sending, 30)
    assert isinstance(tx, ZpipeSocket)
    assert tx._current_loop is None  # zmq.asyncio never watched the sender
    reader = tx._zpipe_reader
    assert reader is None or not reader.waiters  # no wait left on its descriptor


async def test_a_peer_that_never_reads_is_a_timeout_naming_it(
    context: zmq.asyncio.Context,
) -> None:
    tx = open_socket(context, zmq.PUSH, TIGHT)
    tx.connect("tcp://127.0.0.1:9")  # nobody there: the one slot stays taken
    await send(tx, data(0, 1 << 20), timeout_s=5.0, peer="stalled-peer")
    with pytest.raises(TransportTimeout, match="stalled-peer"):
        await send(tx, data(0, 1 << 20), timeout_s=0.2, peer="stalled-peer")
    assert isinstance(tx, ZpipeSocket)
    assert tx._zpipe_reader is not None and not tx._zpipe_reader.waiters


async def test_a_socket_watched_by_zmq_asyncio_keeps_its_path(
    context: zmq.asyncio.Context,
) -> None:
    tx = open_socket(context, zmq.PUSH, TIGHT)
    tx.connect("tcp://127.0.0.1:9")
    await tx.send(b"x")  # takes the one slot
    pending = tx.send(b"y")  # waits for room: zmq.asyncio takes the socket over
    assert tx._current_loop is not None
    with pytest.raises(TransportTimeout, match="room to send data"):
        await send(tx, data(0, 1 << 10), timeout_s=0.2, peer="p")
    assert isinstance(tx, ZpipeSocket)
    assert tx._zpipe_reader is None  # it never waited on the descriptor itself
    pending.cancel()


async def test_a_wait_for_room_sleeps_instead_of_spinning(
    context: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    tx = open_socket(context, zmq.PUSH, TIGHT)
    rx = open_socket(context, zmq.PULL, TIGHT)
    port = rx.bind_to_random_port("tcp://127.0.0.1")
    tx.connect(f"tcp://127.0.0.1:{port}")
    passes = 0
    readable = fd_wait._readable

    async def counted(*args: Any) -> None:
        nonlocal passes
        passes += 1
        await readable(*args)

    monkeypatch.setattr(fd_wait, "_readable", counted)
    # the reader never reads: queues and socket buffers fill, then the send waits
    with pytest.raises(TransportTimeout):
        for mb in range(64):
            await send(tx, data(mb, 1 << 20), timeout_s=0.5, peer="rx")
    # a handful of wake-ups (connection news, room the I/O thread made) per wait,
    # not one per loop pass for half a second
    assert passes < 50
