"""A stage that keeps a peer's chain copy made without draining tells the coordinator
it holds it (zpipe.stage.live_copies.held_copy_notice): the copy's owner may die
between this stage's acknowledgement of the last chunk and its own notice. In one
process: the copies the stage holds (CopyHolder) fed a live backup, its notice caught."""

from __future__ import annotations

import asyncio

import torch

from zpipe.protocol.peer import Backup
from zpipe.protocol.stage_control import AsyncCopy
from zpipe.recovery.live_copies import state_digest
from zpipe.stage.executors.sync_training import DataParallelGroup, TrainingSetup
from zpipe.stage.held_copies import CopyHolder
from zpipe.stage.live_copies import held_copy_notice
from zpipe.stage.metrics import StageCounters
from zpipe.stage.replicas import ReplicaStore


class _Trainer:
    def __init__(self, setup: TrainingSetup) -> None:
        self.setup = setup


def _held() -> CopyHolder:
    return CopyHolder(
        name="b", timeout_s=5.0, counters=StageCounters(), replicas=ReplicaStore(),
        backup_budget_bytes=10**6,
    )  # fmt: skip


def _trainer() -> _Trainer:
    return _Trainer(
        TrainingSetup(
            run=7,
            epoch=1,
            name="b",
            index=1,
            num_stages=2,
            schedule="async-1f1b",
            num_microbatches=1,
            warmup=1,
            group=DataParallelGroup(("b",), (1,)),
            rank=0,
            upstream=DataParallelGroup(("a",), (1,)),
            downstream=DataParallelGroup(("client",), (1,)),
            wait_s=1.0,
            backup_from=("a",),
        )
    )


async def test_a_kept_live_chain_copy_is_announced_with_its_owner_range_and_digest() -> None:
    held = _held()
    announced: asyncio.Queue[AsyncCopy] = asyncio.Queue()

    async def up(copy: AsyncCopy) -> None:
        await announced.put(copy)

    held.announce = up
    state = {"units.1.weight": torch.arange(4.0), "units.2.weight": torch.ones(3)}
    backup = Backup(run=7, step=20, owner="a", keys=list(state), live=True,
                    tensors=tuple(state.values()))  # fmt: skip
    reply = await held.on_peer_request(backup, _trainer())  # type: ignore[arg-type]
    assert reply.error == ""
    notice = await asyncio.wait_for(announced.get(), 30)
    assert (notice.name, notice.kind, notice.holder, notice.run, notice.step) == (
        "a", "chain", "b", 7, 20,
    )  # fmt: skip
    # the units of the keys it received; no tensors; the owner's digest of the same bytes
    assert (notice.start, notice.end, notice.keys, notice.tensors) == (1, 3, [], ())
    assert notice.digest == state_digest(state)


async def test_a_flush_backup_is_not_announced_and_a_failed_notice_is_only_logged() -> None:
    held = _held()
    calls: list[AsyncCopy] = []

    async def broken(copy: AsyncCopy) -> None:
        calls.append(copy)
        raise ConnectionError("the bulk connection is down")

    held.announce = broken
    state = {"units.1.weight": torch.zeros(2)}
    flush = Backup(run=7, step=4, owner="a", keys=list(state), tensors=tuple(state.values()))
    assert (await held.on_peer_request(flush, _trainer())).error == ""  # type: ignore[arg-type]
    live = Backup(run=7, step=8, owner="a", keys=list(state), live=True,
                  tensors=tuple(state.values()))  # fmt: skip
    assert (await held.on_peer_request(live, _trainer())).error == ""  # type: ignore[arg-type]
    for _ in range(300):  # the live copy's hash, then its notice, in the background
        if calls:
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.2)
    assert [c.step for c in calls] == [8]  # the flush's snapshot is no live copy
    assert ("a", 7, 8) in held.live_copies  # kept whatever the notice's fate


def test_a_copy_without_any_units_state_is_not_announced() -> None:
    assert held_copy_notice(holder="b", owner="a", run=1, step=2, keys=[], digest="") is None
    notice = held_copy_notice(holder="b", owner="a", run=1, step=2, keys=["units.5.w"], digest="x")
    assert notice is not None and (notice.start, notice.end) == (5, 6)
