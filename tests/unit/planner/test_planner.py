"""Planners: PipeEdge's category DP against brute force, the baselines, the cost model."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zpipe._errors import ConfigError
from zpipe.planner import (
    CLIENT,
    PLANNERS,
    ClusterDevice,
    ClusterLink,
    ClusterSpec,
    InfeasiblePlanError,
    Plan,
    StagePlan,
    device_categories,
    plan_even,
    plan_pipedream,
    plan_pipeedge,
    plan_with,
    predict_plan,
    solve_pipeedge,
)
from zpipe.planner.memory import profile_stage_memory
from zpipe.planner.profile import ModelProfile, synthetic_profile

# -- random instances ---------------------------------------------------------------------


@dataclass(frozen=True)
class Instance:
    profile: ModelProfile
    cluster: ClusterSpec


@st.composite
def instances(draw: st.DrawFn) -> Instance:
    """Up to 8 units and 5 devices; devices drawn from a few kinds so that categories form."""
    n_units = draw(st.integers(1, 8))
    # Small integers make equal bottlenecks (ties) common, which the tie rule must survive.
    times = draw(st.lists(st.integers(0, 9), min_size=n_units, max_size=n_units))
    out = draw(st.lists(st.integers(0, 2_000_000), min_size=n_units, max_size=n_units))
    params = draw(st.lists(st.integers(1, 10), min_size=n_units, max_size=n_units))
    profile = synthetic_profile(
        [float(t) for t in times],
        out,
        param_bytes=params,
        input_bytes=draw(st.integers(0, 2_000_000)),
    )
    kind = st.tuples(
        st.sampled_from([0.25, 0.5, 1.0, 2.0]),
        st.one_of(st.none(), st.integers(2, 30)),  # memory: sometimes binding
        st.one_of(st.none(), st.sampled_from([2.0, 8.0, 50.0])),
        st.sampled_from([0.0, 1.0, 20.0]),
    )
    kinds = draw(st.lists(kind, min_size=1, max_size=3))
    n_dev = draw(st.integers(1, 5))
    devices = []
    for d in range(n_dev):
        speed, mem, bw, lat = kinds[draw(st.integers(0, len(kinds) - 1))]
        devices.append(ClusterDevice(f"d{d}", mem, speed, bw, lat))
    names = [d.name for d in devices]
    links: dict[tuple[str, str], ClusterLink] = {}
    ends = [*names, CLIENT]
    pairs = [(a, b) for a in ends for b in ends if a != b]
    for a, b in draw(st.lists(st.sampled_from(pairs), max_size=6, unique=True)):
        link = ClusterLink(
            bandwidth_mbps=draw(st.one_of(st.none(), st.sampled_from([1.0, 4.0, 100.0]))),
            latency_ms=draw(st.one_of(st.none(), st.sampled_from([0.0, 5.0]))),
        )
        links[a, b] = link
        if draw(st.booleans()):  # otherwise the link is asymmetric
            links[b, a] = link
    client = ClusterLink(
        bandwidth_mbps=draw(st.one_of(st.none(), st.sampled_from([4.0, 100.0]))),
        latency_ms=draw(st.sampled_from([0.0, 2.0])),
    )
    return Instance(profile, ClusterSpec(tuple(devices), links, client))


def brute_force(inst: Instance) -> tuple[float, int] | None:
    """(least bottleneck, fewest devices reaching it) over every subset, order and split."""
    prof, cl = inst.profile, inst.cluster
    times, out = prof.times(1), prof.output_bytes(1)
    n = prof.num_units
    results: list[tuple[float, int]] = []
    for k in range(1, min(len(cl.devices), n) + 1):
        for order in itertools.permutations(cl.devices, k):
            for cuts in itertools.combinations(range(1, n), k - 1):
                bounds = [0, *cuts, n]
                ok = all(
                    d.memory_bytes is None
                    or _need(prof, bounds[s], bounds[s + 1]) <= d.memory_bytes
                    for s, d in enumerate(order)
                )
                if not ok:
                    continue
                worst = cl.comm_time_s(CLIENT, order[0].name, prof.input_bytes_at(1))
                for s, d in enumerate(order):
                    a, b = bounds[s], bounds[s + 1]
                    comp = sum(times[a:b]) / d.speed
                    nxt = order[s + 1].name if s + 1 < k else CLIENT
                    worst = max(worst, comp, cl.comm_time_s(d.name, nxt, out[b - 1]))
                results.append((worst, k))
    if not results:
        return None
    best = min(r[0] for r in results)
    fewest = min(k for w, k in results if w <= best * (1 + 1e-9) + 1e-12)
    return best, fewest


def _need(prof: ModelProfile, start: int, end: int) -> int:
    """The one memory model's figure for a stage, from its scalar formula."""
    return profile_stage_memory(prof, start, end, 1).model


