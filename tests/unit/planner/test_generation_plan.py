"""Planning for generation: the memory model, the ring's cost model, the DP against brute force."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zpipe._errors import ConfigError, InfeasiblePlanError
from zpipe.planner import ClusterDevice, ClusterLink, ClusterSpec, Plan, StagePlan
from zpipe.planner.generation import fixed_orders, plan_generation
from zpipe.planner.generation_cost import (
    GenerationUnit,
    GenerationWorkload,
    check_generation_memory,
    kv_budget_tokens,
    kv_capacity_sequences,
    predict_generation,
    stage_memory,
)
from zpipe.planner.memory import COMPUTE_RUNTIME_BYTES

RTOL = 1e-9


def _units(
    decode: Sequence[float],
    *,
    prefill: Sequence[float] | None = None,
    weights: Sequence[int] | None = None,
    kv: Sequence[int] | None = None,
    act: Sequence[int] | None = None,
    out: Sequence[int] | None = None,
) -> list[GenerationUnit]:
    n = len(decode)
    return [
        GenerationUnit(
            name=f"u{k}",
            weight_bytes=(weights or [0] * n)[k],
            kv_bytes_per_token=(kv or [0] * n)[k],
            activation_bytes_per_token=(act or [0] * n)[k],
            output_bytes_per_token=(out or [0] * n)[k],
            decode_time_s=float(decode[k]),
            prefill_time_s=float((prefill or decode)[k]),
        )
        for k in range(n)
    ]


def _objective(pred: dict[str, float]) -> float:
    """``J = max(R, G * tau)``: what the planner minimises."""
    return max(pred["ring_s"], pred["groups"] * pred["bottleneck_s"])


def _brute_force(
    units: Sequence[GenerationUnit],
    cluster: ClusterSpec,
    workload: GenerationWorkload,
    *,
    max_ttft_s: float | None = None,
    orders: Sequence[Sequence[str]] | None = None,
) -> tuple[float, float] | None:
    """The least ``J`` over every device sequence and split, and the least time to first
    token among the plans that reach it; None when no plan fits. ``orders``: only device
    sequences that follow one of them (the fixed-order search's space)."""
    num_units = len(units)
    names = cluster.names
    found: list[tuple[float, float]] = []
    for n in range(1, min(len(names), num_units) + 1):
        if orders is None:
            sequences = set(itertools.permutations(names, n))
        else:
            sequences = {c for order in orders for c in itertools.combinations(order, n)}
        for devices in sorted(sequences):
            for cuts in itertools.combinations(range(1, num_units), n - 1):
                bounds = (0, *cuts, num_units)
                plan = Plan(
                    "brute",
                    num_units,
                    tuple(StagePlan(d, bounds[k], bounds[k + 1]) for k, d in enumerate(devices)),
                )
                pred = predict_generation(plan, units, cluster, workload)
                if pred["memory_violations"] > 0:
                    continue
                if max_ttft_s is not None and pred["ttft_s"] > max_ttft_s:
                    continue
                found.append((_objective(pred), pred["ttft_s"]))
    if not found:
        return None
    best = min(j for j, _ in found)
    ttft = min(t for j, t in found if j <= best * (1 + RTOL))
    return best, ttft


# -- random instances ---------------------------------------------------------------------


@st.composite
def _instances(
    draw: st.DrawFn,
) -> tuple[list[GenerationUnit], ClusterSpec, GenerationWorkload]:
    n_units = draw(st.integers(1, 5))
    ints = st.integers(0, 6)
    units = _units(
        [draw(ints) for _ in range(n_units)],
        prefill=[draw(st.integers(0, 20)) for _ in range(n_units)],
        weights=[draw(st.integers(1, 10)) for _ in range(n_units)],
        kv=[draw(st.sampled_from([0, 0, 1])) for _ in range(n_units)],
        act=[draw(st.integers(0, 2)) for _ in range(n_units)],
        out=[draw(st.sampled_from([0, 1_000, 500_000])) for _ in range(n_units)],
    )
    kind = st.tuples(
        st.sampled_from([0.5, 1.0, 2.0]),
        st.one_of(st.none(), st.integers(8, 80), st.integers(8, 80)),  # often binding
        st.one_of(st.none(), st.sampled_from([1.0, 8.0, 50.0])),
        st.sampled_from([0.0, 1.0, 500.0]),
    )
    # up to 4 kinds: 4 categories take the search's seeded path (fixed orders first)
    kinds = draw(st.lists(kind, min_size=1, max_size=4))
    n_dev = draw(st.sampled_from([1, 2, 3, 4, 4]))
    devices = []
    for k in range(n_dev):
        speed, memory, bw, lat = kinds[draw(st.integers(0, len(kinds) - 1))]
        devices.append(ClusterDevice(f"d{k}", memory, speed, bw, lat))
    links = {}
    if n_dev >= 2 and draw(st.booleans()):
        link = ClusterLink(draw(st.sampled_from([0.5, 100.0])), draw(st.sampled_from([0.0, 2e3])))
        links[("d0", "d1")] = link
        if not draw(st.booleans()):  # sometimes one way only
            links[("d1", "d0")] = link
    cluster = ClusterSpec(
        tuple(devices), links, ClusterLink(draw(st.sampled_from([None, 10.0])), 1.0)
    )
    prompt = draw(st.integers(1, 8))
    workload = GenerationWorkload(
        sequences=draw(st.sampled_from([1, 2, 5, 12])),  # 12: the bottleneck decides
        max_context=prompt + draw(st.integers(0, 4)),
        decode_batch=draw(st.integers(1, 3)),
        prefill_chunk=draw(st.integers(1, 4)),
        prompt_tokens=prompt,
    )
    return units, cluster, workload


def _check_against_brute_force(
    units: list[GenerationUnit],
    cluster: ClusterSpec,
    workload: GenerationWorkload,
    *,
    exact: bool,
    max_ttft_s: float | None = None,
) -> None:
    orders = None
    if not exact:
        orders = fixed_orders(cluster, {d.name: d.speed for d in cluster.devices})
    expected = _brute_force(units, cluster, workload, max_ttft_s=max_ttft_s, orders=orders)
    if expected is None:
        with pytest.raises(InfeasiblePlanError):
            plan_generation(units, cluster, workload, exact=exact, max_ttft_s=max_ttft_s)
        return
    plan = plan_generation(units, cluster, workload, exact=exact, max_ttft_s=max_ttft_s)
    pred = predict_generation(plan, units, cluster, workload)
    assert pred["memory_violations"] == 0
    assert _objective(pred) == pytest.approx(expected[0], rel=RTOL, abs=1e-12)
    assert pred["ttft_s"] == pytest.approx(expected[1], rel=RTOL, abs=1e-12)
    if max_ttft_s is not None:
        assert pred["ttft_s"] <= max_ttft_s * (1 + RTOL)
    assert plan.predicted["planner_exact"] == (1.0 if exact else 0.0)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_instances())
