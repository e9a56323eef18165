"""A stage's copies made without draining: the snapshot taken with batches in flight
holds its version and nothing later, and the sender sends the newest copy of each
kind, chain first, without ever blocking the compute. No sockets: fake routes."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from tests._support.async_training import SGD, SPEC, make_batches
from zpipe.planner.async_schedule import forward_version
from zpipe.protocol.peer import Backup
from zpipe.protocol.stage_control import AsyncCopy
from zpipe.recovery.live_copies import state_digest
from zpipe.stage import live_copies as live_copies_module
from zpipe.stage.executors.async_shard import AsyncShard
from zpipe.stage.live_copies import ChainPeer, CopyRoutes, LiveCopySender, PendingCopy
from zpipe.stage.metrics import StageCounters


def test_a_live_copy_with_batches_in_flight_holds_its_version_and_no_later_one() -> None:
    batches = make_batches(6, 5, seed=2)
    shard = AsyncShard.build(SPEC, 0, 4, first=True, last=True, loss="cross_entropy",
                             optimizer=SGD)  # fmt: skip
    assert isinstance(shard, AsyncShard)

    def forward(b: int) -> None:
        version = forward_version(0, 1, b, vertical_sync=True, depth=3)
        x, y = batches[b]
        shard.forward_at(b, version, (x,), y, 5, 3)

    forward(0)
    forward(1)  # in flight while batch 0 is updated
    shard.backward(0)
    shard.step_batch(0)
    copy = shard.live_copy(3)  # repartition_snapshot would refuse: batch 1 is in flight
    weights = {k: v for k, v in copy.items() if "#" not in k}
    live = {k: v.clone() for k, v in shard.state_dict().items()}
    assert set(weights) == set(live) and all(torch.equal(weights[k], live[k]) for k in live)
    assert copy["units.0.#live_versions"].tolist() == [1]
    digest = state_digest(copy)
    shard.backward(1)
    shard.step_batch(1)  # a later update: the copy is a clone, not torn
    assert state_digest(copy) == digest
    assert not all(torch.equal(weights[k], v) for k, v in shard.state_dict().items())
    # the copy is a replica a stage restores: its weights, versions and update count
    restored = AsyncShard.build(SPEC, 0, 4, first=True, last=True, loss="cross_entropy",
                                optimizer=SGD)  # fmt: skip
    assert isinstance(restored, AsyncShard)
    restored.load_training_state(copy)
    assert restored.updates == 1
    assert all(torch.equal(restored.state_dict()[k], live[k]) for k in live)


def _pending(step: int, kinds: tuple[str, ...]) -> PendingCopy:
    return PendingCopy(3, step, 0, 1, kinds, {"units.0.weight": torch.full((2,), float(step))})


async def test_the_sender_sends_the_newest_copy_of_each_kind_chain_first() -> None:
    peer_sends: list[Backup] = []
    coordinator: list[AsyncCopy] = []
    gate, entered = asyncio.Event(), asyncio.Event()
    heard = asyncio.Condition()

    async def to_peer(peer: ChainPeer, backup: Backup) -> None:
        entered.set()
        await gate.wait()  # a slow link: copies offered meanwhile wait
        if backup.step == 8:
            raise ConnectionError("the peer went away")
        peer_sends.append(backup)

    async def to_coordinator(message: AsyncCopy) -> None:
        async with heard:
            coordinator.append(message)
            heard.notify_all()

    async def until_heard(count: int) -> None:
        async with heard:
            await asyncio.wait_for(heard.wait_for(lambda: len(coordinator) >= count), 30)

    counters = StageCounters()
    routes = CopyRoutes(to_peer, to_coordinator)
    sender = LiveCopySender(
        name="a", chain_to=ChainPeer("b", "tcp://b:2"), routes=routes, counters=counters
    )
    task = asyncio.create_task(sender.run())
    try:
        sender.offer(_pending(2, ("chain", "global")))
        await asyncio.wait_for(entered.wait(), 30)  # the chain copy of 2 is on its way
        sender.offer(_pending(4, ("chain",)))
        sender.offer(_pending(6, ("chain",)))  # replaces 4, still waiting
        gate.set()
        await until_heard(3)
        sender.offer(_pending(8, ("chain",)))  # its send fails: logged, the next goes on
        sender.offer(_pending(10, ("global",)))
        await until_heard(4)
    finally:
        task.cancel()
    assert sender.sent == [("chain", 2), ("chain", 6), ("global", 2), ("global", 10)]
    assert [b.step for b in peer_sends] == [2, 6] and all(b.live for b in peer_sends)
    # the coordinator hears of each chain copy b keeps (no tensors), and gets the globals
    assert [(m.kind, m.step, m.holder, len(m.tensors)) for m in coordinator] == [
        ("chain", 2, "b", 0), ("chain", 6, "b", 0), ("global", 2, None, 1),
        ("global", 10, None, 1),
    ]  # fmt: skip
    assert coordinator[2].digest == state_digest(_pending(2, ()).state)
    spans = sorted(s.mb for s in counters.timeline.spans() if s.phase == "copy")
    assert spans == [2, 2, 6, 10]


async def test_drain_waits_for_the_last_copy_and_gives_up_at_its_deadline() -> None:
    # the run's last copy is offered as its training ends: stopping the sender at once
    # (as the stage did) lost the chain copy of the trained weights under load
    gate = asyncio.Event()
    up: list[AsyncCopy] = []

    async def to_peer(peer: ChainPeer, backup: Backup) -> None:
        raise AssertionError("the last stage sends its chain copy up")

    async def to_coordinator(message: AsyncCopy) -> None:
        await gate.wait()  # a slow link
        up.append(message)

    sender = LiveCopySender(name="c", chain_to=None, routes=CopyRoutes(to_peer, to_coordinator),
                            counters=StageCounters())  # fmt: skip
    assert await sender.drain(0.01)  # nothing offered: idle at once
    task = asyncio.create_task(sender.run())
    try:
        sender.offer(_pending(10, ("chain", "global")))
        assert not await sender.drain(0.05)  # the link holds it: the deadline passes
        gate.set()
        assert await sender.drain(30)
        assert [(m.kind, m.step) for m in up] == [("chain", 10), ("global", 10)]
        assert sender.sent == [("chain", 10), ("global", 10)]
    finally:
        task.cancel()


async def test_a_chain_copy_leaves_for_its_holder_before_its_digest_is_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the holder needs the tensors, not the owner's digest: a hash that finishes only
    # once the transfer has begun must not hold the transfer up (it did: the owner
    # hashed first, and a death in that time found the copy not yet at its holder)
    transfer_began = threading.Event()

    def slow_digest(state: dict[str, torch.Tensor]) -> str:
        transfer_began.wait(10)
        return "crc32:began" if transfer_began.is_set() else "crc32:waited"

    monkeypatch.setattr(live_copies_module, "state_digest", slow_digest)
    peer_sends: list[Backup] = []
    coordinator: list[AsyncCopy] = []

    async def to_peer(peer: ChainPeer, backup: Backup) -> None:
        transfer_began.set()
        peer_sends.append(backup)

    async def to_coordinator(message: AsyncCopy) -> None:
        coordinator.append(message)

    sender = LiveCopySender(name="b", chain_to=ChainPeer("c", "tcp://c"),
                            routes=CopyRoutes(to_peer, to_coordinator),
                            counters=StageCounters())  # fmt: skip
    task = asyncio.ensure_future(sender.run())
    try:
        sender.offer(_pending(10, ("chain",)))
        assert await sender.drain(30)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert [b.step for b in peer_sends] == [10]
    # the notice still carries the digest, taken beside the transfer
    assert [(m.kind, m.holder, m.digest) for m in coordinator] == [("chain", "c", "crc32:began")]
