"""A live move (zpipe.coordinator.runs.async_repartition) is saved once committed: a
coordinator killed right after it takes the run over with the cuts the stages run,
not the ones it was planned with. Pure: the in-process coordinator, a real state
directory written whenever the core says so (as the shell does), no sockets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests._support.coordinator_harness import SPEC, Harness
from tests._support.saving_harness import SavingHarness
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


def _start(h: Harness) -> int:
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
        partition=[[0, 2], [2, 4], [4, 6]], recover=True,
    )  # fmt: skip
    run = h.core.run
    assert run is not None, h.events("run_failed")
    h.answer_all("ready", list(run.devices), run=run.run, build_s=0.01)
    h.client("run_go", run=run.run)
    h.answer_all("connected", list(run.devices), run=run.run)
    return run.run


def _phase(h: Harness, run: int, step: int, phase: str, metrics: dict[str, Any]) -> None:
    for name in "abc":
        asked = h.to(name, "repartition_request")
        assert asked and asked[-1].body["phase"] == phase, (name, phase)
        h.stage(name, "repartition_reply", run=run, step=step, phase=phase, error="",
                metrics=metrics.get(name, {}))  # fmt: skip


def test_a_committed_move_is_saved_and_a_restarted_coordinator_runs_its_cuts(
    tmp_path: Path,
) -> None:
    store = StateStore(tmp_path / "state")
    h = SavingHarness(store)
    h.state.measured_links = lambda members: SLOW_AB
    run = _start(h)
    planned = h.core.run.training_plan  # type: ignore[union-attr]
    assert planned is not None and [(s.start, s.end) for s in planned.stages] == [
        (0, 2), (2, 4), (4, 6)
    ]  # fmt: skip
    step = 10
    h.client("repartition", run=run, step=step)
    counters = {
        name: {"microbatches": 3 * step, "forward_s": 0.1 * step, "backward_s": 0.2 * step,
               "start": a, "end": b}
        for name, (a, b) in zip("abc", ((0, 2), (2, 4), (4, 6)), strict=True)
    }  # fmt: skip
    _phase(h, run, step, "prepare", counters)
    _phase(h, run, step, "fetch", {})
    _phase(h, run, step, "commit", {})
    (answer,) = h.to_client("repartitioned")
    assert answer.body["error"] == ""
    moved = answer.body["bounds"]
    assert moved != [0, 2, 4, 6], "the slow link should have moved the cut"
    # the coordinator is killed now: its successor reads the state file
    again = h.restarted()
    taken = again.core.run
    assert taken is not None and taken.training_plan is not None
    cuts = [taken.training_plan.stages[0].start, *(s.end for s in taken.training_plan.stages)]
    assert cuts == moved
