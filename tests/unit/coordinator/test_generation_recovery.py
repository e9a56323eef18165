"""A generation run's recovery, fed to the coordinator's core: a stage's death
re-plans the survivors (the units cut evenly, in their order) under a new epoch,
every survivor is set up again, and the client hears where to go on."""

from __future__ import annotations

from typing import Any

import pytest

from tests._support.coordinator_harness import Harness
from zpipe.coordinator.current_run import Run
from zpipe.coordinator.runs.generation_recovery import GenerationController
from zpipe.coordinator.takeover import controller_for
from zpipe.models import ModelSpec
from zpipe.models.causal_lm import read_causal_lm_config
from zpipe.planner.plan import Plan, StagePlan, even_ranges
from zpipe.protocol.client_control import RunReplanned, StageFailed
from zpipe.protocol.generation import GenReady, GenSetup
from zpipe.recovery.errors import RecoveryError
from zpipe.recovery.generation import GENERATION_ALGO, replan_generation

SPEC = ModelSpec.preset("llama-tiny")
UNITS = read_causal_lm_config(SPEC.config).num_units
NAMES = ["a", "b", "c", "d"]


def _ready(h: Harness, name: str, setup: GenSetup, error: str = "") -> None:
    reply = GenReady(run=setup.run, name=name, error=error, epoch=setup.epoch)
    h.feed_message(name, reply.to_message())  # type: ignore[attr-defined]


def _setups(h: Harness, names: list[str]) -> list[GenSetup]:
    """The latest gen_setup each of ``names`` got."""
    return [GenSetup.from_message(h.to(name, "gen_setup")[-1]) for name in names]


def _running(names: list[str] = NAMES, **changes: Any) -> Harness:
    """A generation run set up over ``names`` (stages heartbeating until now)."""
    h = Harness()
    for name in names:
        h.register(name)
    body = {
        "model": SPEC.to_dict(),
        "sink_endpoint": "tcp://client:9",
        "max_context": 32,
        "max_sequences": 4,
        "steps_in_flight": 3,
        "chunk_tokens": 8,
        "wait_for_stages_s": 0.0,
        "stage_names": names,
        **changes,
    }
    h.client("gen_run_request", **body)
    for name, setup in zip(names, _setups(h, names), strict=True):
        _ready(h, name, setup)
    assert h.to_client("gen_run_ready")
    assert isinstance(h.state.current, GenerationController)
    return h


def _kill(h: Harness, dead: str, names: list[str] = NAMES) -> None:
    """Let ``dead`` fall silent until the failure detector declares it dead."""
    alive = tuple(n for n in names if n != dead)
    h.advance(8.0, alive=alive)
    assert h.events("stage_dead")[-1]["stage"] == dead


def _notices(h: Harness, kind: type[Any]) -> list[Any]:
    return [kind.from_message(m) for m in h.to_client(kind.KIND)]


def test_a_dead_middle_stage_is_replanned_over_the_survivors_under_a_new_epoch() -> None:
    h = _running()
    (old,) = _setups(h, ["a"])
    _kill(h, "b")
    survivors = ["a", "c", "d"]
    setups = _setups(h, survivors)
    assert [(s.start, s.end) for s in setups] == even_ranges(UNITS, 3)
    assert {s.epoch for s in setups} == {setups[0].epoch} and setups[0].epoch > old.epoch
    assert {s.run for s in setups} == {old.run}  # the same run goes on
    # the ring closes over the survivors; only the first streams to the client
    assert [s.upstream for s in setups] == ["d", "a", "c"]
    assert [s.downstream for s in setups] == ["c", "d", "a"]
    assert [s.sink_endpoint for s in setups] == ["tcp://client:9", None, None]
    assert len(h.to("b", "gen_setup")) == 1  # the dead stage hears nothing more
    assert not _notices(h, RunReplanned)  # not before every survivor is built
    for name, setup in zip(survivors, setups, strict=True):
        _ready(h, name, setup)
    (notice,) = _notices(h, RunReplanned)
    assert notice.run == old.run and notice.epoch == setups[0].epoch
    assert notice.dead == "b" and notice.first_stage == "a"
    assert notice.first_endpoint == "tcp://a:1" and notice.last_stage == "d"
    assert Plan.from_dict(notice.plan).devices == survivors
    assert h.events("run_recovered")[-1]["policy"] == "generation"
    assert not _notices(h, StageFailed)


def test_when_the_first_stage_dies_the_next_one_takes_the_clients_sequences() -> None:
    h = _running(["a", "b", "c"])
    _kill(h, "a", ["a", "b", "c"])
    setups = _setups(h, ["b", "c"])
    assert [s.index for s in setups] == [0, 1]
    assert setups[0].sink_endpoint == "tcp://client:9" and setups[1].sink_endpoint is None
    for name, setup in zip(["b", "c"], setups, strict=True):
        _ready(h, name, setup)
    (notice,) = _notices(h, RunReplanned)
    assert notice.first_stage == "b" and notice.first_endpoint == "tcp://b:1"


