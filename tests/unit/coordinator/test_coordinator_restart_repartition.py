"""A live re-partition's controller goes on where it was after a coordinator restart.

Issue 33 item 4 (closing notes of session 39, "Left"): a restarted coordinator
built the run's re-partition controller afresh, at plan epoch 0 (the next commit
was numbered 1 again, and the settings' first cuts were forced once more), and
forgot a look's move the client had paused for (it looked anew at the flush,
from counters that no longer covered that look's window). Both are saved with the
run now. Pure: the in-process coordinator, a real state directory written
whenever the core says so, no sockets.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from tests._support.coordinator_harness import SPEC, Harness
from tests._support.saving_harness import SavingHarness
from zpipe._errors import StateFileError
from zpipe.coordinator.persistence import StateStore
from zpipe.planner import ClusterLink
from zpipe.planner.profile import synthetic_profile
from zpipe.training.repartition import RepartitionSettings

SETTINGS = RepartitionSettings(first=1, every=1, gain=0.1)
OUTPUTS = [1_000, 4_000_000, 1_000, 1_000, 1_000, 1_000]  # unit 1 crosses the cut at 2
PROFILE = synthetic_profile(
    [0.05] * 6, OUTPUTS, param_bytes=[100] * 6, backward_times_s=[0.1] * 6,
    activation_bytes=[10] * 6,
)  # fmt: skip
# a-b at 80 Mbit/s: 2 x 4 MB over it costs more than moving the cut off it
SLOW_AB = {(x, y): ClusterLink(80.0 if {x, y} == {"a", "b"} else 8_000.0)
           for x in "abc" for y in "abc" if x != y}  # fmt: skip
PLANNED = ((0, 2), (2, 4), (4, 6))


def _start(h: Harness) -> int:
    h.state.measured_links = lambda members: SLOW_AB  # type: ignore[method-assign]
    for name in "abc":
        h.register(name)
        member = h.state.membership.get(name)
        assert member is not None
        h.state.profiles.put(SPEC, 1, "float32", member, PROFILE, train=True)
    train = {"num_microbatches": 3, "optimizer": {"name": "sgd", "lr": 0.1},
             "repartition": SETTINGS.to_dict()}  # fmt: skip
    h.client(
        "run_request", model=SPEC.to_dict(), dtype="float32", sink_endpoint="tcp://client:9",
        wait_for_stages_s=0.0, mode="train", stage_names=list("abc"), train=train,
        partition=[list(p) for p in PLANNED], recover=True,
    )  # fmt: skip
    run = h.core.run
    assert run is not None, h.events("run_failed")
    h.answer_all("ready", list(run.devices), run=run.run, build_s=0.01)
    h.client("run_go", run=run.run)
    h.answer_all("connected", list(run.devices), run=run.run)
    return run.run


def _counters(step: int, spans: Any = PLANNED, slow: float = 1.0) -> dict[str, Any]:
    """Each stage's cumulative counters after ``step`` mini-batches (``a`` ``slow``
    times slower than the others)."""
    return {
        name: {"microbatches": 3 * step, "forward_s": 0.1 * step * (slow if name == "a" else 1),
               "backward_s": 0.2 * step * (slow if name == "a" else 1), "start": a, "end": b}
        for name, (a, b) in zip("abc", spans, strict=True)
    }  # fmt: skip


def _answer_phases(h: Harness, run: int, step: int, counters: dict[str, Any]) -> None:
    """Answer whatever phase each stage was asked last, until none is left."""
    answered = 0
    while True:
        asked = h.to("a", "repartition_request")
        if len(asked) == answered:
            return
        answered = len(asked)
        phase = asked[-1].body["phase"]
        for name in "abc":
            metrics = counters.get(name, {}) if phase in ("prepare", "profile") else {}
            h.stage(name, "repartition_reply", run=run, step=step, phase=phase, error="",
                    metrics=metrics)  # fmt: skip


def test_a_restarted_coordinator_numbers_commits_on_from_the_saved_plan_epoch(
    tmp_path: Path,
) -> None:
    h = SavingHarness(StateStore(tmp_path / "state"))
    run = _start(h)
    h.client("repartition", run=run, step=10)
    _answer_phases(h, run, 10, _counters(10))
    (first,) = h.to_client("repartitioned")
    assert first.body["error"] == "" and first.body["plan_epoch"] == 1  # moved
    moved = first.body["bounds"]
    again = h.restarted()
    again.state.measured_links = lambda members: SLOW_AB  # type: ignore[method-assign]
    again.client("repartition", run=run, step=20)
    spans = list(pairwise(moved))
    _answer_phases(again, run, 20, _counters(20, spans))
    (second,) = again.to_client("repartitioned")
    assert second.body["error"] == ""
    moved_again = second.body["bounds"] != moved
    # the restarted controller went on from epoch 1: its commit is 2, a stay stays 1
    assert second.body["plan_epoch"] == (2 if moved_again else 1)


def test_a_looks_move_the_client_paused_for_is_carried_out_after_a_restart(
    tmp_path: Path,
) -> None:
    h = SavingHarness(StateStore(tmp_path / "state"))
    run = _start(h)
    h.client("repartition", run=run, step=10, look=True)
    _answer_phases(h, run, 10, _counters(10))
    (look,) = h.to_client("repartitioned")
    assert look.body["pause"] is True  # the cuts move: the client pauses the feed
    decided = look.body["decision"]
    # killed now; the client paused and asks its successor to carry the move out
    again = h.restarted()
    again.state.measured_links = lambda members: SLOW_AB  # type: ignore[method-assign]
    again.client("repartition", run=run, step=10)
    # the counters at the flush (a slowed down since): a fresh look would decide anew
    _answer_phases(again, run, 10, _counters(10, slow=40.0))
    (done,) = again.to_client("repartitioned")
    assert done.body["error"] == ""
    assert done.body["bounds"] == decided["bounds"] and done.body["plan_epoch"] == 1
    assert done.body["decision"]["at"] == decided["at"] == 10
    assert done.body["decision"]["period_s"] == decided["period_s"]


def test_a_damaged_pending_move_stops_the_restart_with_a_state_file_error(
    tmp_path: Path,
) -> None:
    h = SavingHarness(StateStore(tmp_path / "state"))
    run = _start(h)
    h.client("repartition", run=run, step=10, look=True)
    _answer_phases(h, run, 10, _counters(10))
    saved = h.store.load_state()
    assert saved is not None and saved.run is not None
    assert saved.run["repartition"]["pending"]["at"] == 10
    damaged = dict(saved.run)
    damaged["repartition"] = {"plan_epoch": 0, "pending": {"bounds": [0, 1, 6]}}  # no "at"
    again = SavingHarness(h.store)
    with pytest.raises(StateFileError, match="saved run"):
        again.core.restore(replace(saved, run=damaged), None, again.now)
