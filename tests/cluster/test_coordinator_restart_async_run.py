"""An asynchronous 1F1B run whose coordinator is SIGKILLed mid-stream and started
again from its state directory goes on as one: the restarted coordinator takes the
next replicas at flush points, as the first one did, and the run ends exactly as
the single-process reference with the same flushes (zpipe.coordinator.takeover).

Real processes on loopback: the stages keep training while the coordinator is
away; the client carries on and asks the restarted one for the next replica.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._support.async_training import SGD, SPEC, make_batches
from tests._support.coordinator_restart import _cluster, _events
from zpipe.coordinator.persistence import StateStore
from zpipe.planner.training_plan import TrainingPlan
from zpipe.training.async_reference import train_async_reference

NAMES = ["a", "b", "c"]


def test_a_restarted_coordinator_takes_an_async_runs_replicas_at_its_flushes(
    tmp_path: Path,
) -> None:
    batches = make_batches(10, 5, seed=71)
    want = train_async_reference(
        SPEC, batches, bounds=[0, 1, 3, 4], optimizer=SGD, flushes=[3, 6, 9]
    )
    with _cluster(NAMES, tmp_path / "state") as cluster:
        done = False

        def on_step(step: int, _loss: float) -> None:
            nonlocal done
            if step == 4 and not done:  # after the replica before 3, before the one at 6
                done = True
                cluster.kill("coordinator")
                cluster.restart_coordinator()

        report = cluster.fit(
            SPEC, batches, optimizer=SGD, num_microbatches=1, schedule="async-1f1b",
            progress=False, partition=[[0, 1], [1, 3], [3, 4]], stage_names=NAMES,
            recover=True, replicate_every=3, on_step=on_step,
        )  # fmt: skip
        log = cluster.logs("coordinator")
    assert done
    assert report.recoveries == []  # nothing rolled back: the run went on
    assert report.replicas == [0, 3, 6, 9]
    assert report.losses == pytest.approx(want.losses, rel=1e-6)
    assert set(report.state_dict) == set(want.state_dict)
    for key, value in want.state_dict.items():
        torch.testing.assert_close(report.state_dict[key], value, rtol=1e-6, atol=1e-7)
    restored = _events(log, "coordinator_restored")[-1]
    assert restored["replica"]["step"] == 3  # type: ignore[index]
    # the restarted coordinator flushed the stages for its replicas (prepare, commit)
    kept = [e["step"] for e in _events(log, "replica_kept")]
    assert kept == [0, 3, 6, 9]
    assert not _events(log, "async_replica_not_kept")


def test_a_coordinator_restarted_after_a_live_move_takes_the_run_over_on_the_moved_cuts(
    tmp_path: Path,
) -> None:
    """The look before 2 moves units (the forced cuts) and a replica follows there; the
    coordinator is killed after 3. The restarted one must know the moved cuts to take
    the replicas before 4 and 8 (each stage's snapshot of the units it now runs)."""
    batches = make_batches(10, 5, seed=73)
    plain = train_async_reference(SPEC, batches, bounds=[0, 1, 3, 4], optimizer=SGD)
    with _cluster(NAMES, tmp_path / "state") as cluster:
        done = False

        def on_step(step: int, _loss: float) -> None:
            nonlocal done
            if step == 3 and not done:
                done = True
                cluster.kill("coordinator")
                cluster.restart_coordinator()

        report = cluster.fit(
            SPEC, batches, optimizer=SGD, num_microbatches=1, schedule="async-1f1b",
            progress=False, partition=[[0, 1], [1, 3], [3, 4]], stage_names=NAMES,
            recover=True, replicate_every=4, on_step=on_step,
            repartition={"first": 2, "every": 100, "bounds": [0, 1, 2, 4]},
        )  # fmt: skip
        log = cluster.logs("coordinator")
    assert done
    moved = _events(log, "repartitioned")
    assert [(e["step"], e["bounds"]) for e in moved] == [(2, [0, 1, 2, 4])]
    restored = _events(log, "coordinator_restored")[-1]
    assert restored["replica"]["step"] == 2  # type: ignore[index]
    assert [e["step"] for e in _events(log, "replica_kept")] == [0, 2, 4, 8]
    assert not _events(log, "async_replica_not_kept")
    assert report.recoveries == []
    # the restarted coordinator's replicas are of the moved cuts
    last = StateStore(tmp_path / "state").load_replica()
    assert last is not None and last.step == 8
    cuts = TrainingPlan.from_dict(last.plan).stages
    assert [(s.start, s.end) for s in cuts] == [(0, 1), (1, 2), (2, 4)]
    # vertical sync: moves and flushes change nothing
    assert report.losses == pytest.approx(plain.losses, rel=1e-6)
    for key, value in plain.state_dict.items():
        torch.testing.assert_close(report.state_dict[key], value, rtol=1e-6, atol=1e-7)
