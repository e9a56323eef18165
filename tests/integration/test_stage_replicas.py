"""The snapshots a stage keeps for chain replication (pure, no processes)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from zpipe._errors import ConfigError
from zpipe.protocol import WireMessage
from zpipe.protocol.peer import Backup, BackupOk, FetchUnits
from zpipe.protocol.stage_control import BackupRequest, WeightsRequest
from zpipe.stage.replicas import ReplicaStore, units_of

STATE = {
    "units.0.weight": torch.ones(2),
    "units.0.weight#opt.momentum_buffer": torch.full((2,), 0.5),
    "units.1.bias": torch.zeros(3),
    "units.12.weight": torch.ones(1),
    "loss.scale": torch.ones(1),  # not a unit's
}


def test_units_of_takes_a_units_optimizer_state_and_nothing_outside_the_range() -> None:
    assert sorted(units_of(STATE, 0, 1)) == ["units.0.weight", "units.0.weight#opt.momentum_buffer"]
    assert sorted(units_of(STATE, 1, 12)) == ["units.1.bias"]  # 12 is not 1
    assert units_of(STATE, 2, 5) == {}  # units with no parameters hold nothing


def test_the_store_keeps_the_newest_two_snapshots_of_each_owner() -> None:
    store = ReplicaStore()
    for step in (3, 6, 9):
        store.put("a", 1, step, {"units.0.w": torch.full((1,), float(step))})
    store.put("b", 1, 3, {"units.1.w": torch.zeros(1)})  # another owner's: kept apart
    assert ("a", 1, 3) not in store
    assert ("a", 1, 6) in store and ("a", 1, 9) in store and ("b", 1, 3) in store
    assert store.units("a", 1, 6, 0, 1)["units.0.w"].item() == 6.0
    with pytest.raises(ConfigError, match="no snapshot of 'a' after mini-batch 3 of run 1"):
        store.units("a", 1, 3, 0, 1)
    # taking the same step again replaces it rather than growing the store
    store.put("a", 1, 9, {"units.0.w": torch.full((1,), 99.0)})
    assert store.units("a", 1, 9, 0, 1)["units.0.w"].item() == 99.0
    assert ("a", 1, 6) in store


async def test_a_backup_is_kept_only_from_an_owner_the_plan_names() -> None:
    # Issue 19: an allowed peer once planted 24 x 25 MiB of backups under made-up
    # owners, which fetch_units then served back. Only the devices the running
    # training plan names as backing up here are kept now.

    from zpipe.stage.executors.sync_training import DataParallelGroup, TrainingSetup
    from zpipe.stage.held_copies import CopyHolder
    from zpipe.stage.metrics import StageCounters

    store = ReplicaStore()
    held = CopyHolder(
        name="b",
        timeout_s=1.0,
        counters=StageCounters(),
        replicas=store,
    )
    setup = TrainingSetup(
        run=7, epoch=1, name="b", index=1, num_stages=2, schedule="1f1b",
        num_microbatches=2, warmup=1, group=DataParallelGroup(("b",), (1,)), rank=0,
        upstream=DataParallelGroup(("a",), (1,)),
        downstream=DataParallelGroup(("client",), (1,)), wait_s=1.0,
        backup_from=("a",),
    )  # fmt: skip

    class Trainer:
        def __init__(self, setup: TrainingSetup) -> None:
            self.setup = setup

    def backup(owner: str, run: int = 7) -> Backup:
        return Backup(run=run, step=3, owner=owner, keys=["units.0.w"], tensors=(torch.ones(4),))

    trainer = Trainer(setup)
    kept = await held.on_peer_request(backup("a"), trainer)  # type: ignore[arg-type]
    assert kept.error == "" and ("a", 7, 3) in store
    for message, why in (
        (backup("mallory"), "does not back up to this stage"),
        (backup("a", run=8), "not training run 8"),
    ):
        refused = await held.on_peer_request(message, trainer)  # type: ignore[arg-type]
        assert why in refused.error
    refused = await held.on_peer_request(backup("a"), None)
    assert "not training run 7" in refused.error
    assert ("mallory", 7, 3) not in store and ("a", 8, 3) not in store


async def test_the_service_judges_the_sender_and_the_budget() -> None:

    from zpipe.stage.executors.sync_training import DataParallelGroup, TrainingSetup
    from zpipe.stage.held_copies import CopyHolder
    from zpipe.stage.metrics import StageCounters
    from zpipe.stage.peer_policy import FetchGrant, PeerIdentity

    store = ReplicaStore()
    held = CopyHolder(
        name="b",
        timeout_s=1.0,
        counters=StageCounters(),
        replicas=store,
        backup_budget_bytes=100,
    )
    setup = TrainingSetup(
        run=7, epoch=1, name="b", index=1, num_stages=2, schedule="1f1b",
        num_microbatches=2, warmup=1, group=DataParallelGroup(("b",), (1,)), rank=0,
        upstream=DataParallelGroup(("a",), (1,)),
        downstream=DataParallelGroup(("client",), (1,)), wait_s=1.0,
        backup_from=("a",),
    )  # fmt: skip

    class Trainer:
        def __init__(self, setup: TrainingSetup) -> None:
            self.setup = setup

    def backup(step: int, floats: int) -> Backup:
        tensors = (torch.ones(floats),)
        return Backup(run=7, step=step, owner="a", keys=["units.0.w"], tensors=tensors)

    trainer = Trainer(setup)
    a, c = PeerIdentity(True, "a"), PeerIdentity(True, "c")
    planted = await held.on_peer_request(backup(1, 4), trainer, c)  # type: ignore[arg-type]
    assert "not by its owner" in planted.error and ("a", 7, 1) not in store
    assert (await held.on_peer_request(backup(1, 4), trainer, a)).error == ""  # type: ignore[arg-type]
    huge = await held.on_peer_request(backup(2, 100), trainer, a)  # type: ignore[arg-type]
    assert "more than it can" in huge.error and ("a", 7, 2) not in store

    def fetch(run: int) -> FetchUnits:
        return FetchUnits(owner="a", run=run, step=1, start=0, end=1)

    ungranted = await held.on_peer_request(fetch(7), None, c)
    assert "did not name anyone" in ungranted.error and not ungranted.tensors
    held.fetch_grants = (FetchGrant("c", "a", 7, 1, 0, 1),)
    units = await held.on_peer_request(fetch(7), None, c)
    assert units.error == "" and units.keys == ["units.0.w"]
    not_granted = await held.on_peer_request(fetch(7), None, PeerIdentity(True, "d"))
    assert "go to c in the current plan" in not_granted.error and not not_granted.tensors
    stranger = await held.on_peer_request(fetch(7), None, PeerIdentity(True, None))
    assert "named" in stranger.error and not stranger.tensors


async def test_with_keys_a_member_cannot_plant_a_backup_under_another_owner(
    tmp_path: Path,
) -> None:
    # The probe port of a real stage shell (ROUTER, CURVE, the cluster's names): k2 is
    # an allowed member but claims to send k0's backup; k0's own key is kept.
    import asyncio

    import zmq
    import zmq.asyncio

    from zpipe.stage.executors.sync_training import DataParallelGroup, TrainingSetup
    from zpipe.stage.held_copies import CopyHolder
    from zpipe.stage.linkprobe import PROBE_DOMAIN, ProbeResponder
    from zpipe.stage.metrics import StageCounters
    from zpipe.stage.ports import peer_identity
    from zpipe.stage.replicas import peer_request
    from zpipe.transport import security
    from zpipe.transport.emulation import LinkSpec
    from zpipe.transport.sockets import SocketOptions, bind_endpoint, new_context, open_socket

    security.generate_keys(tmp_path, ["k0", "k1", "k2"])
    pairs = {n: security.load_keypair(tmp_path, n) for n in ("k0", "k1", "k2")}
    members = security.PeerAllowList({n: p.public for n, p in pairs.items()})
    context = new_context()
    auth = security.CurveAuthenticator(context, security.PeerAllowList())
    auth.add_domain(PROBE_DOMAIN, members)
    auth.start()
    router = open_socket(context, zmq.ROUTER, SocketOptions())
    security.secure_server(router, pairs["k1"], domain=PROBE_DOMAIN)
    endpoint = bind_endpoint(router, "tcp://127.0.0.1:0")
    store = ReplicaStore()
    held = CopyHolder(name="k1", timeout_s=5.0, counters=StageCounters(), replicas=store)
    setup = TrainingSetup(
        run=7, epoch=1, name="k1", index=1, num_stages=2, schedule="1f1b",
        num_microbatches=2, warmup=1, group=DataParallelGroup(("k1",), (1,)), rank=0,
        upstream=DataParallelGroup(("k0",), (1,)),
        downstream=DataParallelGroup(("client",), (1,)), wait_s=1.0,
        backup_from=("k0",),
    )  # fmt: skip
    trainer = type("Trainer", (), {"setup": setup})()

    async def handler(message: WireMessage, key: bytes | None) -> WireMessage:
        return await held.on_peer_request(message, trainer, peer_identity(members, key))

    responder = ProbeResponder(
        socket=router, link=LinkSpec(), name="k1", send_timeout_s=5.0,
        max_message_bytes=2**30, peer_handler=handler,
    )  # fmt: skip
    task = asyncio.create_task(responder.serve())

    async def plant(sender: str, step: int) -> str:
        backup = Backup(run=7, step=step, owner="k0", keys=["units.0.w"], tensors=(torch.ones(8),))
        reply = await peer_request(
            context, peer="k1", endpoint=endpoint, server_key=pairs["k1"].public.decode(),
            keypair=pairs[sender], message=backup,
            expect=BackupOk, options=SocketOptions(), timeout_s=20.0,
        )  # fmt: skip
        assert isinstance(reply, BackupOk)
        return reply.error

    try:
        assert "sent by k2, not by its owner" in await plant("k2", 1)
        assert ("k0", 7, 1) not in store
        assert await plant("k0", 2) == ""
        assert ("k0", 7, 2) in store
    finally:
        task.cancel()
        await responder.close()
        router.close(linger=0)
        auth.stop()
        context.term()


async def test_a_backup_request_sent_again_gets_the_snapshot_of_its_round_not_a_later_one() -> None:
    """The coordinator re-sends a request that may have been lost; by then this stage may
    have trained on. The answer is the snapshot the first request made."""
    from concurrent.futures import ThreadPoolExecutor

    import zmq.asyncio

    from zpipe.stage.held_copies import CopyHolder
    from zpipe.stage.metrics import StageCounters
    from zpipe.stage.snapshots import SnapshotService, request_identity
    from zpipe.transport.sockets import SocketOptions

    class Shard:
        def __init__(self) -> None:
            self.weight = torch.zeros(3)

        def training_state(self) -> dict[str, torch.Tensor]:
            return {"units.0.weight": self.weight}

    class Trainer:
        def __init__(self) -> None:
            self.shard = Shard()
            self.setup = type("Setup", (), {"run": 7})()
            self.waited: list[int] = []

        async def wait_for_step(self, step: int, timeout_s: float) -> None:
            self.waited.append(step)

    trainer = Trainer()
    with ThreadPoolExecutor(1) as compute:
        service = SnapshotService(
            name="a",
            context=zmq.asyncio.Context.instance(),
            keypair=None,
            socket_options=SocketOptions(),
            timeout_s=1.0,
            compute=compute,
            counters=StageCounters(),
            held=CopyHolder(
                name="a", timeout_s=1.0, counters=StageCounters(), replicas=ReplicaStore()
            ),
        )
        request = BackupRequest(run=7, step=3, holder="coordinator", epoch=2)

        async def pace(nbytes: int) -> None:
            return None

        first = await service.backup_reply(request, trainer, pace)  # type: ignore[arg-type]
        trainer.shard.weight += 1.0  # trains on
        again = await service.backup_reply(request, trainer, pace)  # type: ignore[arg-type]
        later = BackupRequest(run=7, step=4, holder="coordinator", epoch=2)
        later_reply = await service.backup_reply(later, trainer, pace)  # type: ignore[arg-type]
    assert first.error == "" and again == first and trainer.waited == [3, 4]
    assert again.tensors is first.tensors and torch.equal(again.tensors[0], torch.zeros(3))
    assert torch.equal(later_reply.tensors[0], torch.ones(3))
    # a request is the same one sent twice only with the same kind, epoch and body
    assert request_identity(request) == request_identity(
        BackupRequest(holder="coordinator", step=3, run=7, epoch=2)
    )
    assert request_identity(request) != request_identity(later)
    assert request_identity(request) != request_identity(dataclasses.replace(request, epoch=3))


async def test_heavy_recovery_reads_the_named_snapshots_whatever_runs_now() -> None:
    import zmq.asyncio

    from zpipe.stage.held_copies import CopyHolder
    from zpipe.stage.metrics import StageCounters
    from zpipe.stage.snapshots import SnapshotService
    from zpipe.transport.sockets import SocketOptions

    store = ReplicaStore()
    store.put("c", 4, 3, {"units.4.w": torch.full((1,), 4.0), "units.5.w": torch.ones(1)})
    store.put("b", 4, 3, {"units.2.w": torch.full((1,), 2.0), "units.3.w": torch.ones(1)})
    service = SnapshotService(
        name="c",
        context=zmq.asyncio.Context.instance(),
        keypair=None,
        socket_options=SocketOptions(),
        timeout_s=1.0,
        compute=None,  # type: ignore[arg-type]  # not used here
        counters=StageCounters(),
        held=CopyHolder(name="c", timeout_s=1.0, counters=StageCounters(), replicas=store),
    )

    async def never() -> None:
        raise AssertionError("a snapshot request stops nothing")

    ranges = [
        {"owner": "b", "run": 4, "step": 3, "start": 2, "end": 3},
        {"owner": "c", "run": 4, "step": 3, "start": 4, "end": 6},
    ]
    request = WeightsRequest(run=4, step=3, snapshot=ranges)
    # no trainer: the run that took the snapshots is over
    reply = await service.weights_reply(request, None, never)
    assert reply.error == ""
    got = dict(zip(reply.keys, reply.tensors, strict=True))
    assert sorted(got) == ["units.2.w", "units.4.w", "units.5.w"]
    assert got["units.2.w"].item() == 2.0
    missing = WeightsRequest(run=4, step=3, snapshot=[{**ranges[0], "step": 9}])
    reply = await service.weights_reply(missing, None, never)
    assert "no snapshot of 'b' after mini-batch 9" in reply.error and reply.tensors == ()
    malformed = WeightsRequest(run=4, step=3, snapshot=[{"owner": "b"}])
    reply = await service.weights_reply(malformed, None, never)
    assert "malformed snapshot range" in reply.error


async def test_a_live_chain_copy_is_kept_apart_from_the_flush_snapshots() -> None:
    # copies made without draining (zpipe.stage.live_copies) must never push out the
    # snapshot of a flush that an exact rollback still needs; they share the budget

    from zpipe.stage.executors.sync_training import DataParallelGroup, TrainingSetup
    from zpipe.stage.held_copies import CopyHolder
    from zpipe.stage.metrics import StageCounters

    store = ReplicaStore()
    held = CopyHolder(
        name="b", timeout_s=1.0, counters=StageCounters(), replicas=store, backup_budget_bytes=100
    )
    setup = TrainingSetup(
        run=7, epoch=1, name="b", index=1, num_stages=2, schedule="async-1f1b",
        num_microbatches=1, warmup=1, group=DataParallelGroup(("b",), (1,)), rank=0,
        upstream=DataParallelGroup(("a",), (1,)),
        downstream=DataParallelGroup(("client",), (1,)), wait_s=1.0, backup_from=("a",),
    )  # fmt: skip

    class Trainer:
        def __init__(self, setup: TrainingSetup) -> None:
            self.setup = setup

    def backup(step: int, floats: int, *, live: bool | None) -> Backup:
        return Backup(run=7, step=step, owner="a", keys=["units.0.w"], live=live,
                      tensors=(torch.full((floats,), float(step)),))  # fmt: skip

    trainer = Trainer(setup)
    flushed = await held.on_peer_request(backup(4, 4, live=None), trainer)  # type: ignore[arg-type]
    assert flushed.error == ""
    for step in (50, 100, 150):  # more copies than the store keeps per owner
        kept = await held.on_peer_request(backup(step, 4, live=True), trainer)  # type: ignore[arg-type]
        assert kept.error == ""
    assert ("a", 7, 4) in store  # the flush's snapshot stands
    assert ("a", 7, 150) in held.live_copies and ("a", 7, 50) not in held.live_copies
    assert held.live_copies.units("a", 7, 150, 0, 1)["units.0.w"][0].item() == 150.0
    # one budget for both: the flush's 16 bytes, the copy of 150 (16) and this one's 80
    # (the copy of 100 would be dropped) come to 112, more than 100
    huge = await held.on_peer_request(backup(200, 20, live=True), trainer)  # type: ignore[arg-type]
    assert "more than it can" in huge.error and ("a", 7, 200) not in held.live_copies