def assert_valid(plan: Plan, inst: Instance) -> None:
    assert plan.stages[0].start == 0 and plan.stages[-1].end == inst.profile.num_units
    for a, b in itertools.pairwise(plan.stages):
        assert a.end == b.start
    for s in plan.stages:
        cap = inst.cluster.device(s.device).memory_bytes
        assert cap is None or _need(inst.profile, s.start, s.end) <= cap


# -- PipeEdge against brute force ---------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inst=instances())
def test_pipeedge_is_optimal_and_infeasible_exactly_when_brute_force_finds_nothing(
    inst: Instance,
) -> None:
    expected = brute_force(inst)
    if expected is None:
        with pytest.raises(InfeasiblePlanError):
            plan_pipeedge(inst.profile, inst.cluster, batch_size=1)
        return
    plan, objective = solve_pipeedge(inst.profile, inst.cluster, batch_size=1)
    best, fewest = expected
    assert objective == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert len(plan.stages) == fewest  # ties go to the plan with fewer devices
    assert_valid(plan, inst)
    again = predict_plan(plan, inst.profile, inst.cluster, 1)
    assert again["bottleneck_s"] == pytest.approx(objective, rel=1e-9, abs=1e-12)
    assert plan.predicted["bottleneck_s"] == again["bottleneck_s"]
    assert again["memory_violations"] == 0


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inst=instances())
def test_the_greedy_bound_prunes_nothing_that_could_win(inst: Instance) -> None:
    # Small lattices skip the greedy bound; force it on, and the plan must stay optimal
    # with the fewest devices (a partial plan is only dropped when strictly worse).
    import zpipe.planner.category_dp as category_dp

    expected = brute_force(inst)
    if expected is None:
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(category_dp, "SMALL_LATTICE", 0)
        plan, objective = solve_pipeedge(inst.profile, inst.cluster, batch_size=1)
    assert objective == pytest.approx(expected[0], rel=1e-9, abs=1e-12)
    assert len(plan.stages) == expected[1]
    assert_valid(plan, inst)


@settings(max_examples=60, deadline=None)
@given(inst=instances())
def test_baselines_are_valid_and_never_beat_pipeedge(inst: Instance) -> None:
    try:
        best = plan_pipeedge(inst.profile, inst.cluster, batch_size=1)
    except InfeasiblePlanError:
        return
    for planner in (plan_even, plan_pipedream):
        try:
            plan = planner(inst.profile, inst.cluster, batch_size=1)
        except InfeasiblePlanError:
            continue
        assert_valid(plan, inst)
        assert plan.predicted["memory_violations"] == 0
        assert best.predicted["bottleneck_s"] <= plan.predicted["bottleneck_s"] * (1 + 1e-9)


def _check_against_brute_force(inst: Instance) -> Plan:
    expected = brute_force(inst)
    assert expected is not None
    plan, objective = solve_pipeedge(inst.profile, inst.cluster, batch_size=1)
    assert objective == pytest.approx(expected[0])
    assert len(plan.stages) == expected[1]
    return plan


