"""A coordinator killed with SIGKILL and started again takes its run over from disk.

Real processes: the coordinator keeps the run and its latest global replica in a
state directory; the stages keep running their assignment while it is gone and
the client carries on. Training must end exactly as an uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._support.coordinator_restart import _cluster, _events
from tests._support.training import (
    SGD,
    SPEC,
    assert_same_weights,
    make_batches,
    train_single_process,
)
from zpipe.client import TrainReport
from zpipe.cluster import LocalCluster
from zpipe.coordinator.persistence import STATE_FILE, StateStore


def _train_restarting(
    cluster: LocalCluster,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    restart_after: int,
    also_kill: str | None = None,
    **fit: object,
) -> TrainReport:
    """Train; once mini-batch ``restart_after``'s loss is known, SIGKILL the coordinator
    (and ``also_kill`` while it is down) and start it again."""
    done = False

    def on_step(step: int, _loss: float) -> None:
        nonlocal done
        if step == restart_after and not done:
            done = True
            cluster.kill("coordinator")
            if also_kill is not None:
                cluster.kill(also_kill)
            cluster.restart_coordinator()

    return cluster.fit(
        SPEC,
        batches,
        optimizer=SGD,
        num_microbatches=3,
        progress=False,
        on_step=on_step,
        recover=True,
        **fit,
    )


def test_a_restarted_coordinator_takes_the_run_over_and_training_is_exact(
    tmp_path: Path,
) -> None:
    batches = make_batches(8, 9, seed=31)
    want, want_losses = train_single_process(SPEC, batches, SGD)
    with _cluster(["a", "b", "c"], tmp_path / "state") as cluster:
        report = _train_restarting(
            cluster,
            batches,
            # killed after mini-batch 2: mini-batch 3 trains with no coordinator at
            # all, and the replica before mini-batch 4 is asked of the new one
            restart_after=2,
            partition=[[0, 1], [1, 3], [3, 4]],
            stage_names=["a", "b", "c"],
            replicate_every=2,
        )
        log = cluster.logs("coordinator")
    assert report.losses == pytest.approx(want_losses, rel=1e-5)
    assert_same_weights(report.state_dict, want)
    # nothing was rolled back: the run went on where it was
    assert report.recoveries == []
    assert report.replicas == [0, 2, 4, 6]
    restored = _events(log, "coordinator_restored")
    assert len(restored) == 2  # at each start; the second one found the run
    assert restored[0]["run"] is None
    assert restored[1]["run"] is not None
    assert restored[1]["replica"] == {"run": restored[1]["run"], "step": 2}
    assert sorted(restored[1]["members"]) == ["a", "b", "c"]  # type: ignore[call-overload]
    # the replicas the new coordinator took were saved before the client heard of them
    kept = [(e["step"], e["saved"]) for e in _events(log, "replica_kept")]
    assert kept == [(0, True), (2, True), (4, True), (6, True)]
    saved = StateStore(tmp_path / "state").load_replica()
    assert saved is not None and saved.step == 6
    assert (tmp_path / "state" / STATE_FILE).exists()


def test_a_stage_lost_while_the_coordinator_was_down_is_recovered_from_the_disk_replica(
    tmp_path: Path,
) -> None:
    batches = make_batches(7, 9, seed=32)
    want, want_losses = train_single_process(SPEC, batches, SGD)
    with _cluster(["a", "b", "c"], tmp_path / "state") as cluster:
        report = _train_restarting(
            cluster,
            batches,
            restart_after=3,
            also_kill="b",
            partition=[[0, 1], [1, 3], [3, 4]],
            stage_names=["a", "b", "c"],
            replicate_every=3,
        )
        log = cluster.logs("coordinator")
    assert report.losses == pytest.approx(want_losses, rel=1e-5)
    assert_same_weights(report.state_dict, want)
    # the only replica of step 3 was the one the killed coordinator wrote to disk
    assert [(r["dead"], r["resumed_from"]) for r in report.recoveries] == [("b", 3)]
    assert _events(log, "coordinator_restored")[-1]["replica"]["step"] == 3  # type: ignore[index]
    dead = [e["stage"] for e in _events(log, "stage_dead")]
    assert dead == ["b"]  # restored as a member, silent, declared dead as any other
    assert report.training_plan is not None
    assert sorted(report.training_plan.devices) == ["a", "c"]


def test_stages_register_again_with_a_coordinator_restarted_without_state() -> None:
    spec_batches = make_batches(3, 9, seed=33)
    want, _ = train_single_process(SPEC, spec_batches, SGD)
    with _cluster(["a", "b"], None) as cluster:
        cluster.kill("coordinator")
        cluster.restart_coordinator()
        # the new coordinator knows nobody; the stages' heartbeats are answered with
        # register_again, and a new run is planned over them
        cluster.wait_for_stages(2, timeout_s=20)
        report = cluster.fit(
            SPEC,
            spec_batches,
            optimizer=SGD,
            num_microbatches=3,
            progress=False,
            partition=[[0, 2], [2, 4]],
        )
        stage_log = cluster.logs("a")
    assert_same_weights(report.state_dict, want)
    assert '"registering_again"' in stage_log