def test_the_dp_finds_the_brute_force_optimum(
    instance: tuple[list[GenerationUnit], ClusterSpec, GenerationWorkload],
) -> None:
    _check_against_brute_force(*instance, exact=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_instances())
def test_the_fixed_order_search_is_optimal_within_its_order(
    instance: tuple[list[GenerationUnit], ClusterSpec, GenerationWorkload],
) -> None:
    _check_against_brute_force(*instance, exact=False)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_instances(), st.sampled_from([0.5, 1.0, 1.5]))
def test_a_time_to_first_token_bound_is_met_optimally(
    instance: tuple[list[GenerationUnit], ClusterSpec, GenerationWorkload], fraction: float
) -> None:
    units, cluster, workload = instance
    free = _brute_force(units, cluster, workload)
    if free is None:
        return
    # a bound around the unconstrained plan's time to first token: binding or not
    _check_against_brute_force(
        units, cluster, workload, exact=True, max_ttft_s=max(free[1] * fraction, 1e-6)
    )


# -- the memory model ---------------------------------------------------------------------


def test_stage_memory_adds_weights_kv_cache_and_the_largest_working_set() -> None:
    units = _units([1, 1, 1], weights=[100, 200, 300], kv=[0, 4, 6], act=[7, 3, 5])
    workload = GenerationWorkload(
        sequences=3, max_context=50, decode_batch=2, prefill_chunk=16, prompt_tokens=10
    )
    mem = stage_memory(units, 1, 3, workload)
    assert mem.weights == 500
    assert mem.kv_cache == (4 + 6) * 50 * 3
    assert mem.activations == 16 * 5  # max(C, b) tokens, the largest unit's working set
    assert mem.total == 500 + 1500 + 80
    # beside the model's part (what a device's room holds): the runtime's allowance,
    # which a room already leaves out; the process holds both beyond its base
    assert mem.runtime == COMPUTE_RUNTIME_BYTES
    assert mem.above_base == mem.total + COMPUTE_RUNTIME_BYTES
    # a decode micro-batch larger than a chunk sets the working set
    wide = GenerationWorkload(sequences=3, max_context=50, decode_batch=32, prefill_chunk=16)
    assert stage_memory(units, 0, 1, wide).activations == 32 * 7


