"""The newest global copy survives a coordinator restart (``global.state``).

Pure: a real state directory, the in-process coordinator (no sockets). Under chain
replication the latest replica holds here only the last stage's backup; after a
restart the global copy behind it must still serve two adjacent deaths.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._support.coordinator_harness import Harness
from tests._support.coordinator_restore import NAMES, _replicate, _request, _start_chain_run
from zpipe.coordinator import persistence
from zpipe.coordinator.commands import SaveReplica
from zpipe.coordinator.persistence import GLOBAL_FILE, REPLICA_FILE, StateStore
from zpipe.coordinator.records import SavedReplica
from zpipe.coordinator.restored_replica import replica_from_saved
from zpipe.coordinator.runs.sync_training import SyncTrainingController
from zpipe.planner.training_plan import TrainingPlan, TrainStage

PLAN = TrainingPlan(
    algo="straight",
    schedule="1f1b",
    num_units=4,
    microbatch_size=3,
    num_microbatches=3,
    stages=(TrainStage(("a",), 0, 2, (3,), 1), TrainStage(("b",), 2, 4, (3,), 1)),
)


class SavingHarness(Harness):
    """A coordinator whose replicas go to a real state directory."""

    def __init__(self, store: StateStore) -> None:
        super().__init__()
        self.store = store
        self.state.saves_replicas = True

    def _job(self, job: Any) -> Any:
        if isinstance(job, SaveReplica):
            return self.store.save_replica(job.replica)
        return super()._job(job)


def _saved(step: int, *, whole: bool, value: float, units: int = 4) -> SavedReplica:
    half = units // 2
    stages = (TrainStage(("a",), 0, half, (3,), 1), TrainStage(("b",), half, units, (3,), 1))
    plan = replace(PLAN, num_units=units, stages=stages)
    state = {"units.0.weight": torch.full((3,), value)} if whole else {}
    return SavedReplica(7, step, plan.to_dict(), state, {"a": "b", "b": "coordinator"}, whole)


def test_a_global_copy_keeps_its_file_when_a_chain_replica_follows(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.save_replica(_saved(0, whole=True, value=1.5))
    assert (tmp_path / GLOBAL_FILE).exists()
    store.save_replica(_saved(2, whole=False, value=0.0))
    latest, newest = store.load_replica(), store.load_global()
    assert latest is not None and newest is not None
    assert (latest.step, latest.complete, latest.state) == (2, False, {})
    assert (newest.step, newest.complete) == (0, True)
    assert torch.equal(newest.state["units.0.weight"], torch.full((3,), 1.5))
    # bounded: the two files and nothing left over from the writes
    assert sorted(os.listdir(tmp_path)) == sorted([GLOBAL_FILE, REPLICA_FILE])
    # the next global copy replaces it
    store.save_replica(_saved(4, whole=True, value=2.5))
    newest = store.load_global()
    assert newest is not None and newest.step == 4
    assert torch.equal(newest.state["units.0.weight"], torch.full((3,), 2.5))


def test_a_chain_replica_gets_the_global_copy_behind_it_as_its_fallback() -> None:
    latest, newest = _saved(2, whole=False, value=0.0), _saved(0, whole=True, value=1.5)
    replica = replica_from_saved(latest, newest)
    assert not replica.complete and replica.fallback is not None
    assert (replica.fallback.step, replica.fallback.complete) == (0, True)
    assert replica.newest_global() is replica.fallback
    # a replica that holds every unit is its own newest global copy
    whole = replica_from_saved(_saved(4, whole=True, value=2.5), newest)
    assert whole.fallback is None and whole.newest_global() is whole
    # a copy of another model, or one newer than the replica, is no fallback
    assert replica_from_saved(latest, _saved(0, whole=True, value=1.5, units=6)).fallback is None
    assert replica_from_saved(latest, _saved(4, whole=True, value=2.5)).fallback is None


def test_a_restarted_coordinator_falls_back_to_the_global_copy_after_two_adjacent_deaths(
    tmp_path: Path,
) -> None:
    store = StateStore(tmp_path)
    old = SavingHarness(store)
    run = _start_chain_run(old)
    _replicate(old, run, 0, global_copy=True)
    _replicate(old, run, 2, global_copy=False)
    saved = old.core.saved_state()
    # the old coordinator is gone; a new one reads the state directory
    new = SavingHarness(store)
    new.core.restore(saved, store.load_replica(), new.now, store.load_global())
    restored = new.state.replica
    assert restored is not None and restored.step == 2 and not restored.complete
    assert restored.fallback is not None and restored.fallback.step == 0
    controller = new.state.current
    assert isinstance(controller, SyncTrainingController)
    assert controller.fallback is restored.fallback
    for name in NAMES:
        new.stage(name, "heartbeat")
    new.advance(8.0, alive=("a",))  # b and c die: c held b's backup
    global_copy = {"run": run, "step": 0, "start_step": 0}
    _request(
        new, stage_names=["a"], replication="chain",
        resume={"run": run, "step": 2, "dead": ["b", "c"], "global": global_copy},
    )  # fmt: skip
    new.answer_all("ready", ["a"], run=run + 1, build_s=0.01)
    ready = new.to_client("run_ready")[-1]
    assert ready.body["resumed"] == {"run": run, "step": 0}
    assign = new.to("a", "assign")[-1]
    got = dict(zip(assign.body["state_keys"], assign.tensors, strict=True))
    # every unit at the global copy's step, from the file the old coordinator wrote
    assert {k: float(t[0]) for k, t in got.items()} == {f"units.{u}.weight": u for u in range(6)}
    assert new.events("restored_from_global")


def test_without_the_global_file_the_restarted_coordinator_loses_those_units(
    tmp_path: Path,
) -> None:
    store = StateStore(tmp_path)
    old = SavingHarness(store)
    run = _start_chain_run(old)
    _replicate(old, run, 0, global_copy=True)
    _replicate(old, run, 2, global_copy=False)
    saved = old.core.saved_state()
    (tmp_path / GLOBAL_FILE).unlink()  # as a coordinator from before global.state left it
    new = SavingHarness(store)
    new.core.restore(saved, store.load_replica(), new.now, store.load_global())
    assert new.state.replica is not None and new.state.replica.fallback is None
    new.advance(8.0, alive=("a",))
    _request(
        new, stage_names=["a"], replication="chain",
        resume={"run": run, "step": 2, "dead": ["b", "c"],
                "global": {"run": run, "step": 0, "start_step": 0}},
    )  # fmt: skip
    (failed,) = new.to_client("run_failed")
    assert "are lost" in failed.body["error"]


def test_without_hard_links_the_global_copy_is_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_links(*_: object) -> None:
        raise OSError("this file system has no hard links")

    monkeypatch.setattr(persistence.os, "link", no_links)
    store = StateStore(tmp_path)
    store.save_replica(_saved(0, whole=True, value=1.5))
    assert not os.path.samefile(store.replica_path, store.global_path)
    store.save_replica(_saved(2, whole=False, value=0.0))
    newest = store.load_global()
    assert newest is not None and newest.step == 0
    assert torch.equal(newest.state["units.0.weight"], torch.full((3,), 1.5))