def test_a_one_way_link_inside_a_would_be_category_is_used_in_its_fast_direction() -> None:
    # b and c are alike but b -> c is slow; the best plan runs c then b.
    prof = synthetic_profile([1.0, 1.0], [1_000_000, 0])
    cl = ClusterSpec((ClusterDevice("b"), ClusterDevice("c")), links={("b", "c"): ClusterLink(1.0)})
    plan = _check_against_brute_force(Instance(prof, cl))
    assert plan.devices == ["c", "b"]


def test_a_slow_incoming_link_splits_a_category() -> None:
    # a and b are alike except that w -> a is slow; inputs reach w fast and a, b slowly.
    prof = synthetic_profile([1.0, 1.0], [1_000_000, 0], input_bytes=1_000_000)
    slow = ClusterLink(1.0)
    cl = ClusterSpec(
        (ClusterDevice("a"), ClusterDevice("b"), ClusterDevice("w", memory_bytes=10**9)),
        links={("w", "a"): slow, ("client", "a"): slow, ("client", "b"): slow},
    )
    plan = _check_against_brute_force(Instance(prof, cl))
    assert plan.devices == ["w", "b"]


def test_the_plan_is_deterministic_and_uses_category_members_in_order() -> None:
    prof = synthetic_profile([1.0] * 8, [10] * 8)
    cl = ClusterSpec(tuple(ClusterDevice(f"n{i}") for i in range(4)))
    a = plan_pipeedge(prof, cl, batch_size=1)
    b = plan_pipeedge(prof, cl, batch_size=1)
    assert a == b
    assert a.devices == ["n0", "n1", "n2", "n3"]
    assert [s.num_units for s in a.stages] == [2, 2, 2, 2]


def test_pipeedge_skips_a_device_behind_a_slow_link() -> None:
    # Four units, three devices; c's only way in is a 1 Mbit/s link, so the plan avoids it.
    prof = synthetic_profile([1.0] * 4, [1_000_000] * 4)
    cl = ClusterSpec(
        (ClusterDevice("a"), ClusterDevice("b"), ClusterDevice("c", bandwidth_mbps=1.0))
    )
    plan = plan_pipeedge(prof, cl, batch_size=1)
    assert "c" not in plan.devices
    assert plan.predicted["bottleneck_s"] == pytest.approx(2.0)


def test_the_client_hop_counts() -> None:
    # A huge input over a slow client link is the bottleneck however the units are split.
    prof = synthetic_profile([1.0, 1.0], [8, 8], input_bytes=10_000_000)
    cl = ClusterSpec(
        (ClusterDevice("a"), ClusterDevice("b")), client=ClusterLink(bandwidth_mbps=8.0)
    )
    plan = plan_pipeedge(prof, cl, batch_size=1)
    assert plan.predicted["source_comm_s"] == pytest.approx(10.0)
    assert plan.predicted["bottleneck_s"] == pytest.approx(10.0)
    assert len(plan.stages) == 1  # no faster with two, so the fewer devices win


def test_ties_go_to_fewer_devices_whichever_category_ends_the_pipeline() -> None:
    # The client link is the bottleneck of every plan; b alone is as good as a then b.
    prof = synthetic_profile([1.0, 1.0], [0, 0], param_bytes=[10, 10], input_bytes=10_000_000)
    cl = ClusterSpec(
        (ClusterDevice("a", memory_bytes=15), ClusterDevice("b")),
        client=ClusterLink(bandwidth_mbps=8.0),
    )
    assert plan_pipeedge(prof, cl, batch_size=1).devices == ["b"]


# -- categories -----------------------------------------------------------------------------


def test_devices_differing_only_in_name_share_a_category() -> None:
    devs = tuple(ClusterDevice(f"x{i}", 1 << 30, 0.5, 100.0, 1.0) for i in range(3))
    other = ClusterDevice("big", 8 << 30, 1.0, 100.0, 1.0)
    cl = ClusterSpec((devs[0], other, devs[1], devs[2]))
    assert device_categories(cl) == [["x0", "x1", "x2"], ["big"]]


