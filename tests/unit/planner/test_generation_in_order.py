"""Planning a generation run over stages it named: every device, in order, the best split
that fits (brute force over every split), and a KV budget capping a stage's cache."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zpipe._errors import InfeasiblePlanError
from zpipe.planner import ClusterDevice, ClusterSpec, Plan, StagePlan
from zpipe.planner.generation import plan_generation_in_order
from zpipe.planner.generation_cost import (
    GenerationUnit,
    GenerationWorkload,
    predict_generation,
    stage_memory,
)

RTOL = 1e-9


def _objective(pred: dict[str, float]) -> float:
    return max(pred["ring_s"], pred["groups"] * pred["bottleneck_s"])


def _best_split(
    units: list[GenerationUnit], cluster: ClusterSpec, workload: GenerationWorkload
) -> float | None:
    """The least ``J`` over every split of the units over all the devices, in order."""
    n, names = len(units), cluster.names
    best = None
    for cuts in itertools.combinations(range(1, n), len(names) - 1):
        bounds = (0, *cuts, n)
        stages = tuple(StagePlan(d, bounds[k], bounds[k + 1]) for k, d in enumerate(names))
        pred = predict_generation(Plan("brute", n, stages), units, cluster, workload)
        if pred["memory_violations"] == 0:
            j = _objective(pred)
            best = j if best is None else min(best, j)
    return best


@st.composite
def _instances(draw: st.DrawFn) -> tuple[list[GenerationUnit], ClusterSpec, GenerationWorkload]:
    n_units = draw(st.integers(1, 6))
    units = [
        GenerationUnit(
            f"u{k}",
            weight_bytes=draw(st.integers(1, 10)),
            kv_bytes_per_token=draw(st.sampled_from([0, 1])),
            activation_bytes_per_token=draw(st.integers(0, 2)),
            output_bytes_per_token=draw(st.sampled_from([0, 1_000])),
            decode_time_s=draw(st.integers(0, 6)),
            prefill_time_s=draw(st.integers(0, 6)),
        )
        for k in range(n_units)
    ]
    n_dev = draw(st.integers(1, min(4, n_units)))
    devices = tuple(
        ClusterDevice(
            f"d{k}",
            draw(st.one_of(st.none(), st.integers(6, 60))),
            draw(st.sampled_from([0.5, 1.0, 2.0])),
            draw(st.sampled_from([None, 1.0])),
            draw(st.sampled_from([0.0, 1.0])),
        )
        for k in range(n_dev)
    )
    workload = GenerationWorkload(
        sequences=draw(st.sampled_from([1, 3, 8])),
        max_context=draw(st.integers(1, 4)),
        decode_batch=draw(st.integers(1, 2)),
        prefill_chunk=1,
    )
    return units, ClusterSpec(devices), workload


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_instances())
def test_every_device_in_order_with_the_best_split_that_fits(
    instance: tuple[list[GenerationUnit], ClusterSpec, GenerationWorkload],
) -> None:
    units, cluster, workload = instance
    expected = _best_split(units, cluster, workload)
    if expected is None:
        with pytest.raises(InfeasiblePlanError):
            plan_generation_in_order(units, cluster, workload)
        return
    plan = plan_generation_in_order(units, cluster, workload)
    assert plan.devices == list(cluster.names)  # no device skipped, none moved
    assert plan.predicted["memory_violations"] == 0
    assert _objective(plan.predicted) == pytest.approx(expected, rel=RTOL, abs=1e-12)


def test_a_split_that_fits_where_the_even_one_does_not() -> None:
    # 6 units of 10 bytes; the second device holds 20: the first must take four
    units = [GenerationUnit(f"u{k}", weight_bytes=10, decode_time_s=1.0) for k in range(6)]
    cluster = ClusterSpec((ClusterDevice("a", 45), ClusterDevice("b", 20)))
    workload = GenerationWorkload(sequences=2, max_context=1)
    plan = plan_generation_in_order(units, cluster, workload)
    assert [(s.device, s.start, s.end) for s in plan.stages] == [("a", 0, 4), ("b", 4, 6)]
    with pytest.raises(InfeasiblePlanError, match="cannot split"):
        plan_generation_in_order(units[:1], cluster, workload)
    tight = ClusterSpec((ClusterDevice("a", 35), ClusterDevice("b", 20)))
    with pytest.raises(InfeasiblePlanError):
        plan_generation_in_order(units, tight, workload)


def test_a_kv_budget_caps_a_stages_cache() -> None:
    units = [GenerationUnit("b", weight_bytes=5, kv_bytes_per_token=4)]
    full = GenerationWorkload(sequences=3, max_context=10)
    assert stage_memory(units, 0, 1, full).kv_cache == 120
    capped = GenerationWorkload(sequences=3, max_context=10, kv_budget_bytes=50)
    assert stage_memory(units, 0, 1, capped).kv_cache == 50
    roomy = GenerationWorkload(sequences=3, max_context=10, kv_budget_bytes=1000)
    assert stage_memory(units, 0, 1, roomy).kv_cache == 120
    with pytest.raises(ValueError, match="kv_budget_bytes"):
        GenerationWorkload(sequences=1, max_context=1, kv_budget_bytes=0)


def test_one_sequence_on_alike_devices_gets_the_balanced_split() -> None:
    # one sequence: every split's ring time ties; the least bottleneck breaks the tie
    units = [GenerationUnit(f"u{k}", weight_bytes=1, decode_time_s=1.0) for k in range(6)]
    cluster = ClusterSpec(tuple(ClusterDevice(n) for n in ("a", "b", "c")))
    workload = GenerationWorkload(sequences=1, max_context=4, prefill_chunk=4)
    plan = plan_generation_in_order(units, cluster, workload)
    assert [(s.start, s.end) for s in plan.stages] == [(0, 2), (2, 4), (4, 6)]
