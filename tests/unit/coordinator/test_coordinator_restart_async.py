"""An asynchronous training run taken over by a restarted coordinator is run as one
(zpipe.coordinator.takeover): its next replica is taken at a flush point, as the
first coordinator took them. Pure: the in-process coordinator and a real state
directory, no sockets."""

from __future__ import annotations

from pathlib import Path

from tests._support.coordinator_harness import SPEC, Harness
from zpipe.coordinator.persistence import StateStore
from zpipe.coordinator.runs.async_training import AsyncTrainingController
from zpipe.coordinator.runs.sync_training import SyncTrainingController

NAMES = ["a", "b", "c"]
PARTITION = [[0, 2], [2, 4], [4, 6]]


def _start(h: Harness, schedule: str) -> int:
    for name in NAMES:
        h.register(name)
    train = {"schedule": schedule, "num_microbatches": 1, "optimizer": {"name": "sgd", "lr": 0.1}}
    h.client(
        "run_request", model=SPEC.to_dict(), dtype="float32", sink_endpoint="tcp://client:9",
        wait_for_stages_s=0.0, mode="train", train=train, stage_names=NAMES,
        partition=PARTITION, planner="straight", recover=True,
    )  # fmt: skip
    run = h.core.run
    assert run is not None, h.events("run_failed")
    h.answer_all("ready", list(run.devices), run=run.run, build_s=0.01)
    h.client("run_go", run=run.run)
    h.answer_all("connected", list(run.devices), run=run.run)
    return run.run


def _restarted(h: Harness, store: StateStore) -> Harness:
    store.save_state(h.core.saved_state())
    again = Harness()
    again.core.restore(store.load_state(), None, again.now)
    return again


def test_a_restored_asynchronous_run_keeps_its_controller_and_flushes_for_a_replica(
    tmp_path: Path,
) -> None:
    h = Harness()
    run = _start(h, "async-1f1b")
    assert type(h.state.current) is AsyncTrainingController
    again = _restarted(h, StateStore(tmp_path / "state"))
    assert type(again.state.current) is AsyncTrainingController
    # the client's next replica: every stage is asked to flush and keep a snapshot
    # first (a synchronous run's controller would ask for live weights, and the
    # paused stages would never be told to go on)
    again.client("replicate", run=run, step=4)
    for name in NAMES:
        asked = [m.kind for m in (s.wire for s in again.sent if s.peer == name)]
        assert asked[:1] == ["repartition_request"], (name, asked)
        assert again.to(name, "repartition_request")[0].body["phase"] == "prepare"
        assert again.to(name, "weights_request") == []


def test_a_restored_synchronous_run_stays_synchronous(tmp_path: Path) -> None:
    h = Harness()
    _start(h, "1f1b")
    again = _restarted(h, StateStore(tmp_path / "state"))
    assert type(again.state.current) is SyncTrainingController