def test_a_plan_that_does_not_fit_is_refused_naming_the_device() -> None:
    units = _units([1, 1], weights=[1_000, 1_000], kv=[10, 10])
    cluster = ClusterSpec((ClusterDevice("phone", memory_bytes=50_000),))
    workload = GenerationWorkload(sequences=4, max_context=1_000, prompt_tokens=8)
    with pytest.raises(InfeasiblePlanError) as err:
        plan_generation(units, cluster, workload)
    text = str(err.value)
    assert "phone" in text
    assert "KV cache" in text
    assert "82.0 kB" in text and "50.0 kB" in text  # what it needs and what it has
    # a given plan is refused the same way, naming its stage's device
    cluster2 = ClusterSpec(
        (ClusterDevice("laptop", memory_bytes=10**9), ClusterDevice("phone", memory_bytes=30_000))
    )
    plan = Plan("explicit", 2, (StagePlan("laptop", 0, 1), StagePlan("phone", 1, 2)))
    with pytest.raises(InfeasiblePlanError, match=r"stage 1: device phone needs 41\.0 kB"):
        check_generation_memory(plan, units, cluster2, workload)
    # and the planner avoids it: the laptop holds both units
    assert plan_generation(units, cluster2, workload).devices == ["laptop"]


def test_a_unit_that_fits_no_device_is_named() -> None:
    units = _units([1, 1], weights=[10, 5_000])
    cluster = ClusterSpec(
        (ClusterDevice("a", memory_bytes=1_000), ClusterDevice("b", memory_bytes=2_000))
    )
    with pytest.raises(InfeasiblePlanError, match=r"unit 1 \(u1\) alone .* device b needs 5\.0 kB"):
        plan_generation(units, cluster, GenerationWorkload(sequences=1, max_context=4))


def test_kv_capacity_says_how_many_sequences_fit() -> None:
    units = _units([1, 1], weights=[100, 100], kv=[1, 2], act=[1, 1])
    cluster = ClusterSpec(
        (ClusterDevice("a", memory_bytes=1_100), ClusterDevice("b", memory_bytes=10_000))
    )
    workload = GenerationWorkload(sequences=1, max_context=100, prefill_chunk=4, prompt_tokens=4)
    plan = Plan("explicit", 2, (StagePlan("a", 0, 1), StagePlan("b", 1, 2)))
    # tokens of cache: a (1100 - 100 - 4) // 1 = 996, b (10000 - 100 - 4) // 2 = 4948
    assert kv_budget_tokens(plan, units, cluster, workload) == 996
    assert kv_capacity_sequences(plan, units, cluster, workload) == 9  # 996 // 100
    unbounded = ClusterSpec((ClusterDevice("a"), ClusterDevice("b")))
    assert kv_capacity_sequences(plan, units, unbounded, workload) is None
    assert kv_budget_tokens(plan, units, unbounded, workload) is None


# -- the cost model -----------------------------------------------------------------------


