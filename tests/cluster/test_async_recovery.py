"""Recovery of asynchronous 1F1B runs: replicas at flush points, a resume on the
survivors that keeps the run's depth, and a real pipeline whose stage is killed.

The pure parts: a flush changes nothing (versions count from the run's start), a
recovery onto fewer stages keeps the staleness of the depth the run started with
and so trains as the uninterrupted run, a stage restores its weight versions from
a replica, and the combinations a recovery does not support are refused. Then
real stage processes on loopback: an ``async-1f1b`` run with ``recover=True``
whose middle stage is SIGKILLed mid-run equals the same run without the kill and
the single-process reference.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests._support.async_training import ADAM, SGD, SPEC, make_batches
from tests._support.training_recovery import _events
from zpipe._errors import ConfigError, PipelineError, ProtocolError, ZpipeError
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.config import Timeouts
from zpipe.coordinator.commands import Send
from zpipe.coordinator.flows import FlowRunner
from zpipe.coordinator.runs.async_replicas import collect_async_replica
from zpipe.planner.async_schedule import AsyncSettings, aggregation_intervals, forward_version
from zpipe.planner.training_plan import TrainingPlan, TrainStage
from zpipe.protocol.repartition import RepartitionReply
from zpipe.stage.executors.async_shard import AsyncShard
from zpipe.training.async_recovery import async_recovery_refusal
from zpipe.training.async_reference import train_async_reference
from zpipe.training.async_regroup import (
    needed_versions,
    unit_state_from_tensors,
    unit_state_tensors,
)
from zpipe.training.async_stage import AsyncStageCompute, UnitState, common_versions


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for key, value in b.items():
        torch.testing.assert_close(a[key], value, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- the reference


@pytest.mark.parametrize("optimizer", [SGD, ADAM], ids=["sgd", "adam"])
def test_flushes_change_neither_versions_nor_weights(optimizer: dict) -> None:
    batches = make_batches(10, 5, seed=3)
    plain = train_async_reference(SPEC, batches, bounds=[0, 1, 3, 4], optimizer=optimizer)
    flushed = train_async_reference(
        SPEC, batches, bounds=[0, 1, 3, 4], optimizer=optimizer, flushes=[3, 6, 9]
    )
    assert flushed.losses == plain.losses
    assert flushed.forward_versions == plain.forward_versions
    assert_same(flushed.state_dict, plain.state_dict)


def test_a_recovery_onto_fewer_stages_keeps_the_runs_depth_and_its_result() -> None:
    batches = make_batches(10, 5, seed=4)
    plain = train_async_reference(SPEC, batches, bounds=[0, 1, 3, 4], optimizer=ADAM)
    # the middle stage died after the replica before batch 3: two stages from there
    recovered = train_async_reference(
        SPEC,
        batches,
        bounds=[0, 1, 3, 4],
        optimizer=ADAM,
        flushes=[6],
        repartitions={3: [0, 2, 4]},
    )
    assert recovered.losses == pytest.approx(plain.losses, rel=1e-6)
    assert_same(recovered.state_dict, plain.state_dict)
    # the two stages forward batch b with version b - 3 + 1, not their own b - 2 + 1
    assert recovered.forward_versions[0][7] == 5 == plain.forward_versions[0][7]
    assert forward_version(0, 2, 7, vertical_sync=True) == 6
    # a two-stage pipeline from the start is another run
    two = train_async_reference(SPEC, batches, bounds=[0, 2, 4], optimizer=ADAM)
    assert two.losses != pytest.approx(plain.losses, rel=1e-6)


def test_the_runs_depth_needs_vertical_sync_and_no_shallower_pipeline() -> None:
    assert forward_version(1, 2, 9, vertical_sync=True, depth=4) == 6
    assert forward_version(1, 4, 9, vertical_sync=False, depth=4) == 7  # its own depth
    with pytest.raises(ConfigError, match="vertical"):
        forward_version(0, 2, 9, vertical_sync=False, depth=3)
    with pytest.raises(ConfigError):
        forward_version(0, 3, 9, vertical_sync=True, depth=2)
    with pytest.raises(ConfigError, match="vertical sync"):
        AsyncSettings(vertical_sync=False, depth=3)
    with pytest.raises(ConfigError, match="cannot run on 3"):
        AsyncSettings(depth=2).depth_of(3)
    assert AsyncSettings(depth=3).depth_of(2) == 3 and AsyncSettings().depth_of(2) == 2
    # sent only when set: a peer that predates it refuses unknown settings
    assert "depth" not in AsyncSettings().to_dict()
    assert AsyncSettings.from_dict(AsyncSettings(depth=3).to_dict()) == AsyncSettings(depth=3)
    # aggregation windows: those of the run's depth (test_async_recovery_repartition.py)
    with pytest.raises(ConfigError, match="cannot run on 3"):
        aggregation_intervals(3, aggregate=True, depth=2)


# ---------------------------------------------------------------- a stage's replica


def _shard(start: int, end: int, *, first: bool, last: bool) -> AsyncShard:
    shard = AsyncShard.build(SPEC, start, end, first=first, last=last, loss="cross_entropy",
                             optimizer=ADAM)  # fmt: skip
    assert isinstance(shard, AsyncShard)
    return shard


def test_a_stage_restores_weights_versions_and_updates_from_its_replica() -> None:
    # one stage alone (first and last): train 4 batches at depth 3, replicate, go on
    batches = make_batches(7, 5, seed=5)
    kept = _shard(0, 4, first=True, last=True)

    def train(shard: AsyncShard, lo: int, hi: int, origin: int) -> list[float]:
        losses = []
        for b in range(lo, hi):
            version = forward_version(0, 1, origin + b, vertical_sync=True, depth=3)
            _, loss, _ = shard.forward_at(b, version, batches[origin + b][:1],
                                          batches[origin + b][1], 5, 1)  # fmt: skip
            shard.backward(b)
            shard.step_batch(b)
            assert loss is not None
            losses.append(loss)
        return losses

    train(kept, 0, 4, 0)
    replica = kept.repartition_snapshot(3)
    # version 4 is the live weights: named, not sent again
    assert {k.rpartition("#v")[2] for k in replica if "#v" in k} == {"2", "3"}
    assert replica["units.0.#live_versions"].tolist() == [4]
    restored = _shard(0, 4, first=True, last=True)
    restored.load_training_state(replica)
    assert restored.updates == 4 and restored.compute.versions_kept == [2, 3, 4]
    # the restored stage numbers its batches from 0 again; its versions go on from 4
    assert train(restored, 0, 3, 4) == train(kept, 4, 7, 0)
    assert_same(restored.training_state(), kept.training_state())
    # another range's replica is refused, and so is one without every version
    other = _shard(1, 4, first=False, last=True)
    with pytest.raises(ConfigError, match="foreign"):
        other.load_training_state(replica)
    broken = {k: v for k, v in replica.items() if not k.startswith("units.0.")}
    with pytest.raises(ConfigError):
        _shard(0, 4, first=True, last=True).load_training_state(broken)


def test_a_shard_without_versions_in_its_state_starts_a_version_count_of_its_own() -> None:
    kept = _shard(0, 2, first=True, last=False)
    fresh = _shard(0, 2, first=True, last=False)
    fresh.load_training_state(kept.training_state())
    assert fresh.updates == 0 and fresh.compute.versions_kept == [0]
    with pytest.raises(PipelineError):
        fresh.compute.forward(0, 1, make_batches(1, 5)[0][:1])


# ---------------------------------------------------------------- what is refused


def test_the_combinations_a_recovery_does_not_support_are_refused() -> None:
    from zpipe.client.options import TrainOptions

    fine = dict(vertical_sync=True, consistency="exact", rebalance=None)
    assert async_recovery_refusal(**fine) is None  # type: ignore[arg-type]
    for change, words in [
        ({"vertical_sync": False}, "vertical sync"),
        ({"consistency": "fast"}, "exact"),
        ({"rebalance": 0.2}, "rebalance"),
    ]:
        refusal = async_recovery_refusal(**{**fine, **change})  # type: ignore[arg-type]
        assert refusal is not None and words in refusal
    base = dict(optimizer=SGD, num_microbatches=1, schedule="async-1f1b", recover=True)
    assert TrainOptions(**base).replica_period is not None  # type: ignore[arg-type]
    # aggregation keeps the windows of the run's depth (test_async_recovery_repartition.py)
    assert TrainOptions(**base, aggregate=True).replica_period is not None  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="vertical sync"):
        TrainOptions(**base, vertical_sync=False)  # type: ignore[arg-type]
    # recovery and live re-partitioning share the flush points (see below)
    both = TrainOptions(**base, repartition={"first": 4})  # type: ignore[arg-type]
    assert both.repartition_settings is not None and both.replica_period is not None
    with pytest.raises(ConfigError, match="synchronous run"):
        TrainOptions(optimizer=SGD, num_microbatches=2, recover=True, repartition=True)
    with pytest.raises(ConfigError, match="exact"):
        TrainOptions(**base, consistency="fast")  # type: ignore[arg-type]
    chain = TrainOptions(**base, replication="chain", chain_every=2, global_every=4)  # type: ignore[arg-type]
    assert (chain.replica_period, chain.global_period) == (2, 4)


def test_train_cli_takes_recover_for_async_runs_but_not_without_vertical_sync(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from zpipe.cli.train import main

    with pytest.raises(SystemExit):
        main(["--local", "2", "--schedule", "async-1f1b", "--recover", "--no-vertical-sync"])
    assert "vertical sync" in capsys.readouterr().err


# ---------------------------------------------------------------- a real pipeline

NAMES = ["a", "b", "c"]
PARTITION = [[0, 1], [1, 3], [3, 4]]


@pytest.fixture
def recovering(async_recovery_cluster: LocalCluster) -> LocalCluster:
    # the session's cluster of a, b and c (conftest), shared with
    # tests/cluster/test_async_recovery_repartition.py
    return async_recovery_cluster


def test_a_killed_stage_of_an_async_run_recovers_exactly(recovering: LocalCluster) -> None:
    cluster = recovering
    batches = make_batches(10, 5, seed=7)
    want = train_async_reference(
        SPEC, batches, bounds=[0, 1, 3, 4], optimizer=ADAM, flushes=[3, 6, 9]
    )
    settings = {
        "optimizer": ADAM,
        "num_microbatches": 1,
        "schedule": "async-1f1b",
        "progress": False,
        "partition": PARTITION,
        "stage_names": NAMES,
        "recover": True,
        "replicate_every": 3,
    }
    since = len(cluster.logs("coordinator"))
    uninterrupted = cluster.fit(SPEC, batches, **settings)  # type: ignore[arg-type]
    log = cluster.logs("coordinator")[since:]
    # a replica at every flush: every unit, with its optimizer state and versions
    kept = _events(log, "replica_kept")
    assert [e["step"] for e in kept] == [0, 3, 6, 9]
    weights = len(want.state_dict)
    assert all(int(e["tensors"]) > weights for e in kept)  # type: ignore[call-overload]
    assert uninterrupted.losses == pytest.approx(want.losses, rel=1e-6)
    assert_same(uninterrupted.state_dict, want.state_dict)

    killed: list[str] = []

    def on_step(step: int, _loss: float) -> None:
        if step == 4 and not killed:
            killed.append("b")
            cluster.kill("b")

    try:
        report = cluster.fit(SPEC, batches, on_step=on_step, **settings)  # type: ignore[arg-type]
    finally:
        for name in killed:
            cluster.start_stage(DeviceSpec(name))
        cluster.wait_for_stages(len(NAMES), timeout_s=120)
    assert killed == ["b"]
    (recovery,) = report.recoveries
    assert (recovery["dead"], recovery["resumed_from"], recovery["depth"]) == ("b", 3, 3)
    assert report.training_plan is not None and len(report.training_plan.stages) == 2
    assert report.losses == pytest.approx(uninterrupted.losses, rel=1e-6)
    assert_same(report.state_dict, uninterrupted.state_dict)
    # the single-process reference of the recovered run: two stages from batch 3 on
    bounds = [s.start for s in report.training_plan.stages] + [4]
    recovered = train_async_reference(
        SPEC, batches, bounds=[0, 1, 3, 4], optimizer=ADAM, flushes=[6, 9],
        repartitions={3: bounds},
    )  # fmt: skip
    assert report.losses == pytest.approx(recovered.losses, rel=1e-6)
    assert_same(report.state_dict, recovered.state_dict)


def test_chain_replicas_of_an_async_run_restore_a_killed_stage_from_its_backup(
    recovering: LocalCluster,
) -> None:
    cluster = recovering
    batches = make_batches(9, 5, seed=9)
    want = train_async_reference(SPEC, batches, bounds=[0, 1, 3, 4], optimizer=SGD)
    since = len(cluster.logs("coordinator"))
    killed: list[str] = []

    def on_step(step: int, _loss: float) -> None:
        if step == 5 and not killed:
            killed.append("b")
            cluster.kill("b")

    # chain replicas before mini-batches 0, 2, 4, 6, 8, global copies before 0 and 4;
    # b dies after 5: its units come back from the backup c kept of them at 4
    try:
        report = cluster.fit(
            SPEC, batches, optimizer=SGD, num_microbatches=1, schedule="async-1f1b",
            progress=False, partition=PARTITION, stage_names=NAMES, recover=True,
            replication="chain", chain_every=2, global_every=4, on_step=on_step,
        )  # fmt: skip
    finally:
        for name in killed:
            cluster.start_stage(DeviceSpec(name))
        cluster.wait_for_stages(len(NAMES), timeout_s=120)
    assert killed == ["b"]
    log = cluster.logs("coordinator")[since:]
    kept = _events(log, "replica_kept")
    assert kept[1]["holders"] == {"a": "b", "b": "c", "c": "coordinator"}
    (recovery,) = report.recoveries
    assert (recovery["dead"], recovery["resumed_from"]) == ("b", 4)
    # every unit came from a stage's own snapshot or a neighbour's backup, with versions
    (planned,) = _events(log, "restore_planned")
    assert planned["from_coordinator"] == 0
    assert report.losses == pytest.approx(want.losses, rel=1e-6)
    assert_same(report.state_dict, want.state_dict)


def test_heavy_recovery_of_an_async_run_replans_a_straight_pipeline_exactly(
    recovering: LocalCluster,
) -> None:
    cluster = recovering
    batches = make_batches(8, 5, seed=11)
    want = train_async_reference(SPEC, batches, bounds=[0, 1, 3, 4], optimizer=ADAM)
    killed: list[str] = []

    def on_step(step: int, _loss: float) -> None:
        if step == 3 and not killed:
            killed.append("c")
            cluster.kill("c")

    try:
        report = cluster.fit(
            SPEC, batches, optimizer=ADAM, num_microbatches=1, schedule="async-1f1b",
            progress=False, partition=PARTITION, stage_names=NAMES, recover=True,
            replicate_every=2, recovery="heavy", on_step=on_step,
        )  # fmt: skip
    finally:
        for name in killed:
            cluster.start_stage(DeviceSpec(name))
        cluster.wait_for_stages(len(NAMES), timeout_s=120)
    assert killed == ["c"]
    (recovery,) = report.recoveries
    assert (recovery["dead"], recovery["resumed_from"], recovery["policy"]) == ("c", 2, "heavy")
    assert report.training_plan is not None
    assert all(len(s.devices) == 1 for s in report.training_plan.stages)
    assert report.losses == pytest.approx(want.losses, rel=1e-6)
    assert_same(report.state_dict, want.state_dict)


# ------------------------------------------------ units without trainable parameters


def _trained_compute() -> AsyncStageCompute:
    torch.manual_seed(3)
    units = [torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)]
    compute = AsyncStageCompute(units, first=True, last=True, loss="cross_entropy",
                                optimizer=SGD)  # fmt: skip
    generator = torch.Generator().manual_seed(4)
    for b in range(3):
        x = torch.randn(5, 6, generator=generator)
        y = torch.randint(0, 3, (5,), generator=generator)
        compute.forward(b, b, (x,), y, 5)
        compute.backward(b)
        compute.step(b)
    return compute


def _through_the_wire(compute: AsyncStageCompute) -> list[UnitState]:
    fresh = [torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)]
    out = []
    for unit, (state, module) in enumerate(zip(compute.export_units(), fresh, strict=True)):
        tensors = unit_state_tensors(unit, state, needed_versions(compute.updates, 2))
        out.append(unit_state_from_tensors(unit, module, tensors))
    return out


def test_a_unit_without_parameters_moves_with_its_stage_and_keeps_every_version() -> None:
    compute = _trained_compute()
    states = _through_the_wire(compute)
    assert states[1].versions == {}  # an activation carries no version tensors
    assert common_versions(states) == {2, 3}
    adopted = AsyncStageCompute.adopt(states, updates=3, first=True, last=True,
                                      loss="cross_entropy", optimizer=SGD)  # fmt: skip
    assert adopted.versions_kept == [2, 3]
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(9))
    y = torch.tensor([0, 1, 2, 0])
    # the adopted stage computes what the original does at the same version
    assert adopted.forward(7, 3, (x,), y, 4)[1] == compute.forward(7, 3, (x,), y, 4)[1]


def test_only_activations_cannot_say_their_update_count() -> None:
    assert common_versions([UnitState(torch.nn.ReLU(), {}, {})]) == set()
    assert common_versions([UnitState(torch.nn.ReLU(), {}, {})], default=5) == {5}


def test_version_and_optimizer_tensors_of_the_wrong_shape_are_refused() -> None:
    compute = _trained_compute()
    state = compute.export_units()[0]
    tensors = unit_state_tensors(0, state, needed_versions(compute.updates, 2))
    bad_version = {**tensors, "units.0.bias#v3": torch.zeros(1)}
    with pytest.raises(ProtocolError, match="version tensor"):
        unit_state_from_tensors(0, torch.nn.Linear(6, 8), bad_version)
    bad_dtype = {**tensors, "units.0.bias#v3": torch.zeros(8, dtype=torch.float64)}
    with pytest.raises(ProtocolError, match="float64"):
        unit_state_from_tensors(0, torch.nn.Linear(6, 8), bad_dtype)
    opt_key = next(k for k in tensors if "#opt." in k and k.startswith("units.0.weight"))
    with pytest.raises(ProtocolError, match="optimizer state"):
        unit_state_from_tensors(0, torch.nn.Linear(6, 8), {**tensors, opt_key: torch.zeros(3)})


def test_async_options_take_schedules_and_resumes() -> None:
    from zpipe.client.options import TrainOptions

    # the update count comes from the checkpoint's versions (zpipe.training.async_stage)
    with pytest.raises(ConfigError, match="only with resume_optimizer"):
        TrainOptions(schedule="async-1f1b", num_microbatches=1, optimizer=SGD, start_step=4)
    TrainOptions(
        schedule="async-1f1b", num_microbatches=1, optimizer=SGD, start_step=4,
        resume_optimizer=True,
    )  # fmt: skip
    # a schedule is read at each stage's own update count (zpipe.training.async_stage)
    schedule = {"name": "cosine", "total_steps": 8}
    options = TrainOptions(
        schedule="async-1f1b", num_microbatches=1, optimizer=SGD, lr_schedule=schedule
    )
    assert options.lr_schedule == {**schedule, "warmup_steps": 0}


# ------------------------------------------------ a replica that fails resumes the stages


def _replica_owner(train: dict[str, Any]) -> SimpleNamespace:
    """The parts of an asynchronous run's controller a replica's flow reads: a
    two-stage plan (a: units 0-2, b: 2-4), both alive, the run request's settings."""
    plan = TrainingPlan(
        algo="even", num_units=4, schedule="async-1f1b", microbatch_size=1, num_microbatches=1,
        stages=(TrainStage(("a",), 0, 2, (1,), 2), TrainStage(("b",), 2, 4, (1,), 1)),
    )  # fmt: skip
    alive = [SimpleNamespace(name=n, routing_id=n.encode()) for n in "ab"]
    return SimpleNamespace(
        run=SimpleNamespace(run=7, epoch=1, training_plan=plan, replication="global",
                            request=SimpleNamespace(train=train), rebalance=None,
                            repartition_epoch=0, repartition_pending=None),
        state=SimpleNamespace(membership=SimpleNamespace(alive=lambda: alive),
                              timeouts=Timeouts()),
    )  # fmt: skip