def test_a_different_link_to_a_third_device_splits_a_category() -> None:
    devs = tuple(ClusterDevice(n, speed=1.0, bandwidth_mbps=100.0) for n in "abcx")
    cl = ClusterSpec(devs, links={("a", "x"): ClusterLink(10.0), ("x", "a"): ClusterLink(10.0)})
    # a and x are swappable (their link is symmetric), but neither with b or c.
    assert device_categories(cl) == [["a", "x"], ["b", "c"]]
    # A link between b and c, the same both ways, keeps them together but apart from a and x.
    cl = ClusterSpec(devs, links={("b", "c"): ClusterLink(10.0), ("c", "b"): ClusterLink(10.0)})
    assert device_categories(cl) == [["a", "x"], ["b", "c"]]
    # One way only: b and c are no longer interchangeable.
    cl = ClusterSpec(devs, links={("b", "c"): ClusterLink(10.0)})
    assert device_categories(cl) == [["a", "x"], ["b"], ["c"]]
    # A different link to the client splits as well.
    cl = ClusterSpec(devs, links={("client", "c"): ClusterLink(latency_ms=3.0)})
    assert device_categories(cl) == [["a", "b", "x"], ["c"]]


def test_memory_and_speed_split_categories() -> None:
    cl = ClusterSpec(
        (ClusterDevice("a", 100), ClusterDevice("b", 200), ClusterDevice("c", 100, speed=2.0))
    )
    assert device_categories(cl) == [["a"], ["b"], ["c"]]


# -- infeasible -------------------------------------------------------------------------------


def test_infeasible_says_how_much_memory_is_missing() -> None:
    prof = synthetic_profile([1.0] * 4, [1] * 4, param_bytes=[3_000_000_000] * 4)
    cl = ClusterSpec(tuple(ClusterDevice(f"d{i}", 2_000_000_000) for i in range(4)))
    with pytest.raises(InfeasiblePlanError, match=r"12.00 GB.*8.00 GB; 4.00 GB short"):
        plan_pipeedge(prof, cl, batch_size=1)


def test_infeasible_names_a_unit_too_large_for_the_largest_device() -> None:
    prof = synthetic_profile([1.0] * 3, [1] * 3, param_bytes=[1_000_000, 5_000_000, 1_000_000])
    cl = ClusterSpec((ClusterDevice("a", 4_000_000), ClusterDevice("b", 4_000_000)))
    with pytest.raises(InfeasiblePlanError, match=r"unit 1 \(unit1\).*largest device \(a\)"):
        plan_pipeedge(prof, cl, batch_size=1)


def test_infeasible_when_units_do_not_pack() -> None:
    # 3 + 3 + 3 fits 5 + 5 in total, but no contiguous split puts it on two 5-byte devices.
    prof = synthetic_profile([1.0] * 3, [1] * 3, param_bytes=[3, 3, 3])
    cl = ClusterSpec((ClusterDevice("a", 5), ClusterDevice("b", 5)))
    with pytest.raises(InfeasiblePlanError, match="contiguous"):
        plan_pipeedge(prof, cl, batch_size=1)
    assert issubclass(InfeasiblePlanError, ConfigError)


def test_memory_is_respected_even_when_slower() -> None:
    prof = synthetic_profile([1.0] * 4, [0] * 4, param_bytes=[10] * 4)
    cl = ClusterSpec((ClusterDevice("fast", 20, speed=4.0), ClusterDevice("slow", 20)))
    plan = plan_pipeedge(prof, cl, batch_size=1)
    assert [s.num_units for s in plan.stages] == [2, 2]


# -- baselines ---------------------------------------------------------------------------------


def _hetero() -> tuple[ModelProfile, ClusterSpec]:
    # 16 identical units, one of four devices four times slower: even gives it 4 units.
    # (A stage's memory is its weights plus its input, which it holds while its units run.)
    prof = synthetic_profile([1.0] * 16, [1000] * 16, param_bytes=[10] * 16)
    devs = (
        ClusterDevice("a", 2000, 1.0, 1000.0),
        ClusterDevice("slow", 2000, 0.25, 1000.0),
        ClusterDevice("b", 2000, 1.0, 1000.0),
        ClusterDevice("c", 2000, 1.0, 1000.0),
    )
    return prof, ClusterSpec(devs)


