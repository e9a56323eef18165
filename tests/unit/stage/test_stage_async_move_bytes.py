"""What a live re-partition of an asynchronous run puts on the wire: each moved unit's
state once, and nothing of the units that stay.

The path of a move, without sockets: every stage keeps its snapshot at the flush
(``prepare``: :meth:`AsyncShard.repartition_snapshot` into its replica store), the
coordinator's fetch plan (:func:`~zpipe.coordinator.decisions.fetch_plans`) says
which stage fetches which units from whom, a holder answers a peer's fetch with
:meth:`ReplicaStore.units` (what :class:`~zpipe.stage.held_copies.CopyHolder`
serves), and the new shard is built from what was fetched (``commit``). A moved
unit carries its live weights and buffers, the optimizer's state, and the weight
versions the next forwards read that differ from the live weights (depth - 1 of
them: the newest is the live weights, named, not sent; issue 30 counted n + 3
copies when it was sent again). The stale versions are distinct weights the next
``depth - 1`` forwards use under vertical sync, so a move cannot leave them out and
stay exact."""

from __future__ import annotations

import torch

from tests._support.async_shards import run_shards, shard_weights
from tests._support.async_training import ADAM, SPEC, make_batches
from zpipe.coordinator.current_run import KeptReplica
from zpipe.coordinator.decisions import fetch_plans
from zpipe.models.weights import OPTIMIZER_KEY, split_unit_key
from zpipe.planner.training_plan import TrainingPlan, TrainStage
from zpipe.stage.executors.async_shard import AsyncShard
from zpipe.stage.replicas import ReplicaStore
from zpipe.training.async_reference import train_async_reference
from zpipe.training.async_regroup import VERSION_KEY
from zpipe.training.repartition import spans_of

DEVICES = ["s0", "s1", "s2"]
BEFORE, AFTER = [0, 1, 2, 4], [0, 2, 3, 4]


def _shards(bounds: list[int]) -> list[AsyncShard]:
    n = len(bounds) - 1
    out = []
    for i in range(n):
        shard = AsyncShard.build(
            SPEC, bounds[i], bounds[i + 1], first=i == 0, last=i == n - 1,
            loss="cross_entropy", optimizer=ADAM,
        )  # fmt: skip
        assert isinstance(shard, AsyncShard)
        out.append(shard)
    return out


def _plan(bounds: list[int]) -> TrainingPlan:
    stages = tuple(
        TrainStage((d,), bounds[i], bounds[i + 1], (5,), 3 - i) for i, d in enumerate(DEVICES)
    )
    return TrainingPlan("even", "async-1f1b", 4, 5, 1, stages)


def test_a_move_sends_each_moved_unit_once_and_nothing_of_the_units_that_stay() -> None:
    batches = make_batches(9, 5, seed=4)
    shards = _shards(BEFORE)
    run_shards(shards, batches[:4])  # the flush before mini-batch 4
    stores = {d: ReplicaStore() for d in DEVICES}
    for device, shard in zip(DEVICES, shards, strict=True):
        stores[device].put(device, 1, 4, shard.repartition_snapshot(3))  # prepare
    own = {d: d for d in DEVICES}  # as the coordinator's move: each its own snapshot
    replica = KeptReplica(1, 4, _plan(BEFORE), {}, holders=own, global_copy=False)
    fetches = fetch_plans(replica, spans_of(DEVICES, AFTER), set(DEVICES))
    wire: dict[str, dict[str, torch.Tensor]] = {d: {} for d in DEVICES}  # what each receives
    fetched: dict[str, dict[str, torch.Tensor]] = {d: {} for d in DEVICES}
    for dest, entries in fetches.items():
        for e in entries:
            units = stores[e["from"]].units(e["owner"], 1, 4, e["start"], e["end"])
            fetched[dest].update(units)
            if e["from"] != dest:
                assert not set(units) & set(wire[dest]), "a tensor fetched twice"
                wire[dest].update(units)
    sent_units = sorted(
        {u[0] for d in DEVICES for k in wire[d] if (u := split_unit_key(k)) is not None}
    )
    # BEFORE [0,1,2,4] -> AFTER [0,2,3,4]: unit 1 s1 -> s0, unit 2 s2 -> s1; 0 and 3 stay
    assert sent_units == [1, 2]
    assert {d: sorted({split_unit_key(k)[0] for k in w}) for d, w in wire.items()} == {  # type: ignore[index]
        "s0": [1], "s1": [2], "s2": []
    }  # fmt: skip
    for unit in sent_units:
        received = {
            k: t for w in wire.values() for k, t in w.items() if k.startswith(f"units.{unit}.")
        }
        module = shards[unit].units[0]  # unit 1 leads stage 1, unit 2 stage 2
        params = dict(module.named_parameters())
        live = [k for k in received if "#" not in k]
        versions = [k for k in received if VERSION_KEY in k]
        moments = [k for k in received if OPTIMIZER_KEY in k and received[k].dim() > 0]
        # once: the live weights, depth - 1 = 2 stale versions, Adam's two moments
        assert len(live) == len(module.state_dict())
        assert len(versions) == 2 * len(params) and len(moments) == 2 * len(params)
        param_bytes = sum(p.numel() * p.element_size() for p in params.values())
        big = [t for k, t in received.items() if t.dim() > 0 and not k.endswith("#live_versions")]
        assert sum(t.numel() * t.element_size() for t in big) == 5 * param_bytes
        # no tensor of it is sent twice: every parameter-shaped tensor differs
        flat = [t.reshape(-1) for t in big]
        for a in range(len(flat)):
            for b in range(a + 1, len(flat)):
                assert flat[a].shape != flat[b].shape or not torch.equal(flat[a], flat[b])
    # the commit builds the new shards from what was fetched, and the run goes on
    # exactly as the reference that moves the units at the same flush
    moved = [
        shard.regrouped(AFTER[i], AFTER[i + 1], fetched[DEVICES[i]])
        for i, shard in enumerate(shards)
    ]
    run_shards(moved, batches[4:])
    want = train_async_reference(
        SPEC, batches, bounds=BEFORE, optimizer=ADAM, repartitions={4: AFTER}
    )
    got = shard_weights(moved)
    assert set(got) == set(want.state_dict)
    for key, value in want.state_dict.items():
        assert torch.equal(got[key], value), key
