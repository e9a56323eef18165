"""What a stage does in an asynchronous run's fast recovery: it serves a chain copy a
peer made without draining by owner, run and mini-batch (for the coordinator to
restore a dead stage's units from); a survivor keeps its latest state as its own
snapshot and sends only the keys, then loads the units it keeps from it and serves
those the re-cut moves to the peer granted them; and it resumes from units of
mixed versions, all at one weight version, with the survivors' weights and
optimizer state bit for bit (zpipe.training.async_fast_state). No sockets."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests._support.async_training import ADAM, SPEC, make_batches
from zpipe._errors import ConfigError, ProtocolError
from zpipe.planner.async_schedule import forward_version
from zpipe.protocol.peer import FetchUnits, Units
from zpipe.protocol.stage_control import WeightsRequest
from zpipe.stage.executors.async_shard import AsyncShard
from zpipe.stage.executors.async_training import AsyncTrainingExecutor
from zpipe.stage.executors.sync_training import TrainingExecutor
from zpipe.stage.held_copies import CopyHolder
from zpipe.stage.metrics import StageCounters
from zpipe.stage.peer_policy import FetchGrant, PeerIdentity
from zpipe.stage.replicas import ReplicaStore
from zpipe.stage.snapshots import SnapshotService
from zpipe.training.async_fast_state import restart_state_at
from zpipe.transport.sockets import SocketOptions


def _shard(start: int, end: int) -> AsyncShard:
    shard = AsyncShard.build(SPEC, start, end, first=start == 0, last=end == 4,
                             loss="cross_entropy", optimizer=ADAM)  # fmt: skip
    assert isinstance(shard, AsyncShard)
    return shard


def _trained(steps: int, in_flight: int) -> AsyncShard:
    """A one-stage shard after ``steps`` updates, ``in_flight`` more batches forwarded."""
    shard = _shard(0, 4)
    batches = make_batches(steps + in_flight, 5, seed=5)
    for b in range(steps + in_flight):
        x, y = batches[b]
        shard.forward_at(b, forward_version(0, 1, b, vertical_sync=True, depth=3), (x,), y, 5, 3)
        if b >= in_flight:
            done = b - in_flight
            shard.backward(done)
            shard.step_batch(done)
    return shard


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1), b.view(-1))


def test_units_of_two_versions_resume_at_one_with_their_weights_bit_for_bit() -> None:
    survivor = _trained(6, 2)  # its live state (a weights request with latest)
    copied = _trained(4, 1)  # a dead stage's copy, taken with batches in flight
    live = survivor.training_state()
    copy = copied.live_copy(3)
    assert any("#v" in k or "#live_versions" in k for k in copy)
    state = {k: v for k, v in live.items() if k.startswith(("units.0.", "units.1."))}
    state.update({k: v for k, v in copy.items() if k.startswith(("units.2.", "units.3."))})
    restarted = restart_state_at(state, version=7, depth=3)
    assert not any("#v" in k for k in restarted)
    for u in range(4):
        assert restarted[f"units.{u}.#live_versions"].tolist() == [5, 6, 7]
    resumed = _shard(0, 4)
    resumed.load_training_state(restarted)
    assert resumed.updates == 7
    after = resumed.training_state()
    for key, value in after.items():
        unit = int(key.split(".")[1])
        source = live if unit < 2 else copy
        assert _bits(value, source[key]), key  # weights and optimizer state alike
    # it trains on: batch 0 of the resumed run reads version max(0, 7 + 0 - 3 + 1) = 5
    x, y = make_batches(1, 5, seed=9)[0]
    resumed.forward_at(0, forward_version(0, 1, 7, vertical_sync=True, depth=3), (x,), y, 5, 3)
    resumed.backward(0)
    resumed.step_batch(0)
    assert resumed.updates == 8


def test_a_restart_refuses_what_is_not_a_units_state() -> None:
    with pytest.raises(ConfigError, match="not state of a unit"):
        restart_state_at({"weight": torch.zeros(1)}, version=1, depth=2)
    with pytest.raises(ConfigError, match="version"):
        restart_state_at({}, version=-1, depth=2)
    with pytest.raises(ConfigError, match="depth"):
        restart_state_at({}, version=1, depth=0)
    # early in a run the versions start at 0
    early = restart_state_at({"units.0.weight": torch.zeros(1)}, version=1, depth=4)
    assert early["units.0.#live_versions"].tolist() == [0, 1]


def _service() -> SnapshotService:
    context: Any = None  # never used: nothing here opens a socket
    counters = StageCounters()
    held = CopyHolder(name="c", timeout_s=1.0, counters=counters, replicas=ReplicaStore())
    return SnapshotService(
        name="c", context=context, keypair=None, socket_options=SocketOptions(),
        timeout_s=1.0, compute=ThreadPoolExecutor(1), counters=counters, held=held,
    )  # fmt: skip


def test_a_holder_serves_a_peers_chain_copy_by_owner_run_and_mini_batch() -> None:
    service = _service()
    chain = {"units.2.weight": torch.full((2,), 6.0), "units.3.weight": torch.full((2,), 7.0)}
    service.held.live_copies.put("b", 3, 6, chain)
    got = service.held.snapshot_units([{"owner": "b", "run": 3, "step": 6, "start": 2, "end": 3}])
    assert list(got) == ["units.2.weight"] and torch.equal(
        got["units.2.weight"], chain["units.2.weight"]
    )
    # a flush's snapshot of the same key wins: it is what a rollback restores
    flushed = {"units.2.weight": torch.full((2,), 1.0)}
    service.held.replicas.put("b", 3, 6, flushed)
    again = service.held.snapshot_units([{"owner": "b", "run": 3, "step": 6, "start": 2, "end": 3}])
    assert torch.equal(again["units.2.weight"], flushed["units.2.weight"])
    with pytest.raises(ConfigError, match="no snapshot"):
        service.held.snapshot_units([{"owner": "b", "run": 3, "step": 4, "start": 2, "end": 3}])


def _survivor(shard: AsyncShard, run: int) -> AsyncTrainingExecutor:
    """An asynchronous trainer of ``run`` over ``shard``, as far as a weights request
    reads one (its shard, its update count, the rounds it completed)."""
    trainer = object.__new__(AsyncTrainingExecutor)
    trainer.setup = SimpleNamespace(run=run)  # type: ignore[assignment]
    trainer.shard = shard
    trainer.async_shard = shard
    trainer.completed_steps = shard.updates
    return trainer


async def test_a_survivor_keeps_its_state_and_sends_only_the_keys() -> None:
    service = _service()
    survivor = _trained(6, 2)
    stopped: list[bool] = []

    async def stop() -> None:
        stopped.append(True)

    ask = WeightsRequest(run=3, step=0, optimizer=True, latest=True, keep=True)
    reply = await service.weights_reply(ask, _survivor(survivor, 3), stop)
    assert reply.error == "" and stopped == [True]
    live = survivor.training_state()
    # the keys (the units it holds) and its update count go to the coordinator
    assert reply.keys == list(live) and reply.tensors == () and reply.updates == 6
    # the state stays here, as this stage's own snapshot after its 6 updates
    kept = service.held.replicas.units("c", 3, 6, 0, 4)
    assert sorted(kept) == sorted(live) and all(_bits(kept[k], live[k]) for k in live)


async def test_only_an_asynchronous_stage_keeps_its_latest_state() -> None:
    service = _service()
    sync = object.__new__(TrainingExecutor)
    sync.setup = SimpleNamespace(run=3)  # type: ignore[assignment]
    sync.shard = _trained(2, 0)
    sync.completed_steps = 2

    async def stop() -> None:
        pass

    ask = WeightsRequest(run=3, step=0, optimizer=True, latest=True, keep=True)
    reply = await service.weights_reply(ask, sync, stop)
    assert "only an asynchronous stage" in reply.error and reply.tensors == ()


async def test_kept_units_load_locally_and_are_served_to_the_peer_granted_them() -> None:
    service = _service()
    survivor = _trained(6, 2)
    ask = WeightsRequest(run=3, step=0, optimizer=True, latest=True, keep=True)

    async def stop() -> None:
        pass

    await service.weights_reply(ask, _survivor(survivor, 3), stop)
    live = survivor.training_state()
    # the units c keeps: from its own snapshot, at the resume version the entry names
    restart = {"version": 7, "depth": 3}
    entry = {"from": "c", "owner": "c", "run": 3, "step": 6, "start": 0, "end": 2,
             "restart": restart}  # fmt: skip
    got = await service.fetched_state([entry])
    assert {k.split(".")[1] for k in got} == {"0", "1"} and not any("#v" in k for k in got)
    for u in (0, 1):
        assert got[f"units.{u}.#live_versions"].tolist() == [5, 6, 7]
    for key, value in got.items():
        if "#live_versions" not in key:
            assert _bits(value, live[key]), key  # weights and optimizer state bit for bit
    # unit 2 goes to b: c serves it to b once the coordinator granted that fetch
    fetch = FetchUnits(owner="c", run=3, step=6, start=2, end=3)
    refused = service.held._serve_fetch(fetch, PeerIdentity(True, "b"))
    assert isinstance(refused, Units) and "did not name anyone" in refused.error
    service.held.fetch_grants = (FetchGrant("b", "c", 3, 6, 2, 3),)
    served = service.held._serve_fetch(fetch, PeerIdentity(True, "b"))
    assert isinstance(served, Units) and served.error == ""
    sent = dict(zip(served.keys, served.tensors, strict=True))
    assert sorted(sent) == sorted(k for k in live if k.startswith("units.2."))
    assert all(_bits(sent[k], live[k]) for k in sent)
    # a malformed restart is refused, not guessed
    with pytest.raises(ProtocolError, match="restart"):
        await service.fetched_state([{**entry, "restart": {"version": "x"}}])


async def test_units_of_no_copy_are_built_here_at_their_initial_weights() -> None:
    # a fast recovery found no copy of the dead stage's units 2-3 (it died before its
    # first chain copy landed): c builds them from the model spec, version 0 exactly,
    # and resumes them with the units it kept, all at the acknowledged version
    service = _service()
    survivor = _trained(6, 2)

    async def stop() -> None:
        pass

    ask = WeightsRequest(run=3, step=0, optimizer=True, latest=True, keep=True)
    await service.weights_reply(ask, _survivor(survivor, 3), stop)
    restart = {"version": 7, "depth": 3}
    kept = {"from": "c", "owner": "c", "run": 3, "step": 6, "start": 0, "end": 2,
            "restart": restart}  # fmt: skip
    initial = {"from": "c", "owner": "b", "run": 3, "step": 0, "start": 2, "end": 4,
               "initial": True, "restart": restart}  # fmt: skip
    got = await service.fetched_state([kept, initial], SPEC)
    fresh = _shard(0, 4).training_state()  # a fresh build: the run's version 0
    trained = survivor.training_state()
    for u in range(4):
        assert got[f"units.{u}.#live_versions"].tolist() == [5, 6, 7]
    for key, value in got.items():
        if "#live_versions" in key:
            continue
        unit = int(key.split(".")[1])
        assert _bits(value, (trained if unit < 2 else fresh)[key]), key
    # no optimizer state for the initial units: none exists before a first update
    assert not any("#opt" in k for k in got if k.startswith(("units.2.", "units.3.")))
    key = "units.2.linear.weight"
    assert not _bits(got[key], trained[key])  # truly fresh, not the trained weights
    resumed = _shard(0, 4)
    resumed.load_training_state(got)
    assert resumed.updates == 7
    # an initial entry is built here only, and only for an assignment's model
    with pytest.raises(ProtocolError, match="no model"):
        await service.fetched_state([initial])
    with pytest.raises(ProtocolError, match="built here"):
        await service.fetched_state([{**initial, "from": "d"}], SPEC)


async def test_a_chain_copy_held_here_is_confirmed_loaded_in_place_and_served_when_granted() -> (
    None
):
    # c holds b's chain copy of mini-batch 4 of run 3 (made without draining); a
    # newer run's snapshot of c's own is here too
    service = _service()
    copy = _trained(4, 1).live_copy(3)
    chain = {k: v for k, v in copy.items() if k.startswith(("units.2.", "units.3."))}
    service.held.live_copies.put("b", 3, 4, chain)
    service.held.replicas.put("c", 5, 9, {"units.0.linear.weight": torch.zeros(1)})
    ranges = [{"owner": "b", "run": 3, "step": 4, "start": 2, "end": 4}]

    async def stop() -> None:
        pass

    # confirmed with keep: the keys only, the tensors stay here
    ask = WeightsRequest(run=0, step=0, snapshot=ranges, keep=True)
    reply = await service.weights_reply(ask, None, stop)
    assert reply.error == "" and reply.tensors == () and sorted(reply.keys) == sorted(chain)
    # without keep the tensors come too (a heavy recovery, as before)
    full = await service.weights_reply(WeightsRequest(run=0, step=0, snapshot=ranges), None, stop)
    assert len(full.tensors) == len(chain)
    # loaded in place by an assignment's entry that names this stage
    restart = {"version": 7, "depth": 3}
    entry = {"from": "c", "owner": "b", "run": 3, "step": 4, "start": 2, "end": 4,
             "restart": restart}  # fmt: skip
    got = await service.fetched_state([entry])
    assert not any("#v" in k for k in got)
    for key, value in got.items():
        if "#live_versions" in key:
            assert value.tolist() == [5, 6, 7]
        else:
            assert _bits(value, chain[key]), key  # the copy's live weights bit for bit
    # served to the peer the coordinator granted it, though run 5 is newer here: a
    # recovery reads a chain copy by owner, run and mini-batch
    fetch = FetchUnits(owner="b", run=3, step=4, start=2, end=3)
    refused = service.held._serve_fetch(fetch, PeerIdentity(True, "a"))
    assert isinstance(refused, Units) and "did not name anyone" in refused.error
    service.held.fetch_grants = (FetchGrant("a", "b", 3, 4, 2, 3),)
    served = service.held._serve_fetch(fetch, PeerIdentity(True, "a"))
    assert isinstance(served, Units) and served.error == ""
    sent = dict(zip(served.keys, served.tensors, strict=True))
    assert sorted(sent) == sorted(k for k in chain if k.startswith("units.2."))
    # an own snapshot of an older run than the newest here is still not served
    service.held.replicas.put("c", 3, 6, {"units.0.linear.weight": torch.zeros(1)})
    service.held.fetch_grants = (FetchGrant("a", "c", 3, 6, 0, 1),)
    old = service.held._serve_fetch(FetchUnits(owner="c", run=3, step=6, start=0, end=1),
                               PeerIdentity(True, "a"))  # fmt: skip
    assert isinstance(old, Units) and "no longer served" in old.error
