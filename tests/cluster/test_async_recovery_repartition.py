"""Recovery and live re-partitioning in one asynchronous run (FTPipeHD III-D to III-F).

The two share the run's flush points (:mod:`zpipe.training.async_recovery`): a look
that moves units is followed by a replica at the same flush, so a later death
restores the units on the cuts they moved to; a death during a re-partition's
phases ends the attempt with that death and the run recovers from the last
replica. The pure parts: the cuts a whole run went through, and the client's
handling of a re-partition a death broke. Then real stage processes on loopback
(the session's cluster of a, b and c that tests/cluster/test_async_recovery.py kills
too): runs that move units and lose a stage equal the single-process reference
of the cuts they went through, and the same run without either.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests._support.async_training import ADAM, SGD, SPEC, make_batches
from tests._support.training_recovery import _events
from zpipe._errors import PipelineError, StageFailedError
from zpipe.client.reports import TrainReport
from zpipe.client.runs.async_repartition import repartition_before
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.planner.async_schedule import (
    AsyncSettings,
    aggregation_intervals,
    async_stage_actions,
)
from zpipe.protocol.repartition import Repartition, Repartitioned
from zpipe.training.async_recovery import cuts_of_run
from zpipe.training.async_reference import train_async_reference
from zpipe.training.async_stage import AsyncStageCompute

NAMES = ["a", "b", "c"]
PARTITION = [[0, 1], [1, 3], [3, 4]]
START = [0, 1, 3, 4]


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for key, value in b.items():
        torch.testing.assert_close(a[key], value, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- the cuts of a run


def test_the_cuts_of_a_run_are_its_moves_and_its_recoveries_survivors() -> None:
    looks = [
        {"at": 2, "moved": True, "bounds": [0, 2, 3, 4]},
        {"at": 6, "moved": False, "bounds": [0, 2, 3, 4]},
        {"at": 9, "moved": True, "bounds": [0, 3, 4]},  # on the survivors
    ]
    recoveries = [{"resumed_from": 4, "bounds": [0, 2, 4]}]
    assert cuts_of_run(looks, recoveries) == {2: [0, 2, 3, 4], 4: [0, 2, 4], 9: [0, 3, 4]}
    # a recovery at the mini-batch of a move resumed from the move's replica: it wins
    assert cuts_of_run(looks[:1], [{"resumed_from": 2, "bounds": [0, 3, 4]}]) == {2: [0, 3, 4]}
    # a later recovery from an older (global) copy replaces the recoveries after it
    older = [*recoveries, {"resumed_from": 0, "bounds": [0, 4]}]
    assert cuts_of_run([], older) == {0: [0, 4]}
    assert cuts_of_run([{"at": 3, "moved": False, "bounds": [0, 4]}], []) == {}


def test_a_move_then_a_recovery_equals_the_run_without_either() -> None:
    batches = make_batches(8, 5, seed=13)
    plain = train_async_reference(SPEC, batches, bounds=START, optimizer=SGD)
    both = train_async_reference(
        SPEC, batches, bounds=START, optimizer=SGD, flushes=[4],
        repartitions={2: [0, 1, 2, 4], 5: [0, 2, 4]},
    )  # fmt: skip
    assert both.losses == pytest.approx(plain.losses, rel=1e-6)
    assert_same(both.state_dict, plain.state_dict)


# ---------------------------------------------------------------- aggregation after a recovery


def test_a_resumed_list_aggregates_on_the_runs_batches() -> None:
    # stage 0 of 3, every 3 backwards: AGG before B3 and B6 of the run
    whole = [str(a) for a in async_stage_actions(0, 3, 9, aggregate_every=3)]
    assert [whole[i + 1] for i, a in enumerate(whole) if a == "AGG"] == ["B3", "B6"]
    # the same stage resumed from a replica before batch 4 numbers its batches from 0
    resumed = [str(a) for a in async_stage_actions(0, 3, 5, aggregate_every=3, batches_before=4)]
    assert [resumed[i + 1] for i, a in enumerate(resumed) if a == "AGG"] == ["B2"]  # run's 6
    # two survivors of a run of depth 3 keep that depth's windows: 3 and 2, not 2 and none
    assert aggregation_intervals(2, aggregate=True, depth=3) == [3, 2]
    assert aggregation_intervals(2, aggregate=True) == [2, None]


def _aggregations(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """(units on the stage, the stage's updates, versions averaged) of every aggregation."""
    seen: list[tuple[int, int, int]] = []
    original = AsyncStageCompute.aggregate

    def recording(self: AsyncStageCompute, count: int) -> None:
        seen.append((len(self.units), self.updates, count))
        original(self, count)

    monkeypatch.setattr(AsyncStageCompute, "aggregate", recording)
    return seen


def test_a_recovered_run_aggregates_with_the_windows_of_its_depth(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = _aggregations(monkeypatch)
    batches = make_batches(12, 5, seed=23)
    settings = AsyncSettings(aggregate=True, depth=3)
    # three stages (1, 2 and 1 units) until a recovery before batch 5 onto two (2 and 2)
    recovered = train_async_reference(
        SPEC, batches, bounds=START, optimizer=SGD, settings=settings,
        repartitions={5: [0, 2, 4]},
    )  # fmt: skip
    before = [(u, t, c) for u, t, c in seen if t < 5]
    after = [(u, t, c) for u, t, c in seen if t >= 5]
    assert sorted(before) == [(1, 3, 3), (2, 2, 2), (2, 4, 2)]  # stage 0 every 3, 1 every 2
    # after it, still 3 versions every 3 backwards on the first stage and 2 every 2 on
    # the second (now the last), counted from the run's start
    assert sorted(after) == [(2, 6, 2), (2, 6, 3), (2, 8, 2), (2, 9, 3), (2, 10, 2)]
    # the windows differ from the uninterrupted run's (the last stage's units aggregate
    # now), so the result does too: the reference of the cuts is what a run must equal
    plain = train_async_reference(SPEC, batches, bounds=START, optimizer=SGD, settings=settings)
    assert recovered.losses[:6] == plain.losses[:6]
    assert recovered.losses != pytest.approx(plain.losses, rel=1e-6)


def test_train_check_replays_the_plan_a_recovered_run_started_on() -> None:
    from argparse import Namespace

    from zpipe.cli.train import _train_async_here
    from zpipe.planner.training_plan import TrainingPlan, TrainStage

    def plan(bounds: list[int], names: str) -> TrainingPlan:
        stages = tuple(
            TrainStage((d,), bounds[i], bounds[i + 1], (5,), len(names) - i)
            for i, d in enumerate(names)
        )
        return TrainingPlan(algo="straight", num_units=4, schedule="async-1f1b",
                            microbatch_size=5, num_microbatches=1, stages=stages)  # fmt: skip

    batches = make_batches(9, 5, seed=31)
    report = TrainReport(run=2, plan=None, model_spec=SPEC, schedule="async-1f1b",  # type: ignore[arg-type]
                         num_microbatches=1, training_plan=plan([0, 3, 4], "bc"),
                         first_training_plan=plan(START, "abc"))  # fmt: skip
    report.repartitions = [{"at": 2, "moved": True, "bounds": [0, 1, 2, 4]}]
    report.recoveries = [{"resumed_from": 4, "bounds": [0, 3, 4], "depth": 3}]
    args = Namespace(vertical_sync=True, aggregate=True, aggregate_multiple=1,
                     optimizer="sgd", lr=0.05, momentum=0.9, weight_decay=None,
                     loss="cross_entropy", lr_schedule=None, resume=None)  # fmt: skip
    checked = _train_async_here(SPEC, batches, report, args)
    settings = AsyncSettings(aggregate=True, depth=3)
    want = train_async_reference(SPEC, batches, bounds=START, optimizer=SGD, settings=settings,
                                 repartitions={2: [0, 1, 2, 4], 4: [0, 3, 4]})  # fmt: skip
    assert_same(checked, want.state_dict)
    # with aggregation the cuts matter: the survivors' plan from the start is another run
    other = train_async_reference(SPEC, batches, bounds=[0, 3, 4], optimizer=SGD,
                                  settings=settings)  # fmt: skip
    assert not all(torch.equal(checked[k], other.state_dict[k]) for k in checked)


# ---------------------------------------------------------------- a re-partition a death broke


def _attempt(failure: StageFailedError | None, *, recovers: bool = True) -> Any:
    """The parts of a client attempt :func:`repartition_before` reads, whose coordinator
    answers every look with an error (a stage of the run is gone)."""

    async def ask(request: Repartition, **_: Any) -> Repartitioned:
        assert request.step == 1  # this attempt's own count: it resumed at 6
        return Repartitioned(run=3, step=1, error="StageLostError: b")

    async def stage_failure_within(timeout_s: float) -> StageFailedError | None:
        return failure

    session = SimpleNamespace(
        control=SimpleNamespace(ask=ask), stage_failure_within=stage_failure_within
    )
    return SimpleNamespace(
        run=3, offset=6, session=session, replicate_every=4 if recovers else None,
        attempts=SimpleNamespace(recovers=recovers),
        timeouts=SimpleNamespace(result_s=5.0, reply_s=1.0),
        report=TrainReport(run=3, plan=None, model_spec=SPEC, schedule="async-1f1b",  # type: ignore[arg-type]
                           num_microbatches=1),
    )  # fmt: skip


def test_a_repartition_a_death_broke_ends_the_attempt_with_that_death() -> None:
    died = StageFailedError("b", "no heartbeat")
    with pytest.raises(StageFailedError) as raised:
        asyncio.run(repartition_before(_attempt(died), 7))
    assert raised.value is died  # the failure the session recovers from
    # no death reported: the re-partition's own error; without recovery, at once
    with pytest.raises(PipelineError, match="before mini-batch 7"):
        asyncio.run(repartition_before(_attempt(None), 7))
    with pytest.raises(PipelineError, match="before mini-batch 7"):
        asyncio.run(repartition_before(_attempt(died, recovers=False), 7))


# ---------------------------------------------------------------- a real pipeline


def _fit_killing(
    cluster: LocalCluster, batches: list[Any], victim: str, after: int, **settings: Any
) -> TrainReport:
    killed: list[str] = []

    def on_step(step: int, _loss: float) -> None:
        if step == after and not killed:
            killed.append(victim)
            cluster.kill(victim)

    try:
        return cluster.fit(
            SPEC, batches, num_microbatches=1, schedule="async-1f1b", progress=False,
            partition=PARTITION, stage_names=NAMES, recover=True, on_step=on_step,
            **settings,
        )  # fmt: skip
    finally:
        assert killed == [victim]
        restarted = cluster.start_stage(DeviceSpec(victim))
        members = cluster.wait_for_stages(len(NAMES), timeout_s=120)
        # the new process, not the killed one the coordinator may not have found dead yet
        assert {m["name"]: m["info"]["pid"] for m in members}[victim] == restarted.pid


def _reference_of(
    report: TrainReport, batches: list[Any], optimizer: dict, *, aggregate: bool = False
) -> Any:
    """The single-process run of the cuts ``report`` went through, at the run's depth."""
    assert report.first_training_plan is not None
    first = report.first_training_plan.stages
    return train_async_reference(
        SPEC,
        batches,
        bounds=[s.start for s in first] + [first[-1].end],
        optimizer=optimizer,
        settings=AsyncSettings(aggregate=aggregate, depth=int(report.recoveries[0]["depth"])),
        repartitions=cuts_of_run(report.repartitions, report.recoveries),
    )


def test_a_run_that_moved_units_and_then_lost_a_stage_recovers_exactly(
    async_recovery_cluster: LocalCluster,
) -> None:
    cluster = async_recovery_cluster
    batches = make_batches(10, 5, seed=17)
    since = len(cluster.logs("coordinator"))
    # replicas before 0, 4 and 8; the look before 2 moves units (the forced cuts), so a
    # replica follows it there; b dies after 5: the run resumes from 4, on the moved cuts
    report = _fit_killing(
        cluster, batches, "b", 5, optimizer=ADAM, replicate_every=4,
        repartition={"first": 2, "every": 100, "bounds": [0, 1, 2, 4]},
    )  # fmt: skip
    log = cluster.logs("coordinator")[since:]
    assert [e["step"] for e in _events(log, "replica_kept")][:3] == [0, 2, 4]
    moved = _events(log, "repartitioned")
    assert [(e["step"], e["bounds"]) for e in moved] == [(2, [0, 1, 2, 4])]
    (look,) = report.repartitions  # the resumed run did not look again
    assert (look["at"], look["moved"], look["held"]) == (
        2, True, {"a": [0, 1], "b": [1, 2], "c": [2, 4]},
    )  # fmt: skip
    (recovery,) = report.recoveries
    assert (recovery["dead"], recovery["resumed_from"], recovery["depth"]) == ("b", 4, 3)
    assert report.training_plan is not None and len(report.training_plan.stages) == 2
    assert recovery["bounds"][0] == 0 and len(recovery["bounds"]) == 3
    want = _reference_of(report, batches, ADAM)
    assert report.losses == pytest.approx(want.losses, rel=1e-6)
    assert_same(report.state_dict, want.state_dict)
    # vertical sync and the kept depth: the same as the run without either
    plain = train_async_reference(SPEC, batches, bounds=START, optimizer=ADAM)
    assert report.losses == pytest.approx(plain.losses, rel=1e-6)
    assert_same(report.state_dict, plain.state_dict)


def test_a_stage_that_dies_during_a_repartition_is_recovered_from_the_last_replica(
    async_recovery_cluster: LocalCluster,
) -> None:
    cluster = async_recovery_cluster
    batches = make_batches(9, 5, seed=19)
    since = len(cluster.logs("coordinator"))
    # chain replicas before 0 and 2 (a global copy before 0); the look before 3 moves
    # units (the forced cuts), and c is killed as the last loss before that pause
    # comes back: during the look or between it and the flush, never after the flush
    # (which waits for that loss). The survivors look at 3 and 6 at a gain no
    # measurement reaches, so they keep their cuts.
    report = _fit_killing(
        cluster, batches, "c", 2, optimizer=SGD, replication="chain", chain_every=2,
        global_every=4,
        repartition={"first": 3, "every": 3, "gain": 0.95, "bounds": [0, 2, 3, 4]},
    )  # fmt: skip
    log = cluster.logs("coordinator")[since:]
    assert _events(log, "repartitioned") == []  # the move never committed
    (recovery,) = report.recoveries
    assert (recovery["dead"], recovery["resumed_from"]) == ("c", 2)
    (planned,) = _events(log, "restore_planned")
    assert planned["from_coordinator"] > 0  # c's units came from its backup here
    # the survivors looked at 3 themselves (no forced cuts), and at 6
    assert [(r["at"], r["moved"]) for r in report.repartitions] == [(3, False), (6, False)]
    want = _reference_of(report, batches, SGD)
    assert report.losses == pytest.approx(want.losses, rel=1e-6)
    assert_same(report.state_dict, want.state_dict)
    plain = train_async_reference(SPEC, batches, bounds=START, optimizer=SGD)
    assert report.losses == pytest.approx(plain.losses, rel=1e-6)
    assert_same(report.state_dict, plain.state_dict)


def test_an_aggregating_run_that_moved_units_and_lost_its_first_stage_recovers_exactly(
    async_recovery_cluster: LocalCluster,
) -> None:
    cluster = async_recovery_cluster
    batches = make_batches(11, 5, seed=29)
    # as above, with weight aggregation (stage 0 every 3, stage 1 every 2), and the
    # first stage dies: after the recovery the survivors b and c are stages 0 and 1
    # of two, with the windows of depth 3 (3 and 2), the aggregations counted from
    # the run's start
    report = _fit_killing(
        cluster, batches, "a", 5, optimizer=ADAM, replicate_every=4, aggregate=True,
        repartition={"first": 2, "every": 100, "bounds": [0, 1, 2, 4]},
    )  # fmt: skip
    (recovery,) = report.recoveries
    assert (recovery["dead"], recovery["resumed_from"], recovery["depth"]) == ("a", 4, 3)
    assert report.training_plan is not None
    assert list(report.training_plan.devices) == ["b", "c"]
    assert [(r["at"], r["moved"]) for r in report.repartitions] == [(2, True)]
    want = _reference_of(report, batches, ADAM, aggregate=True)
    assert report.losses == pytest.approx(want.losses, rel=1e-6)
    assert_same(report.state_dict, want.state_dict)
    # the aggregations counted: the same run without them is another
    unaggregated = train_async_reference(
        SPEC, batches, bounds=START, optimizer=ADAM,
        repartitions=cuts_of_run(report.repartitions, report.recoveries),
    )  # fmt: skip
    assert report.losses != pytest.approx(unaggregated.losses, rel=1e-6)
