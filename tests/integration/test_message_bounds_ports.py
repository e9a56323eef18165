"""Messages of many frames at a data port and at the coordinator (issue 33, findings 1
and 3) and a flood of one peer at the coordinator (item 2), sockets in one process.

libzmq checks MAXMSGSIZE per frame, so a message of 100,000 one-byte frames passes
it; ``recv_multipart`` then made a Python object of every frame. The receive now
keeps no frame past the socket's bounds, discards the rest, counts the message
(``refused_messages``) and hands the caller the next legal one. Python's own
allocations are measured with tracemalloc (libzmq's copy of the frames, which no
application can bound, is outside it: see zpipe.transport.message_bounds).
"""

from __future__ import annotations

import asyncio
import time
import tracemalloc
from collections.abc import Iterator

import pytest
import torch
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from zpipe.coordinator.server import Coordinator, CoordinatorConfig
from zpipe.protocol import REGISTRY
from zpipe.protocol.client_control import ClusterRequest, ClusterState
from zpipe.stage.config import StageConfig
from zpipe.stage.ports import StageKeys, StagePorts
from zpipe.testing.fake_peers import FakePeers
from zpipe.transport.codec import MAX_TENSORS, Message, decode, encode
from zpipe.transport.fd_wait import ZpipeSocket
from zpipe.transport.sockets import (
    ReceiveLimits,
    decode_frames,
    new_context,
    open_socket,
    recv_frames,
)

WAIT_S = 60.0  # generous: a loaded machine; the waits end on events or counts
MANY = 100_000


@pytest.fixture
def context() -> Iterator[zmq.asyncio.Context]:
    ctx = new_context()
    yield ctx
    ctx.destroy(linger=0)


def legal(mb: int) -> list[bytes]:
    message = Message("data", {"run": 1, "mb": mb, "src": "client"}, 1, (torch.ones(4),))
    return [bytes(f) for f in encode(message)]


def send_many(sock: zmq.Socket, count: int, size: int = 1) -> None:  # type: ignore[type-arg]
    """One message of ``count`` frames of ``size`` bytes, queued without waiting."""
    frame = b"x" * size
    for _ in range(count - 1):
        sock.send(frame, zmq.SNDMORE)
    sock.send(frame)


class Pair:
    """A PULL under ``limits`` and a PUSH into it whose queue never fills."""

    def __init__(self, context: zmq.asyncio.Context, limits: ReceiveLimits) -> None:
        self.rx = open_socket(context, zmq.PULL, limits=limits)
        port = self.rx.bind_to_random_port("tcp://127.0.0.1")
        self._tx = open_socket(context, zmq.PUSH)
        self._tx.setsockopt(zmq.SNDHWM, 0)
        self._tx.connect(f"tcp://127.0.0.1:{port}")
        self.tx = self._tx._shadow_sock  # synchronous: queued at once

    async def receive(self) -> list[zmq.Frame]:
        return await recv_frames(self.rx, timeout_s=WAIT_S, peer="tx", awaited="a message")

    @property
    def refused(self) -> int:
        assert isinstance(self.rx, ZpipeSocket)
        return self.rx.refused_messages

    def close(self) -> None:
        self._tx.close(0)
        self.rx.close(0)


async def test_a_data_port_keeps_none_of_100k_one_byte_frames_and_serves_the_next(
    context: zmq.asyncio.Context,
) -> None:
    ports = Pair(context, ReceiveLimits.for_largest_message(1 << 20))
    send_many(ports.tx, MANY)
    ports.tx.send_multipart(legal(7))
    tracemalloc.start()
    try:
        frames = await ports.receive()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert decode_frames(frames, 1 << 31).body["mb"] == 7  # the next legal message
    assert ports.refused == 1
    # recv_multipart kept a Frame of each (tens of MB here); the bound keeps a
    # codec message's worth at most (4,097 frames)
    assert peak < 4 << 20, f"Python allocated {peak} bytes at its peak"
    ports.close()


async def test_a_pre_plan_data_port_refuses_1000_frames_of_60_kb_by_bytes(
    context: zmq.asyncio.Context,
) -> None:
    """Under the frame bound (1,000 < 4,097) but past what a connection of a port
    before its plan may queue (4 x 64 KiB): refused, and the port serves on."""
    ports = Pair(context, ReceiveLimits.before_plan())
    send_many(ports.tx, 1000, 60_000)
    ports.tx.send_multipart(legal(8))
    frames = await ports.receive()
    assert decode_frames(frames, 1 << 31).body["mb"] == 8
    assert ports.refused == 1
    ports.close()


async def test_a_message_of_the_codec_s_largest_frame_count_still_passes(
    context: zmq.asyncio.Context,
) -> None:
    ports = Pair(context, ReceiveLimits.for_largest_message(1 << 20))
    tensors = tuple(torch.full((1,), float(i)) for i in range(MAX_TENSORS))
    units = Message("units", {"keys": [], "error": ""}, 0, tensors)
    ports.tx.send_multipart([bytes(f) for f in encode(units)])
    frames = await ports.receive()
    assert len(decode(frames).tensors) == MAX_TENSORS
    assert ports.refused == 0
    ports.close()


