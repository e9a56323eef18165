"""zpipe.transport.sockets: which sockets take the non-blocking shadow fast paths, and
sends to one peer of a ROUTER whose queue is full."""

from __future__ import annotations

import asyncio

import pytest
import torch
import zmq
import zmq.asyncio

from zpipe._errors import TransportTimeout
from zpipe.transport import sockets
from zpipe.transport.codec import Message
from zpipe.transport.sockets import SocketOptions, new_context, open_socket


def test_only_one_way_sockets_take_the_shadow_fast_paths() -> None:
    # A shadow send on a socket that also receives can swallow the edge that announces
    # queued input, leaving the pending asyncio receive asleep: such sockets must
    # always go through zmq.asyncio.
    context = new_context()
    made = {kind: open_socket(context, kind, SocketOptions()) for kind in
            (zmq.PUSH, zmq.PULL, zmq.ROUTER, zmq.DEALER)}  # fmt: skip
    try:
        assert sockets._shadow(made[zmq.PUSH], sockets._SEND_ONLY) is not None
        assert sockets._shadow(made[zmq.PULL], sockets._RECEIVE_ONLY) is not None
        for kind in (zmq.ROUTER, zmq.DEALER):
            assert sockets._shadow(made[kind], sockets._SEND_ONLY) is None
            assert sockets._shadow(made[kind], sockets._RECEIVE_ONLY) is None
        assert sockets._shadow(made[zmq.PULL], sockets._SEND_ONLY) is None
    finally:
        for sock in made.values():
            sock.close(linger=0)
        context.term()


def test_a_zpipe_socket_knows_its_one_way_shadow_from_when_it_opens() -> None:
    # The receive and send paths read these per message instead of looking the shadow
    # up: each must be the socket's own shadow for its one-way kinds, None otherwise
    # (a shadow fast path on a ROUTER or DEALER can strand its asyncio receive).
    context = new_context()
    kinds = (zmq.PUSH, zmq.PUB, zmq.PULL, zmq.SUB, zmq.ROUTER, zmq.DEALER)
    made = {kind: open_socket(context, kind, SocketOptions()) for kind in kinds}
    try:
        for kind, sock in made.items():
            shadow = sock._shadow_sock
            send_only = getattr(sock, "send_only_shadow", "missing")
            receive_only = getattr(sock, "receive_only_shadow", "missing")
            assert send_only is (shadow if kind in (zmq.PUSH, zmq.PUB) else None), kind
            assert receive_only is (shadow if kind in (zmq.PULL, zmq.SUB) else None), kind
            assert sockets._shadow(sock, sockets._SEND_ONLY) is send_only
            assert sockets._shadow(sock, sockets._RECEIVE_ONLY) is receive_only
    finally:
        for sock in made.values():
            sock.close(linger=0)
        context.term()


async def _router_with_a_slow_reader() -> tuple[
    zmq.asyncio.Context, zmq.asyncio.Socket, zmq.asyncio.Socket
]:
    context = new_context()
    options = SocketOptions()
    router = open_socket(context, zmq.ROUTER, options)  # ROUTER_MANDATORY, as zpipe's are
    router.setsockopt(zmq.SNDHWM, 2)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    reader = context.socket(zmq.DEALER)
    reader.setsockopt(zmq.RCVHWM, 2)
    reader.setsockopt(zmq.ROUTING_ID, b"reader")
    reader.setsockopt(zmq.LINGER, 0)
    reader.connect(f"tcp://127.0.0.1:{port}")
    other = context.socket(zmq.DEALER)  # a second peer keeps the ROUTER polling writable
    other.setsockopt(zmq.LINGER, 0)
    other.connect(f"tcp://127.0.0.1:{port}")
    await reader.send(b"hello")
    await other.send(b"hello")
    for _ in range(2):
        await asyncio.wait_for(router.recv_multipart(), 10)
    other.close()
    return context, router, reader


async def test_a_router_send_to_one_full_peer_queue_waits_for_room_not_gone() -> None:
    # ROUTER_MANDATORY answers EAGAIN for one peer's full queue: a stream of 1 MB
    # chunks to a slow reader must wait for it, not report the peer as gone
    context, router, reader = await _router_with_a_slow_reader()
    chunk = Message("units", {"keys": ["w"], "error": ""}, tensors=(torch.zeros(1 << 18),))
    received: list[object] = []

    async def read_slowly() -> None:
        for _ in range(30):
            await asyncio.sleep(0.01)
            received.append(await asyncio.wait_for(reader.recv_multipart(), 30))

    try:
        reading = asyncio.create_task(read_slowly())
        for _ in range(30):
            await sockets.send(router, chunk, routing_id=b"reader", peer="reader", timeout_s=30)
        await asyncio.wait_for(reading, 60)
        assert len(received) == 30
    finally:
        router.close(linger=0)
        reader.close()
        context.term()


async def test_a_router_send_to_a_peer_that_never_reads_times_out_by_its_deadline() -> None:
    context, router, reader = await _router_with_a_slow_reader()
    chunk = Message("units", {"keys": ["w"], "error": ""}, tensors=(torch.zeros(1 << 18),))
    try:
        with pytest.raises(TransportTimeout, match="room to send units"):
            for _ in range(200):
                await sockets.send(
                    router, chunk, routing_id=b"reader", peer="reader", timeout_s=0.5
                )
    finally:
        router.close(linger=0)
        reader.close()
        context.term()
