"""A stage's half-sent bulk transfers at a real coordinator, sockets in one process
(issue 33, finding 5): a peer that registers, opens its bulk connection, sends part
of a transfer and stalls (heartbeating on) has the transfer dropped after the
coordinator's ``bulk_stall_s`` and its next honest transfer served; a transfer past
the stage's budget is refused at its first chunk with ``bulk_refused``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import torch
import zmq
import zmq.asyncio

from zpipe.config import Timeouts
from zpipe.coordinator.membership import MemberState
from zpipe.coordinator.server import Coordinator, CoordinatorConfig
from zpipe.protocol import REGISTRY, WireMessage
from zpipe.protocol.bulk import BulkChunk, BulkDone, BulkOpen, BulkOpened, BulkRefused
from zpipe.protocol.stage_control import Heartbeat, Register, Registered, Weights
from zpipe.transport.bulk import OutgoingTransfer
from zpipe.transport.codec import Message, decode, encode

WAIT_S = 60.0  # generous: a loaded machine; the waits end on replies or counts
MIB = 1 << 20


async def _send(sock: zmq.asyncio.Socket, message: Message) -> None:
    await asyncio.wait_for(sock.send_multipart([bytes(f) for f in encode(message)]), WAIT_S)


async def _reply(sock: zmq.asyncio.Socket, kind: type[WireMessage]) -> WireMessage:
    """The next message of ``kind`` on ``sock`` (others, heartbeat acks, are skipped)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        frames = await asyncio.wait_for(sock.recv_multipart(), deadline - time.monotonic())
        message = REGISTRY.parse(decode(frames))
        if isinstance(message, kind):
            return message


class HalfSender:
    """A registered stage of this process's own: control and bulk DEALERs, heartbeats."""

    def __init__(self, context: zmq.asyncio.Context, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.control = context.socket(zmq.DEALER)
        self.bulk = context.socket(zmq.DEALER)
        for sock in (self.control, self.bulk):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(coordinator.endpoint)
        self.token = ""
        self._beating: asyncio.Task[None] | None = None

    async def register(self) -> None:
        register = Register(name="s", data_endpoint="tcp://127.0.0.1:9", info={})
        await _send(self.control, register.to_message())
        registered = await _reply(self.control, Registered)
        assert isinstance(registered, Registered) and registered.bulk_token
        self.token = registered.bulk_token
        self._beating = asyncio.create_task(self._heartbeats())
        await _send(self.bulk, BulkOpen(name="s", token=self.token).to_message())
        await _reply(self.bulk, BulkOpened)

    async def _heartbeats(self) -> None:
        interval = self.coordinator.config.timeouts.heartbeat_interval_s
        while True:
            await _send(self.control, Heartbeat(name="s", metrics={}).to_message())
            await asyncio.sleep(interval / 2)

    async def part(self, transfer: int, announced: int, sent: int) -> None:
        """The first ``sent`` bytes of a transfer announced at ``announced``, in 1 MiB chunks."""
        chunks = -(-announced // MIB)
        for seq in range(-(-sent // MIB)):
            chunk = BulkChunk(
                name="s",
                token=self.token,
                transfer=transfer,
                seq=seq,
                chunks=chunks,
                nbytes=announced,
                frames=[announced] if seq == 0 else None,
                tensors=(torch.zeros(MIB, dtype=torch.uint8),),
            )
            await _send(self.bulk, chunk.to_message())

    async def whole(self, transfer: int, message: Message) -> None:
        for chunk in OutgoingTransfer(transfer, encode(message)).messages(
            name="s", token=self.token
        ):
            await _send(self.bulk, chunk)

    def close(self) -> None:
        if self._beating is not None:
            self._beating.cancel()
        self.control.close()
        self.bulk.close()


@pytest.fixture
async def sender() -> AsyncIterator[HalfSender]:
    config = CoordinatorConfig(
        bind="tcp://127.0.0.1:0",
        timeouts=Timeouts(heartbeat_interval_s=0.5),
        bulk_budget_bytes=24 * MIB,
        bulk_stall_s=2.0,
    )
    coordinator = Coordinator(config)
    ready = asyncio.Event()
    serving = asyncio.create_task(coordinator.serve(ready=ready))
    await asyncio.wait_for(ready.wait(), WAIT_S)
    context = zmq.asyncio.Context()
    peer = HalfSender(context, coordinator)
    try:
        await peer.register()
        yield peer
    finally:
        peer.close()
        context.term()
        coordinator.stop()
        await asyncio.wait_for(serving, WAIT_S)


WEIGHTS = Weights(name="s", run=1, step=0, keys=["w"], error="", metrics={},
                  tensors=(torch.randn(1024, 600),))  # fmt: skip


async def test_a_stalled_transfer_is_dropped_after_the_deadline_and_the_next_is_served(
    sender: HalfSender,
) -> None:
    await sender.part(1, 16 * MIB, 8 * MIB)
    link = sender.coordinator.state.bulk.get("s")
    assert link is not None
    deadline = time.monotonic() + WAIT_S
    # counts, not events: looked at every 0.1 s until the deadline
    while link.inbox.received_bytes < 8 * MIB and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.1)
    assert link.inbox.received_bytes == 8 * MIB  # held while it may still come
    while link.inbox.open_transfers and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.1)
    assert link.inbox.open_transfers == 0 and link.inbox.received_bytes == 0
    assert link.inbox.expired == 1
    member = sender.coordinator.state.membership.get("s")
    assert member is not None and member.state is MemberState.ALIVE  # it heartbeats on
    await sender.whole(2, WEIGHTS.to_message())
    done = await _reply(sender.bulk, BulkDone)
    assert isinstance(done, BulkDone) and done.transfer == 2


async def test_a_transfer_past_the_stage_s_budget_is_refused_at_its_first_chunk(
    sender: HalfSender,
) -> None:
    await sender.part(1, 16 * MIB, 2 * MIB)
    await sender.part(2, 16 * MIB, 1 * MIB)  # 32 MiB announced in all: past 24
    refused = await _reply(sender.bulk, BulkRefused)
    assert isinstance(refused, BulkRefused) and refused.transfer == 2
    assert "past its budget" in refused.reason
    link = sender.coordinator.state.bulk.get("s")
    assert link is not None and link.inbox.open_transfers == 1
    assert link.inbox.held_bytes == 16 * MIB
