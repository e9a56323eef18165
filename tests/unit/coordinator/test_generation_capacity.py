"""A generation run within each stage's memory room (what it reported at registration,
less the coordinator's margin and the process's base, as for every run kind): refused
before any stage hears of it when its share does not fit, naming the stage and the MiB
it needs and has; without a partition, a split that fits."""

from __future__ import annotations

from typing import Any

import pytest

from tests._support.coordinator_harness import Harness
from zpipe._errors import InfeasiblePlanError
from zpipe.coordinator.generation_plan import (
    MIB,
    check_generation_capacity,
    generation_units,
    generation_workload,
)
from zpipe.coordinator.membership import Member
from zpipe.models import ModelSpec
from zpipe.models.causal_lm import read_causal_lm_config
from zpipe.planner.generation_cost import stage_memory
from zpipe.planner.memory import DEFAULT_MEMORY_MARGIN, DEFAULT_STAGE_BASE_BYTES, runtime_bytes
from zpipe.protocol.generation import GenSetup

SPEC = ModelSpec.preset("llama-tiny")  # 4 units, about 0.14 MiB for this run
CONFIG = read_causal_lm_config(SPEC.config)
LIMITS = {"max_context": 32, "max_sequences": 4, "steps_in_flight": 3, "chunk_tokens": 8}
UNITS = generation_units(CONFIG, element_bytes=4, max_context=32)
WORKLOAD = generation_workload(**LIMITS, kv_budget_bytes=None)


def _need_mib(start: int, end: int) -> float:
    return stage_memory(UNITS, start, end, WORKLOAD).total / MIB


# each stage's process before its model (these stages report none: the default)
BASE = DEFAULT_STAGE_BASE_BYTES


def _budget_mb(room_mib: float, margin: float = DEFAULT_MEMORY_MARGIN) -> float:
    """The --memory-mb that leaves ``room_mib`` for the model."""
    return (room_mib * MIB + BASE + runtime_bytes(False)) * (1 + margin) / MIB


def _info(room_mib: float) -> dict[str, Any]:
    return {"memory_mb": _budget_mb(room_mib)}


def _started(rooms: dict[str, float | None], **changes: Any) -> Harness:
    """A run over stages that give a model ``rooms`` MiB (None: no limit)."""
    h = Harness()
    for name, room in rooms.items():
        h.register(name, info={} if room is None else _info(room))
    h.client(
        "gen_run_request",
        model=SPEC.to_dict(),
        sink_endpoint="tcp://client:9",
        wait_for_stages_s=0.0,
        stage_names=list(rooms),
        **LIMITS,
        **changes,
    )
    return h


def _bounds(h: Harness, names: list[str]) -> list[tuple[int, int]]:
    setups = [GenSetup.from_message(h.to(name, "gen_setup")[0]) for name in names]
    return [(s.start, s.end) for s in setups]


def test_the_model_on_one_stage_too_small_is_refused_before_it_hears_of_the_run() -> None:
    whole = _need_mib(0, CONFIG.num_units)
    h = _started({"solo": whole * 0.7})
    assert not h.to("solo", "gen_setup")  # nothing to build: nothing loaded
    (failed,) = h.to_client("run_failed")
    error = failed.body["error"]
    assert "stage 'solo' needs" in error
    assert f"{whole:.2f} MiB" in error and f"{whole * 0.7:.2f} MiB for its model" in error
    assert "10% margin" in error and f"base of {BASE / MIB:.2f} MiB" in error
    assert f"the runtime's {runtime_bytes(False) / MIB:.2f} MiB" in error
    assert "weights" in error and "KV cache" in error and "working set" in error
    assert not h.events("generation_setup")


def test_two_stages_that_each_hold_less_than_the_model_run_it_split() -> None:
    whole = _need_mib(0, CONFIG.num_units)
    h = _started({"a": whole * 0.7, "b": whole * 0.7})
    bounds = _bounds(h, ["a", "b"])
    assert bounds[0][0] == 0 and bounds[-1][1] == CONFIG.num_units
    assert all(_need_mib(*b) <= whole * 0.7 for b in bounds)


def test_without_a_partition_the_split_that_fits_replaces_the_even_one() -> None:
    # the even split gives "a" two units, more than it holds; "a" holds the embedding
    small, large = _need_mib(0, 1) * 1.2, _need_mib(1, 4) * 1.05
    assert _need_mib(0, 2) > small and _need_mib(2, 4) <= large
    h = _started({"a": small, "b": large})
    assert _bounds(h, ["a", "b"]) == [(0, 1), (1, 4)]
    # the same split asked for explicitly is checked, and the even one refused by name
    assert _bounds(_started({"a": small, "b": large}, partition=[1, 3]), ["a", "b"]) == [
        (0, 1),
        (1, 4),
    ]
    h = _started({"a": small, "b": large}, partition=[2, 2])
    assert not h.to("a", "gen_setup") and not h.to("b", "gen_setup")
    (failed,) = h.to_client("run_failed")
    assert "stage 'a' needs" in failed.body["error"] and "[0, 2)" in failed.body["error"]


def test_stages_that_together_hold_too_little_are_refused_naming_one() -> None:
    whole = _need_mib(0, CONFIG.num_units)
    h = _started({"a": whole * 0.3, "b": whole * 0.3})
    assert not h.to("a", "gen_setup") and not h.to("b", "gen_setup")
    (failed,) = h.to_client("run_failed")
    assert "no split over the 2 stages fits" in failed.body["error"]
    assert "stage 'a' needs" in failed.body["error"]


def test_a_kv_budget_and_a_smaller_dtype_are_counted() -> None:
    whole = _need_mib(0, CONFIG.num_units)
    tight = whole * 0.9
    assert not _started({"solo": tight}).to("solo", "gen_setup")
    # half the bytes per weight and cache entry: the run fits one stage
    assert _started({"solo": tight}, dtype="bfloat16").to("solo", "gen_setup")
    # a cache budget well under S x context: so does it
    assert _started({"solo": tight}, kv_budget_bytes=1024).to("solo", "gen_setup")


def test_the_check_names_the_first_stage_short_and_leaves_unbounded_ones_alone() -> None:
    def member(name: str, info: dict[str, Any]) -> Member:
        return Member(name, b"r", f"tcp://{name}:1", info, None, 0.0, 0.0)

    members = [member("x", {}), member("y", {})]
    check_generation_capacity(UNITS, members, [(0, 2), (2, 4)], WORKLOAD)  # no budgets
    members[1] = member("y", _info(0.01))
    with pytest.raises(InfeasiblePlanError, match=r"stage 'y' needs .* 0\.01 MiB for its model"):
        check_generation_capacity(UNITS, members, [(0, 2), (2, 4)], WORKLOAD)


def test_the_margin_and_the_process_base_come_off_the_budget_as_for_every_run() -> None:
    # a --memory-mb that holds the model and the process's base, but not the margin: a
    # budget is the whole process's, and the same rule plans inference and training
    whole = _need_mib(0, CONFIG.num_units)
    no_margin = {"memory_mb": _budget_mb(whole * 1.01, margin=0.0)}
    h = Harness()
    h.register("solo", info=no_margin)
    h.client("gen_run_request", model=SPEC.to_dict(), sink_endpoint="tcp://client:9",
             wait_for_stages_s=0.0, stage_names=["solo"], **LIMITS)  # fmt: skip
    assert not h.to("solo", "gen_setup")
    (failed,) = h.to_client("run_failed")
    assert "stage 'solo' needs" in failed.body["error"]
    # the same budget with the margin allowed for runs
    assert _started({"solo": whole * 1.01}).to("solo", "gen_setup")