def test_the_ring_cost_model_by_hand() -> None:
    # two stages; 1 Mbit/s access links and 10 ms + 10 ms latency between them
    units = _units([0.1, 0.3], prefill=[1.0, 2.0], out=[1_000, 8])
    cluster = ClusterSpec(
        (
            ClusterDevice("a", bandwidth_mbps=1.0, latency_ms=10.0),
            ClusterDevice("b", speed=0.5, bandwidth_mbps=1.0, latency_ms=10.0),
        )
    )
    workload = GenerationWorkload(
        sequences=5, max_context=64, decode_batch=2, prefill_chunk=4, prompt_tokens=10
    )
    plan = Plan("explicit", 2, (StagePlan("a", 0, 1), StagePlan("b", 1, 2)))
    pred = predict_generation(plan, units, cluster, workload)
    d = [0.1, 0.6]  # b runs at half speed
    x = [2 * 1_000 * 8 / 1e6, 2 * 8 * 8 / 1e6]  # a -> b hidden states, b -> a token ids
    ring = sum(d) + sum(x) + 2 * 0.02
    tau = max(*d, *x)
    assert pred["ring_s"] == pytest.approx(ring)
    assert pred["bottleneck_s"] == pytest.approx(tau)
    groups = 3  # ceil(5 / 2)
    assert pred["decode_tokens_per_s"] == pytest.approx(5 / max(ring, groups * tau))
    # ttft: the client's hops (0 + 10 ms each way; the devices' 1 Mbit/s access links
    # carry 10 token ids in and one out), then 3 chunks through a (1 s), the link
    # (4 * 1000 * 8 / 1e6 s + 20 ms) and b (4 s)
    client = 0.01 + 10 * 8 * 8 / 1e6 + 0.01 + 8 * 8 / 1e6
    p, y = [1.0, 4.0], 4 * 1_000 * 8 / 1e6
    ttft = client + sum(p) + y + 0.02 + (3 - 1) * max(*p, y)
    assert pred["ttft_s"] == pytest.approx(ttft)


def test_one_sequence_minimises_the_ring_many_minimise_the_bottleneck() -> None:
    # one big device holds everything; two small ones must share, 0.5 s apart each way
    units = _units([1, 1, 1, 1], weights=[10, 10, 10, 10], out=[100, 100, 100, 8])
    cluster = ClusterSpec(
        (
            ClusterDevice("big", memory_bytes=40),
            ClusterDevice("s0", memory_bytes=20, latency_ms=250.0),
            ClusterDevice("s1", memory_bytes=20, latency_ms=250.0),
        ),
        links={
            pair: ClusterLink(latency_ms=1e4)
            for pair in (("big", "s0"), ("s0", "big"), ("big", "s1"), ("s1", "big"))
        },
    )
    one = plan_generation(units, cluster, GenerationWorkload(sequences=1, max_context=4))
    many = plan_generation(units, cluster, GenerationWorkload(sequences=8, max_context=4))
    assert one.devices == ["big"]  # R = 4 s, against 2 + 2 + 0.5 + 0.5 = 5 s split
    assert one.predicted["ring_s"] == pytest.approx(4.0)
    assert sorted(many.devices) == ["s0", "s1"]  # G * tau = 8 * 2 against 8 * 4
    assert many.predicted["bottleneck_s"] == pytest.approx(2.0)
    assert many.predicted["ring_s"] == pytest.approx(5.0)
    assert many.predicted["decode_tokens_per_s"] == pytest.approx(8 / 16)
    # each plan is the worse one for the other's workload
    for mine, theirs, sequences in ((one, many, 1), (many, one, 8)):
        w = GenerationWorkload(sequences=sequences, max_context=4)
        ours = predict_generation(mine, units, cluster, w)["decode_tokens_per_s"]
        assert predict_generation(theirs, units, cluster, w)["decode_tokens_per_s"] < ours


def test_a_slow_link_moves_a_cut() -> None:
    # four equal units on two devices that hold three each; unit 2's output is tiny
    units = _units([1, 1, 1, 1], weights=[1, 1, 1, 1], out=[1_000, 1_000, 10, 8])
    devices = (ClusterDevice("a", memory_bytes=3), ClusterDevice("b", memory_bytes=3))
    workload = GenerationWorkload(sequences=16, max_context=1)
    fast = plan_generation(units, ClusterSpec(devices), workload)
    assert [s.end for s in fast.stages] == [2, 4]  # balanced: tau = 2 s
    slow_link = ClusterLink(bandwidth_mbps=8_000 / 5 / 1e6)  # 1000 bytes take 5 s
    slow_links = {("a", "b"): slow_link, ("b", "a"): slow_link}
    slow = plan_generation(units, ClusterSpec(devices, slow_links), workload)
    assert [s.end for s in slow.stages] == [3, 4]  # cut where only 10 bytes cross
    assert slow.predicted["bottleneck_s"] == pytest.approx(3.0)