def test_pipeedge_beats_both_baselines_on_a_heterogeneous_cluster() -> None:
    prof, cl = _hetero()
    edge = plan_pipeedge(prof, cl, batch_size=1)
    even = plan_even(prof, cl, batch_size=1)
    dream = plan_pipedream(prof, cl, batch_size=1)
    assert even.predicted["bottleneck_s"] == pytest.approx(16.0)  # 4 units at a quarter speed
    assert dream.predicted["bottleneck_s"] == pytest.approx(16.0)  # blind to speed: even too
    assert edge.predicted["bottleneck_s"] == pytest.approx(16 / 3.25, rel=0.3)
    thr = "throughput_samples_per_s"
    assert edge.predicted[thr] > 2.5 * even.predicted[thr]
    assert edge.predicted[thr] > 2.5 * dream.predicted[thr]


def test_pipedream_balances_compute_and_even_balances_units() -> None:
    prof = synthetic_profile([1.0, 1.0, 1.0, 5.0], [0] * 4)
    cl = ClusterSpec((ClusterDevice("a"), ClusterDevice("b")))
    assert [s.num_units for s in plan_even(prof, cl, batch_size=1).stages] == [2, 2]
    dream = plan_pipedream(prof, cl, batch_size=1)
    assert [s.num_units for s in dream.stages] == [3, 1]
    assert dream.predicted["bottleneck_s"] == pytest.approx(5.0)


def test_even_refuses_a_partition_that_overflows_memory() -> None:
    prof = synthetic_profile([1.0] * 4, [0] * 4, param_bytes=[10] * 4)
    cl = ClusterSpec((ClusterDevice("small", 15), ClusterDevice("big", 100)))
    with pytest.raises(InfeasiblePlanError, match="stage 0, device small"):
        plan_even(prof, cl, batch_size=1)
    dream = plan_pipedream(prof, cl, batch_size=1)
    assert [s.num_units for s in dream.stages] == [1, 3]


def test_baselines_use_at_most_one_device_per_unit() -> None:
    prof = synthetic_profile([1.0] * 2, [0] * 2)
    cl = ClusterSpec(tuple(ClusterDevice(f"d{i}") for i in range(4)))
    assert plan_even(prof, cl, batch_size=1).devices == ["d0", "d1"]
    assert plan_pipedream(prof, cl, batch_size=1).devices == ["d0", "d1"]


def test_registry_and_unknown_planner() -> None:
    assert set(PLANNERS) == {"pipeedge", "even", "pipedream"}
    prof, cl = _hetero()
    assert plan_with("even", prof, cl, 1).algo == "even"
    with pytest.raises(ConfigError, match="known: even, pipedream, pipeedge"):
        plan_with("gpipe", prof, cl, 1)


# -- prediction -------------------------------------------------------------------------------


def test_predict_plan_numbers() -> None:
    prof = synthetic_profile([1.0, 2.0, 3.0], [1_000_000, 2_000_000, 500_000], input_bytes=250_000)
    cl = ClusterSpec(
        (ClusterDevice("a", bandwidth_mbps=8.0, latency_ms=1.0), ClusterDevice("b", speed=0.5)),
        client=ClusterLink(bandwidth_mbps=2.0, latency_ms=1.0),
    )
    plan = Plan("explicit", 3, (StagePlan("a", 0, 2), StagePlan("b", 2, 3)))
    p = predict_plan(plan, prof, cl, 1)
    assert p["source_comm_s"] == pytest.approx(1.0)  # 2 Mbit/s is the narrower end
    assert p["stage0_compute_s"] == pytest.approx(3.0)
    assert p["stage0_comm_s"] == pytest.approx(2.0)  # 16 Mbit at 8 Mbit/s
    assert p["stage1_compute_s"] == pytest.approx(6.0)
    assert p["stage1_comm_s"] == pytest.approx(2.0)  # back to the client at 2 Mbit/s
    assert p["bottleneck_s"] == pytest.approx(6.0)
    assert p["throughput_samples_per_s"] == pytest.approx(1 / 6.0)
    # latency adds each hop's link latency to compute and serialisation
    assert p["latency_s"] == pytest.approx(1.002 + 3.0 + 2.001 + 6.0 + 2.001)
    with pytest.raises(ConfigError, match="no device 'zz'"):
        predict_plan(Plan("x", 3, (StagePlan("zz", 0, 3),)), prof, cl, 1)


