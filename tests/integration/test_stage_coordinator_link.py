"""The stage's link to its coordinator: what the shell fills into the lifecycle's messages
(counters, timeline, clock) and where state goes, over an in-process socket pair."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import torch
import zmq
import zmq.asyncio

from zpipe.protocol import REGISTRY, WireMessage
from zpipe.protocol.stage_control import (
    Heartbeat,
    HeartbeatAck,
    Metrics,
    Registered,
    Weights,
)
from zpipe.stage.bulk import StageBulk
from zpipe.stage.commands import SendToCoordinator
from zpipe.stage.coordinator_link import CoordinatorLink
from zpipe.stage.metrics import StageCounters
from zpipe.transport.emulation import LinkSpec, SharedUplink
from zpipe.transport.sockets import SocketOptions, decode_frames, new_context, open_socket


class _NoSocket:
    """The bulk connection is never used here: the coordinator gives no token."""


@pytest.fixture
async def pair() -> AsyncIterator[tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]]:
    context = new_context()
    coordinator = open_socket(context, zmq.PAIR, SocketOptions())
    coordinator.bind("inproc://coordinator")
    stage = open_socket(context, zmq.PAIR, SocketOptions())
    stage.connect("inproc://coordinator")
    yield coordinator, stage
    coordinator.close(linger=0)
    stage.close(linger=0)
    context.term()


def _link(control: zmq.asyncio.Socket, counters: StageCounters) -> CoordinatorLink:
    uplink = SharedUplink(LinkSpec())
    bulk = StageBulk(
        name="s0",
        socket=_NoSocket(),  # type: ignore[arg-type]
        uplink=uplink.connection(),
        send_timeout_s=1.0,
        max_message_bytes=1 << 20,
    )
    return CoordinatorLink(
        name="s0",
        control=control,
        bulk=bulk,
        uplink=uplink.connection(),
        counters=counters,
        send_timeout_s=1.0,
    )


async def _received(coordinator: zmq.asyncio.Socket) -> WireMessage:
    frames = await coordinator.recv_multipart(copy=False)
    return REGISTRY.parse(decode_frames(frames, 1 << 20))


async def test_heartbeats_carry_the_counters_and_the_clock_only_for_a_stamping_coordinator(
    pair: tuple[zmq.asyncio.Socket, zmq.asyncio.Socket],
) -> None:
    coordinator, stage = pair
    counters = StageCounters()
    counters.microbatches = 3
    link = _link(stage, counters)
    beat = SendToCoordinator(Heartbeat(name="s0", metrics={}), attach_metrics=True)
    await link.send_command(beat)
    sent = await _received(coordinator)
    assert isinstance(sent, Heartbeat) and sent.metrics["microbatches"] == 3
    assert sent.clock is None  # an older coordinator: no clock, as before
    await link.heard(Registered(name="s0", heartbeat_interval=1.0, clock=100.0))
    await link.send_command(beat)
    stamped = await _received(coordinator)
    assert isinstance(stamped, Heartbeat) and stamped.clock is not None
    # the coordinator's stamped acknowledgement is a round trip: an offset is known
    await link.heard(HeartbeatAck(echo=stamped.clock, clock=stamped.clock + 50.0))
    assert link.clock_offset.offset_s is not None


async def test_a_metrics_reply_carries_the_timeline_when_asked_and_state_goes_whole(
    pair: tuple[zmq.asyncio.Socket, zmq.asyncio.Socket],
) -> None:
    coordinator, stage = pair
    counters = StageCounters()
    counters.timeline.record(0, "forward", 1.0, 2.0)
    link = _link(stage, counters)
    reply = Metrics(run=4, name="s0", metrics={}, epoch=9)
    await link.send_command(SendToCoordinator(reply, attach_metrics=True))
    plain = await _received(coordinator)
    assert isinstance(plain, Metrics) and plain.timeline is None and plain.epoch == 9
    await link.send_command(SendToCoordinator(reply, attach_metrics=True, attach_timeline=True))
    traced = await _received(coordinator)
    assert isinstance(traced, Metrics) and traced.timeline is not None
    assert len(traced.timeline["spans"]) == 1
    # without a bulk token, state goes on the control connection
    weights = Weights(run=4, name="s0", step=1, keys=["w"], error="", tensors=(torch.ones(2),))
    await link.send(weights.to_message())
    got = await _received(coordinator)
    assert isinstance(got, Weights) and torch.equal(got.tensors[0], torch.ones(2))