def test_kv_cache_memory_decides_a_cut_at_long_context() -> None:
    # a fast device with little memory, a slow one with plenty: with one sequence the
    # fast device takes all it can hold; its cache, not its weights, limits it at 20 tokens
    units = _units([1, 1, 1, 1], weights=[100] * 4, kv=[1] * 4, out=[10] * 4)
    cluster = ClusterSpec(
        (ClusterDevice("fast", memory_bytes=350, speed=4.0), ClusterDevice("slow"))
    )
    short = plan_generation(units, cluster, GenerationWorkload(sequences=1, max_context=10))
    long = plan_generation(units, cluster, GenerationWorkload(sequences=1, max_context=20))

    def on_fast(plan: Plan) -> int:
        return next(s.num_units for s in plan.stages if s.device == "fast")

    assert on_fast(short) == 3  # 300 + 3 * 10 = 330 <= 350
    assert on_fast(long) == 2  # 300 + 3 * 20 = 360 > 350; 200 + 40 fits
    stage = long.devices.index("fast")
    assert long.predicted[f"stage{stage}_kv_bytes"] == 2 * 20


def test_a_time_to_first_token_bound_changes_the_plan() -> None:
    # a and b are 10 s apart: with many sequences decode gains from splitting the
    # work (the latency is hidden), but the one chunk of a prompt pays it
    units = _units([1, 1], prefill=[10, 10], weights=[1, 1], out=[8, 8])
    far = ClusterLink(latency_ms=1e4)
    cluster = ClusterSpec(
        (ClusterDevice("a", memory_bytes=2), ClusterDevice("b", memory_bytes=1)),
        {("a", "b"): far, ("b", "a"): far},
    )
    workload = GenerationWorkload(sequences=64, max_context=8, prefill_chunk=8, prompt_tokens=8)
    free = plan_generation(units, cluster, workload)
    assert free.devices == ["a", "b"] or free.devices == ["b", "a"]
    assert free.predicted["ttft_s"] == pytest.approx(10 + 10 + 10)
    bound = plan_generation(units, cluster, workload, max_ttft_s=25.0)
    assert bound.devices == ["a"]
    assert bound.predicted["ttft_s"] == pytest.approx(20.0)
    with pytest.raises(InfeasiblePlanError, match="time to first token within 5 s"):
        plan_generation(units, cluster, workload, max_ttft_s=5.0)


def test_measured_speeds_override_the_declared_ones() -> None:
    # declared alike, but b was measured four times as fast: one sequence goes to b
    units = _units([1, 1], out=[8, 8])
    cluster = ClusterSpec((ClusterDevice("a"), ClusterDevice("b")))
    workload = GenerationWorkload(sequences=1, max_context=4)
    assert plan_generation(units, cluster, workload).devices == ["a"]
    fast_b = plan_generation(units, cluster, workload, speeds={"b": 4.0})
    assert fast_b.devices == ["b"]
    assert fast_b.predicted["ring_s"] == pytest.approx(0.5)


def test_the_fixed_orders_fold_the_speed_order() -> None:
    cluster = ClusterSpec(tuple(ClusterDevice(f"d{k}", speed=10 - k) for k in range(5)))
    orders = fixed_orders(cluster, {d.name: d.speed for d in cluster.devices})
    assert orders == [
        ["d0", "d1", "d2", "d3", "d4"],
        ["d4", "d3", "d2", "d1", "d0"],
        ["d0", "d2", "d4", "d3", "d1"],  # the two fastest at the ends
        ["d4", "d2", "d0", "d1", "d3"],  # the two slowest at the ends
    ]


def test_sixteen_distinct_devices_are_planned_over_the_fixed_orders() -> None:
    units = _units([1] * 12, weights=[1] * 12, kv=[1] * 12, out=[4_000] * 12)
    cluster = ClusterSpec(
        tuple(
            ClusterDevice(f"d{k}", memory_bytes=40, speed=1 + k / 16, bandwidth_mbps=10 + k)
            for k in range(16)
        )
    )
    workload = GenerationWorkload(sequences=2, max_context=8)  # 17 bytes a unit: 2 a device
    plan = plan_generation(units, cluster, workload)
    assert plan.predicted["planner_exact"] == 0.0
    assert len(plan.stages) >= 6
    check_generation_memory(plan, units, cluster, workload)  # fits: no error
    assert plan.predicted["decode_tokens_per_s"] > 0