def _drive(owner: SimpleNamespace, failures: list[BaseException]) -> tuple[FlowRunner, list[Send]]:
    def flow():  # type: ignore[no-untyped-def]
        try:
            yield from collect_async_replica(owner, 12, False, {})  # type: ignore[arg-type]
        except ZpipeError as exc:
            failures.append(exc)

    runner = FlowRunner()
    return runner, [c for c in runner.start(flow(), 0.0) if isinstance(c, Send)]


def _phases(commands: list[Any]) -> list[tuple[str, str]]:
    return [(c.stage, c.wire.body["phase"]) for c in commands if isinstance(c, Send)]


def _reply(runner: FlowRunner, phase: str, now: float, **errors: str) -> list[Any]:
    out: list[Any] = []
    for name in "ab":
        body = {"run": 7, "step": 12, "phase": phase, "name": name, "error": errors.get(name, "")}
        out += runner.reply(name, RepartitionReply.from_body(body), now)
    return out


def test_a_failed_async_replica_still_resumes_every_flushed_stage() -> None:
    """The client paused its feed and every stage waits for a commit once flushed: a
    replica whose prepare fails must still send the commit (with the same cuts), or
    the next mini-batch would wait forever behind a paused pipeline."""
    failures: list[BaseException] = []
    runner, sent = _drive(_replica_owner({}), failures)
    assert _phases(sent) == [("a", "prepare"), ("b", "prepare")]
    after = _reply(runner, "prepare", 1.0, b="flush timed out")
    assert _phases(after) == [("a", "commit"), ("b", "commit")]
    _reply(runner, "commit", 2.0)
    assert isinstance(failures[0], PipelineError) and "flush timed out" in str(failures[0])


def test_the_coordinator_keeps_no_replica_a_recovery_could_not_resume_exactly() -> None:
    """A replica of a run without vertical sync (refused by the client, but a request may
    come from elsewhere) is refused at the coordinator too, and the paused stages
    still resume."""
    failures: list[BaseException] = []
    runner, sent = _drive(_replica_owner({"async": {"vertical_sync": False}}), failures)
    assert _phases(sent) == [("a", "commit"), ("b", "commit")]
    _reply(runner, "commit", 1.0)
    assert isinstance(failures[0], ConfigError) and "vertical sync" in str(failures[0])