def test_a_device_profile_replaces_speed_scaling() -> None:
    prof = synthetic_profile([1.0, 1.0], [0, 0])
    own = synthetic_profile([5.0, 5.0], [0, 0])
    cl = ClusterSpec((ClusterDevice("a", speed=100.0, profile=own),))
    plan = plan_pipeedge(prof, cl, batch_size=1)
    assert plan.predicted["bottleneck_s"] == pytest.approx(10.0)
    short = synthetic_profile([5.0], [0])
    with pytest.raises(ConfigError, match="own profile has 1 units"):
        plan_pipeedge(prof, ClusterSpec((ClusterDevice("a", profile=short),)), batch_size=1)


def test_a_bench_sized_problem_solves() -> None:
    # The shape of bench/planner.py's 48-unit case.
    prof = synthetic_profile([1.0 + (i % 4) for i in range(48)], [800_000] * 48)
    devs = [
        ClusterDevice(f"k{c}_{i}", None, speed, bw)
        for c, (speed, bw) in enumerate([(1.0, 1000.0), (0.5, 100.0), (0.25, 50.0)])
        for i in range(3)
    ]
    plan = plan_pipeedge(prof, ClusterSpec(tuple(devs)), batch_size=1)
    assert math.isfinite(plan.predicted["bottleneck_s"])
    assert plan.predicted["num_categories"] == 3


def test_chunked_layers_give_the_same_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    import zpipe.planner.category_dp as category_dp

    prof = synthetic_profile(
        [1.0 + (i % 3) for i in range(12)], [100_000 * (i % 4) for i in range(12)]
    )
    devs = tuple(
        ClusterDevice(f"d{i}", None, (0.5, 1.0, 2.0)[i % 3], (10.0, 100.0)[i % 2]) for i in range(6)
    )
    cl = ClusterSpec(devs)
    whole = plan_pipeedge(prof, cl, batch_size=1)
    monkeypatch.setattr(category_dp, "CHUNK_ELEMENTS", 1)
    assert plan_pipeedge(prof, cl, batch_size=1) == whole


def test_too_many_distinct_devices_is_refused_with_advice() -> None:
    # Exact planning only: bucketing (the default, "auto") plans these (see
    # test_planner_bucketing.py); the sparse DP solves 16 exactly, not 20.
    prof = synthetic_profile([1.0] * 96, [0] * 96)
    devs = tuple(ClusterDevice(f"d{i}", speed=1.0 + i / 100) for i in range(20))
    with pytest.raises(ConfigError, match=r"20 categories.*share a category.*bucket"):
        plan_pipeedge(prof, ClusterSpec(devs), batch_size=1, bucketing="exact")


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(
    units=_JSON,
    batch_sizes=_JSON,
    input_bytes=_JSON,
)
def test_a_profile_from_a_peer_is_a_profile_or_a_config_error(
    units: object, batch_sizes: object, input_bytes: object
) -> None:
    # The coordinator reads profiles that stages send: nothing in one may raise
    # anything but ConfigError (a unit that is not an object, int(1e400), ...).
    good = synthetic_profile([1.0, 2.0], [100, 100]).to_dict()
    for data in (
        {**good, "units": units},
        {**good, "batch_sizes": batch_sizes},
        {**good, "input_bytes": input_bytes},
        units,
    ):
        try:
            ModelProfile.from_dict(data)  # type: ignore[arg-type]
        except ConfigError:
            pass