def test_bad_inputs_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="sequences"):
        GenerationWorkload(sequences=0, max_context=4)
    with pytest.raises(ConfigError, match="exceeds the maximum context"):
        GenerationWorkload(sequences=1, max_context=4, prompt_tokens=5)
    with pytest.raises(ConfigError, match="weight_bytes"):
        GenerationUnit("x", weight_bytes=-1)
    with pytest.raises(ConfigError, match="decode_time_s"):
        GenerationUnit("x", weight_bytes=1, decode_time_s=math.nan)
    with pytest.raises(ConfigError, match="kv_bytes_per_token"):
        GenerationUnit("x", weight_bytes=1, kv_bytes_per_token=2.5)  # type: ignore[arg-type]
    # numpy's numbers are numbers: stored as plain ones
    unit = GenerationUnit("x", weight_bytes=np.int64(7), decode_time_s=np.float32(0.5))  # type: ignore[arg-type]
    assert type(unit.weight_bytes) is int and type(unit.decode_time_s) is float
    assert GenerationWorkload(np.int64(2), 8).sequences == 2  # type: ignore[arg-type]
    units = _units([1])
    cluster = ClusterSpec((ClusterDevice("a"),))
    with pytest.raises(ConfigError, match="max_ttft_s"):
        plan_generation(units, cluster, GenerationWorkload(1, 4, prompt_tokens=1), max_ttft_s=0)
    with pytest.raises(ConfigError, match="no device 'zz'"):
        plan_generation(units, cluster, GenerationWorkload(1, 4, prompt_tokens=1), speeds={"zz": 1})


# -- the formulas against a simulation of the ring ---------------------------------------


def _simulate_ring(
    d: Sequence[float], x: Sequence[float], lat: Sequence[float], groups: int, rounds: int
) -> float:
    """Steps per second of ``groups`` micro-batches going round a ring of stages (compute
    ``d``, then the link: serialisation ``x``, latency ``lat``), each one server, FIFO.

    Item ``m`` is group ``m % G``'s step ``m // G``; all take the same path and the same
    delays, so none overtakes another and every server sees them in the order of ``m``.
    """
    n, total = len(d), groups * rounds
    end_c = [[0.0] * total for _ in range(n)]
    end_x = [[0.0] * total for _ in range(n)]
    for m in range(total):
        arrive = 0.0 if m < groups else end_x[n - 1][m - groups] + lat[n - 1]
        for s in range(n):
            start = max(arrive, end_c[s][m - 1] if m else 0.0)
            end_c[s][m] = start + d[s]
            end_x[s][m] = max(end_c[s][m], end_x[s][m - 1] if m else 0.0) + x[s]
            arrive = end_x[s][m] + lat[s]
    half = total // 2  # past the transient: the rate over the second half
    return (total - 1 - half) / (end_c[n - 1][total - 1] - end_c[n - 1][half])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0.1, 5), st.floats(0, 3), st.floats(0, 4)), min_size=1, max_size=4
    ),
    st.integers(1, 6),
)
def test_the_decode_rate_formula_matches_a_simulated_ring(
    stages: list[tuple[float, float, float]], groups: int
) -> None:
    d, x, lat = ([s[k] for s in stages] for k in range(3))
    ring = sum(d) + sum(x) + sum(lat)
    tau = max(*d, *x)
    simulated = _simulate_ring(d, x, lat, groups, rounds=400)
    # steps per second = 1 / max(R / G, tau); tokens/s is that times S / G. The measured
    # window's ends may cut a periodic regime mid-period: about 1 item in 600 (0.2 %).
    assert simulated == pytest.approx(groups / max(ring, groups * tau), rel=0.01)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0.1, 5), st.floats(0, 3), st.floats(0, 4)), min_size=1, max_size=4
    ),
    st.integers(1, 8),
)
def test_the_prefill_formula_matches_a_simulated_flow_line(
    stages: list[tuple[float, float, float]], chunks: int
) -> None:
    p, y, lat = ([s[k] for s in stages] for k in range(3))
    n = len(p)
    # k chunks, all ready at 0, through each stage's compute and (but the last) its link
    end_c, end_y = [0.0] * n, [0.0] * n
    for _ in range(chunks):
        arrive = 0.0
        for s in range(n):
            end_c[s] = max(arrive, end_c[s]) + p[s]
            if s + 1 < n:
                end_y[s] = max(end_c[s], end_y[s]) + y[s]
                arrive = end_y[s] + lat[s]
    q = sum(p) + sum(y[:-1]) + sum(lat[:-1])
    pi = max(*p, *y[:-1]) if n > 1 else p[0]
    assert end_c[-1] == pytest.approx(q + (chunks - 1) * pi, rel=1e-9)
