"""A generation run's recovery, fed to the coordinator's core: a stage's death
re-plans the survivors (in their order; the units split within each one's memory
room when they reported budgets, else cut evenly) under a new epoch, every survivor
is set up again, and the client hears where to go on; survivors that cannot hold
the model end the run before any of them hears of a new set-up."""

from __future__ import annotations

from typing import Any

import pytest

from tests._support.coordinator_harness import Harness
from zpipe._errors import ConfigError
from zpipe.coordinator.current_run import Run
from zpipe.coordinator.generation_plan import MIB, generation_units, generation_workload
from zpipe.coordinator.runs.generation_recovery import GenerationController
from zpipe.coordinator.takeover import controller_for
from zpipe.models import ModelSpec
from zpipe.models.causal_lm import read_causal_lm_config
from zpipe.planner.generation_cost import stage_memory
from zpipe.planner.memory import DEFAULT_MEMORY_MARGIN, DEFAULT_STAGE_BASE_BYTES, runtime_bytes
from zpipe.planner.plan import Plan, StagePlan, even_ranges
from zpipe.protocol.client_control import RunReplanned, StageFailed
from zpipe.protocol.generation import GenReady, GenSetup
from zpipe.recovery.errors import RecoveryError
from zpipe.recovery.generation import GENERATION_ALGO, replan_generation

SPEC = ModelSpec.preset("llama-tiny")
UNITS = read_causal_lm_config(SPEC.config).num_units
NAMES = ["a", "b", "c", "d"]
LIMITS = {"max_context": 32, "max_sequences": 4, "steps_in_flight": 3, "chunk_tokens": 8}
WORKLOAD = generation_workload(**LIMITS, kv_budget_bytes=None)
SIZES = generation_units(read_causal_lm_config(SPEC.config), element_bytes=4, max_context=32)


def _need_mib(start: int, end: int) -> float:
    """What holding units [start, end) costs a stage in this run."""
    return stage_memory(SIZES, start, end, WORKLOAD).total / MIB


def _budget(room_mib: float) -> dict[str, Any]:
    """The info of a stage that gives a model ``room_mib`` MiB (its --memory-mb less
    the default margin, the default process base and the runtime's allowance)."""
    base = DEFAULT_STAGE_BASE_BYTES + runtime_bytes(False)
    return {"memory_mb": (room_mib * MIB + base) * (1 + DEFAULT_MEMORY_MARGIN) / MIB}


def _ready(h: Harness, name: str, setup: GenSetup, error: str = "") -> None:
    reply = GenReady(run=setup.run, name=name, error=error, epoch=setup.epoch)
    h.feed_message(name, reply.to_message())  # type: ignore[attr-defined]


def _setups(h: Harness, names: list[str]) -> list[GenSetup]:
    """The latest gen_setup each of ``names`` got."""
    return [GenSetup.from_message(h.to(name, "gen_setup")[-1]) for name in names]


def _running(
    names: list[str] = NAMES, infos: dict[str, dict[str, Any]] | None = None, **changes: Any
) -> Harness:
    """A generation run set up over ``names`` (stages heartbeating until now), each
    registered with its ``infos`` entry (none: no memory budget)."""
    h = Harness()
    for name in names:
        h.register(name, info=(infos or {}).get(name))
    body = {
        "model": SPEC.to_dict(),
        "sink_endpoint": "tcp://client:9",
        **LIMITS,
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


def test_survivors_with_budgets_get_a_split_that_fits_their_rooms() -> None:
    # "a" holds the embedding and little more, "c" two blocks: the even cut over
    # a, c, d gives "a" the embedding and a block, more than its room
    rooms = {
        "a": _need_mib(0, 1) * 1.2,
        "b": _need_mib(1, 2) * 1.2,
        "c": _need_mib(1, 3) * 1.05,
        "d": _need_mib(3, 4) * 1.2,
    }
    assert UNITS == 4 and even_ranges(UNITS, 3)[0] == (0, 2) and _need_mib(0, 2) > rooms["a"]
    h = _running(infos={name: _budget(room) for name, room in rooms.items()})
    _kill(h, "b")
    survivors = ["a", "c", "d"]
    setups = _setups(h, survivors)
    bounds = [(s.start, s.end) for s in setups]
    assert bounds == [(0, 1), (1, 3), (3, 4)] != even_ranges(UNITS, 3)
    assert all(_need_mib(*b) <= rooms[n] for n, b in zip(survivors, bounds, strict=True))
    for name, setup in zip(survivors, setups, strict=True):
        _ready(h, name, setup)
    (notice,) = _notices(h, RunReplanned)
    got = Plan.from_dict(notice.plan)
    assert [(s.device, s.start, s.end) for s in got.stages] == [
        ("a", 0, 1), ("c", 1, 3), ("d", 3, 4)
    ]  # fmt: skip
    assert not _notices(h, StageFailed)


def test_survivors_that_cannot_hold_the_model_end_the_run_before_any_set_up() -> None:
    # each stage holds its own unit and a tenth more: three of them cannot hold four
    rooms = {name: _need_mib(k, k + 1) * 1.1 for k, name in enumerate(NAMES)}
    h = _running(infos={name: _budget(room) for name, room in rooms.items()})
    _kill(h, "b")
    # no survivor hears of a new set-up: none loads units it cannot hold
    assert [len(h.to(name, "gen_setup")) for name in NAMES] == [1, 1, 1, 1]
    (failed,) = _notices(h, StageFailed)
    assert failed.stage == "b"
    assert "no split over the 3 stages fits" in failed.reason
    assert "stage 'a' needs" in failed.reason and "MiB for its model" in failed.reason
    assert h.events("recovery_failed") and not h.events("run_recovered")
    assert not _notices(h, RunReplanned)


def test_survivors_without_budgets_get_the_even_cut() -> None:
    # a slow "a" would make the planner give it less; without a budget known the
    # re-plan is the even cut, as it was before budgets were checked
    h = _running(infos={"a": {"slowdown": 10.0}})
    _kill(h, "b")
    setups = _setups(h, ["a", "c", "d"])
    assert [(s.start, s.end) for s in setups] == even_ranges(UNITS, 3) == [(0, 2), (2, 3), (3, 4)]


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


def test_replan_takes_the_split_it_is_given_and_the_even_cut_without_one() -> None:
    plan = Plan(
        GENERATION_ALGO, 7, (StagePlan("x", 0, 1), StagePlan("y", 1, 5), StagePlan("z", 5, 7))
    )
    asked: list[list[str]] = []

    def split(survivors: Any) -> list[tuple[int, int]] | None:
        asked.append(list(survivors))
        return [(0, 6), (6, 7)]

    got = replan_generation(plan, {"y"}, split)
    assert asked == [["x", "z"]]
    assert [(s.device, s.start, s.end) for s in got.stages] == [("x", 0, 6), ("z", 6, 7)]
    got = replan_generation(plan, {"y"}, lambda survivors: None)
    assert [(s.start, s.end) for s in got.stages] == [(0, 4), (4, 7)]
    with pytest.raises(ConfigError):  # a split that loses a unit is no plan
        replan_generation(plan, {"y"}, lambda survivors: [(0, 3), (4, 7)])


def test_a_restarted_coordinator_does_not_take_a_generation_run_over() -> None:
    h = _running()
    saved = h.state.current.run.to_saved()
    assert controller_for(h.state, Run.from_saved(saved)) is None