def test_a_late_ready_of_an_earlier_set_up_does_not_count() -> None:
    h = _running()
    (first_setup,) = _setups(h, ["a"])
    _kill(h, "b")
    setups = _setups(h, ["a", "c", "d"])
    _ready(h, "a", first_setup)  # the run's first set-up, answered late
    for name, setup in zip(["c", "d"], setups[1:], strict=True):
        _ready(h, name, setup)
    assert not _notices(h, RunReplanned)  # a is not built for the new epoch yet
    _ready(h, "a", setups[0])
    assert len(_notices(h, RunReplanned)) == 1


def test_a_survivor_that_dies_during_the_recovery_is_planned_around_too() -> None:
    h = _running()
    _kill(h, "b")
    setups = _setups(h, ["a", "c", "d"])
    _ready(h, "a", setups[0])
    _ready(h, "d", setups[2])
    # c dies before it is built: plan again over a and d
    h.advance(8.0, alive=("a", "d"))
    assert h.events("stage_dead")[-1]["stage"] == "c"
    again = _setups(h, ["a", "d"])
    assert [(s.start, s.end) for s in again] == even_ranges(UNITS, 2)
    assert again[0].epoch > setups[0].epoch
    assert not _notices(h, RunReplanned)
    for name, setup in zip(["a", "d"], again, strict=True):
        _ready(h, name, setup)
    (notice,) = _notices(h, RunReplanned)
    assert Plan.from_dict(notice.plan).devices == ["a", "d"] and notice.dead == "b"


def test_a_survivor_that_dies_after_it_was_built_is_planned_around_too() -> None:
    h = _running()
    _kill(h, "b")
    setups = _setups(h, ["a", "c", "d"])
    _ready(h, "c", setups[1])
    h.advance(8.0, alive=("a", "d"))  # c answered, then died
    assert h.events("stage_dead")[-1]["stage"] == "c"
    _ready(h, "a", setups[0])
    _ready(h, "d", setups[2])
    assert not _notices(h, RunReplanned)  # the plan that holds c is over
    again = _setups(h, ["a", "d"])
    assert again[0].epoch > setups[0].epoch
    for name, setup in zip(["a", "d"], again, strict=True):
        _ready(h, name, setup)
    (notice,) = _notices(h, RunReplanned)
    assert Plan.from_dict(notice.plan).devices == ["a", "d"]


def test_a_survivor_that_refuses_ends_the_run_with_stage_failed() -> None:
    h = _running()
    _kill(h, "b")
    setups = _setups(h, ["a", "c", "d"])
    _ready(h, "a", setups[0])
    _ready(h, "c", setups[1], error="KvCacheFullError: no room")
    _ready(h, "d", setups[2])
    (failed,) = _notices(h, StageFailed)
    assert failed.stage == "b" and "no room" in failed.reason
    assert not _notices(h, RunReplanned)


def test_the_last_stage_left_dying_ends_the_run_with_stage_failed() -> None:
    h = _running(["a"])
    _kill(h, "a", ["a"])
    (failed,) = _notices(h, StageFailed)
    assert failed.stage == "a" and "no stage is left" in failed.reason


def test_a_run_the_client_ended_is_not_recovered() -> None:
    h = _running()
    run = h.state.current.run.run
    h.client("run_end", run=run)
    (report,) = h.to_client("run_report")
    assert report.body["run"] == run
    assert h.state.current is None
    _kill(h, "b")
    assert [len(h.to(name, "gen_setup")) for name in NAMES] == [1, 1, 1, 1]


def test_replan_keeps_the_survivors_order_and_cuts_the_units_evenly() -> None:
    plan = Plan(
        GENERATION_ALGO, 7, (StagePlan("x", 0, 1), StagePlan("y", 1, 5), StagePlan("z", 5, 7))
    )
    got = replan_generation(plan, {"y"})
    assert [(s.device, s.start, s.end) for s in got.stages] == [("x", 0, 4), ("z", 4, 7)]
    assert got.algo == GENERATION_ALGO
    assert replan_generation(plan, {"x", "other"}).devices == ["y", "z"]
    with pytest.raises(RecoveryError, match="no stage is left"):
        replan_generation(plan, {"x", "y", "z"})


def test_a_restarted_coordinator_does_not_take_a_generation_run_over() -> None:
    h = _running()
    saved = h.state.current.run.to_saved()
    assert controller_for(h.state, Run.from_saved(saved)) is None