async def test_an_open_idle_data_port_refuses_many_frames_at_the_handshake(
    context: zmq.asyncio.Context,
) -> None:
    """Finding 3: without keys, a stage's data port admits no host before an
    assignment (zpipe.transport.address_auth), so a message of 1,000 x 60 kB frames
    is refused with its connection and never read."""
    config = StageConfig(name="s0", coordinator="tcp://127.0.0.1:9", data_bind="tcp://127.0.0.1:0")
    keys = StageKeys.load(context, config)
    ports = StagePorts.open(context, config, keys)
    intruder = open_socket(context, zmq.PUSH)
    monitor = intruder.get_monitor_socket()
    monitor.setsockopt(zmq.LINGER, 0)
    try:
        intruder.connect(ports.data_endpoint)
        send_many(intruder._shadow_sock, 1000, 60_000)
        deadline = time.monotonic() + WAIT_S
        refused = False
        while not refused and time.monotonic() < deadline:
            if await monitor.poll(100):
                event = await recv_monitor_message(monitor)
                assert event["event"] != zmq.EVENT_HANDSHAKE_SUCCEEDED, "admitted"
                refused = event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        assert refused and keys.data_refusals >= 1
        assert not ports.data_in.getsockopt(zmq.EVENTS) & zmq.POLLIN  # nothing reached the port
    finally:
        monitor.close(linger=0)
        intruder.close(linger=0)
        ports.close()
        keys.stop()


async def _serve(coordinator: Coordinator) -> asyncio.Task[None]:
    ready = asyncio.Event()
    serving = asyncio.create_task(coordinator.serve(ready=ready))
    await asyncio.wait_for(ready.wait(), WAIT_S)
    return serving


async def _ask_cluster(dealer: zmq.asyncio.Socket) -> ClusterState:
    await dealer.send_multipart([bytes(f) for f in encode(ClusterRequest().to_message())])
    reply = await asyncio.wait_for(dealer.recv_multipart(), WAIT_S)
    state = REGISTRY.parse(decode(reply))
    assert isinstance(state, ClusterState)
    return state


async def test_the_coordinator_keeps_none_of_100k_one_byte_frames_and_serves_the_next() -> None:
    coordinator = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0"))
    serving = await _serve(coordinator)
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.SNDHWM, 0)
    dealer.connect(coordinator.endpoint)
    try:
        send_many(dealer._shadow_sock, MANY)
        tracemalloc.start()
        try:
            state = await _ask_cluster(dealer)  # answered after the big one was read
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert state.members == [] and not serving.done()
        router = coordinator.port.router
        assert isinstance(router, ZpipeSocket) and router.refused_messages == 1
        assert peak < 4 << 20, f"Python allocated {peak} bytes at its peak"
    finally:
        dealer.close()
        context.term()
        coordinator.stop()
        await asyncio.wait_for(serving, WAIT_S)


def test_the_coordinator_s_frame_limit_fits_its_largest_legal_frame() -> None:
    """Finding 7: the ROUTER's MAXMSGSIZE was every socket's 2 GiB."""
    coordinator = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0"))
    coordinator._setup()
    try:
        assert coordinator.port.router is not None
        limit = coordinator.port.router.getsockopt(zmq.MAXMSGSIZE)
        assert limit == (256 << 20) + 33  # a 147 MiB embedding passes, 2 GiB does not
    finally:
        coordinator._close()


async def test_one_peer_s_flood_does_not_make_the_coordinator_suspect_another() -> None:
    """A flood at the coordinator from one connection (junk past its rate, and
    messages of 100,000 frames) while a stage heartbeats: the stage is never probed
    or declared dead, and the flood is counted as dropped. The attacker sends from
    a thread of its own, so this process's loop is not the one held up."""
    coordinator = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0"))
    serving = await _serve(coordinator)
    big = 4
    junk = [bytes(f) for f in encode(ClusterRequest().to_message())]
    junk[0] = junk[0].replace(b"cluster_request", b"cluster_nothing")
    context = zmq.Context()
    attacker = context.socket(zmq.DEALER)
    attacker.setsockopt(zmq.LINGER, 0)
    attacker.setsockopt(zmq.SNDHWM, 0)

    def flood() -> None:
        attacker.connect(coordinator.endpoint)
        for _ in range(big):
            for _ in range(5000):
                attacker.send_multipart(junk)
            send_many(attacker, MANY)

    try:
        async with FakePeers(coordinator.endpoint, 1, register_timeout_s=WAIT_S) as peers:
            await asyncio.to_thread(flood)
            router = coordinator.port.router
            assert isinstance(router, ZpipeSocket)
            deadline = time.monotonic() + WAIT_S * 3
            # a count, not an event: looked at every 0.1 s until the deadline
            while router.refused_messages < big and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
            await asyncio.sleep(2 * coordinator.config.timeouts.heartbeat_interval_s)
            stats = peers.peers[0].stats
            own_lag = peers.summary().own_lag
            assert router.refused_messages == big
            assert coordinator.port.limiter.dropped_total > 0  # the rate limit engaged
            assert stats.acks > 0
            assert (stats.probes, stats.register_again) == (0, 0), (
                f"suspected or declared dead; this process's own loop lag: {own_lag}"
            )
            assert not [e for e in coordinator.events if e.get("event") == "stage_dead"]
    finally:
        attacker.close()
        context.term()
        coordinator.stop()
        await asyncio.wait_for(serving, WAIT_S)
