"""Training planners: HPP and straight DPs against brute force, Algorithm 1, memory, plans."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zpipe._errors import ConfigError
from zpipe.cli.plan import main as plan_main
from zpipe.planner.allocation import _balance_by_capacity, allocate_microbatch
from zpipe.planner.cluster import ClusterDevice, ClusterLink, ClusterSpec
from zpipe.planner.cost import InfeasiblePlanError
from zpipe.planner.hpp import (
    memory_order,
    plan_training,
    search_microbatch_and_order,
    stage_warmup,
)
from zpipe.planner.profile import ModelProfile, UnitProfile, synthetic_profile
from zpipe.planner.schedules import ecofl_warmup
from zpipe.planner.training_cost import (
    TrainingCosts,
    at_batch_sizes,
    estimate_round_s,
    estimate_stages_round_s,
    evaluate_group,
)
from zpipe.planner.training_plan import TrainingPlan, TrainStage

SIZES = (1, 2, 4)
MB = 1_000_000

# -- random instances ---------------------------------------------------------------------


@dataclass(frozen=True)
class Instance:
    profile: ModelProfile
    cluster: ClusterSpec
    microbatch_size: int
    num_microbatches: int
    schedule: str
    optimizer: str


def _growing(draw: st.DrawFn, first: int, *, low: float, high: float) -> tuple[float, ...]:
    """Values at SIZES that never shrink: first * s**exponent, exponent in [low, high]."""
    exponent = draw(st.sampled_from([low, (low + high) / 2, high]))
    return tuple(first * s**exponent for s in SIZES)


@st.composite
def instances(draw: st.DrawFn, max_units: int = 6, max_devices: int = 4) -> Instance:
    """Up to 6 units and 4 devices, measured at batch sizes 1, 2, 4 (time not linear)."""
    n_units = draw(st.integers(1, max_units))
    units = []
    for k in range(n_units):
        forward = _growing(draw, draw(st.integers(1, 9)), low=0.5, high=1.0)
        backward = _growing(draw, draw(st.integers(1, 18)), low=0.5, high=1.0)
        per_sample = draw(st.integers(0, 3)) * MB
        saved = draw(st.integers(0, 4)) * MB
        units.append(
            UnitProfile(
                name=f"u{k}",
                param_bytes=draw(st.integers(0, 4)) * MB,
                time_s=tuple(t / 1000 for t in forward),
                output_bytes=tuple(per_sample * s for s in SIZES),
                memory_bytes=tuple(0 for _ in SIZES),
                backward_time_s=tuple(t / 1000 for t in backward),
                activation_bytes=tuple(saved * s for s in SIZES),
            )
        )
    profile = ModelProfile(
        batch_sizes=SIZES, units=tuple(units), input_bytes=tuple(MB * s for s in SIZES)
    )
    kinds = draw(
        st.lists(
            st.tuples(
                st.sampled_from([0.25, 0.5, 1.0]),
                st.one_of(st.none(), st.integers(4, 60)),  # memory in MB: often binding
                st.one_of(st.none(), st.sampled_from([100.0, 1000.0, 8000.0])),
            ),
            min_size=1,
            max_size=3,
        )
    )
    devices = []
    for d in range(draw(st.integers(1, max_devices))):
        speed, memory, bandwidth = kinds[draw(st.integers(0, len(kinds) - 1))]
        devices.append(
            ClusterDevice(f"d{d}", None if memory is None else memory * MB, speed, bandwidth)
        )
    links: dict[tuple[str, str], ClusterLink] = {}
    names = [d.name for d in devices]
    pairs = [(a, b) for a in names for b in names if a != b]
    chosen = draw(st.lists(st.sampled_from(pairs), max_size=3, unique=True)) if pairs else []
    for a, b in chosen:
        links[a, b] = ClusterLink(bandwidth_mbps=draw(st.sampled_from([50.0, 400.0])))
    return Instance(
        profile=profile,
        cluster=ClusterSpec(tuple(devices), links=links),
        microbatch_size=draw(st.integers(1, 5)),
        num_microbatches=draw(st.integers(1, 6)),
        schedule=draw(st.sampled_from(["1f1b", "gpipe"])),
        optimizer=draw(st.sampled_from(["sgd", "adam"])),
    )


def _compositions(total: int, parts: int) -> Iterator[list[int]]:
    """Boundaries ``[0, b1, ..., total]`` of every split of ``total`` into ``parts`` parts."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        yield [0, *cuts, total]


def _groupings(num_devices: int, parts: int, first: int = 0) -> Iterator[list[tuple[int, int]]]:
    """Every ``parts`` disjoint runs ``[g, h)`` of ``first..num_devices``, in order, with gaps."""
    if parts == 0:
        yield []
        return
    for g in range(first, num_devices):
        for h in range(g + 1, num_devices + 1):
            for rest in _groupings(num_devices, parts - 1, h):
                yield [(g, h), *rest]


def brute_force_hpp(x: Instance) -> float | None:
    """Every split into contiguous stages, every choice of ordered disjoint runs of the
    memory-ordered devices as their groups, each scored literally by eq. 4-6 (not by the
    DP's incremental form)."""
    costs = TrainingCosts(
        x.profile, x.cluster, microbatch_size=x.microbatch_size, optimizer=x.optimizer
    )
    ordered = memory_order(x.cluster.devices)
    num_units, m = x.profile.num_units, x.num_microbatches
    best: float | None = None
    for p in range(1, min(num_units, len(ordered)) + 1):
        for units in _compositions(num_units, p):
            for runs in _groupings(len(ordered), p):
                stages = []
                for s, (g, h) in enumerate(runs):
                    warmup = stage_warmup(x.schedule, p - s, m)
                    group = evaluate_group(costs, ordered[g:h], units[s], units[s + 1], warmup)
                    if group is None:
                        break
                    stages.append(group)
                else:
                    links = [
                        costs.transfer_s(stages[s].devices, stages[s + 1].devices, units[s + 1])
                        for s in range(p - 1)
                    ]
                    value = estimate_stages_round_s(stages, links, m)
                    best = value if best is None else min(best, value)
    return best


def brute_force_straight(x: Instance) -> float | None:
    """Eco-FL's eq. 1 objective over every contiguous split, devices in cluster order."""
    costs = TrainingCosts(
        x.profile, x.cluster, microbatch_size=x.microbatch_size, optimizer=x.optimizer
    )
    devices = list(x.cluster.devices[: x.profile.num_units])
    need = x.num_microbatches if x.schedule == "gpipe" else 1
    b = x.microbatch_size
    best: float | None = None
    for bounds in _compositions(x.profile.num_units, len(devices)):
        worst = 0.0
        for s, d in enumerate(devices):
            i, j = bounds[s], bounds[s + 1]
            if costs.memory_bytes(i, j, b, need) > (d.memory_bytes or math.inf):
                break
            worst = max(worst, costs.forward_s(d, i, j, b) + costs.backward_s(d, i, j, b))
            if s > 0:
                worst = max(worst, sum(costs.transfer_s([devices[s - 1].name], [d.name], i)))
        else:
            best = worst if best is None else min(best, worst)
    return best


def check_fits_memory(plan: TrainingPlan, x: Instance) -> None:
    costs = TrainingCosts(
        x.profile, x.cluster, microbatch_size=x.microbatch_size, optimizer=x.optimizer
    )
    for stage in plan.stages:
        for name, share in zip(stage.devices, stage.shares, strict=True):
            need = costs.memory_bytes(stage.start, stage.end, share, stage.warmup)
            cap = x.cluster.device(name).memory_bytes
            assert cap is None or need <= cap, (name, need, cap)
    assert plan.predicted["memory_violations"] == 0


def _plan(x: Instance, algo: str) -> TrainingPlan:
    return plan_training(
        x.profile,
        x.cluster,
        microbatch_size=x.microbatch_size,
        num_microbatches=x.num_microbatches,
        algo=algo,
        schedule=x.schedule,
        optimizer=x.optimizer,
    )


FAST = settings(
    max_examples=70, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)

# -- the DPs against brute force ----------------------------------------------------------


@FAST
@given(instances())
def test_hpp_matches_brute_force(x: Instance) -> None:
    expected = brute_force_hpp(x)
    if expected is None:
        with pytest.raises(InfeasiblePlanError, match=r"short|do not pack"):
            _plan(x, "hpp")
        return
    plan = _plan(x, "hpp")
    assert plan.predicted["planner_objective_s"] == pytest.approx(expected, rel=1e-9, abs=1e-12)
    # The DP's incremental form agrees with eq. 4-6 applied to the plan it returns.
    assert plan.predicted["estimate_round_s"] == pytest.approx(expected, rel=1e-9, abs=1e-12)
    check_fits_memory(plan, x)
    ordered = [d.name for d in memory_order(x.cluster.devices)]
    positions = [ordered.index(d) for d in plan.devices]
    assert positions == sorted(positions)  # stages take devices in memory order
    for stage in plan.stages:  # each group a contiguous run of it
        first = ordered.index(stage.devices[0])
        assert list(stage.devices) == ordered[first : first + len(stage.devices)]
    for s, stage in enumerate(plan.stages):
        assert stage.warmup == stage_warmup(x.schedule, plan.num_stages - s, x.num_microbatches)


@FAST
@given(instances())
def test_straight_matches_brute_force(x: Instance) -> None:
    expected = brute_force_straight(x)
    if expected is None:
        with pytest.raises(InfeasiblePlanError):
            _plan(x, "straight")
        return
    plan = _plan(x, "straight")
    assert plan.predicted["planner_objective_s"] == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert plan.devices == x.cluster.names[: x.profile.num_units]
    assert all(len(s.devices) == 1 for s in plan.stages)
    check_fits_memory(plan, x)
    warmups = plan.warmups
    assert warmups == sorted(warmups, reverse=True)  # 1F1B deadlocks otherwise


@FAST
@given(instances(), st.sampled_from(["data-parallel", "even"]))
def test_baselines_fit_memory_or_raise(x: Instance, algo: str) -> None:
    try:
        plan = _plan(x, algo)
    except InfeasiblePlanError as exc:
        assert "short" in str(exc) or "do not pack" in str(exc)
        return
    check_fits_memory(plan, x)
    if algo == "data-parallel":
        assert plan.num_stages == 1 and all(y > 0 for y in plan.stages[0].shares)


@FAST
@given(instances(max_units=4, max_devices=3))
def test_hpp_is_never_worse_than_the_baselines_in_its_space(x: Instance) -> None:
    try:
        hpp = _plan(x, "hpp")
    except InfeasiblePlanError:
        return
    ordered = memory_order(x.cluster.devices)
    names = [d.name for d in ordered]
    costs = TrainingCosts(
        x.profile, x.cluster, microbatch_size=x.microbatch_size, optimizer=x.optimizer
    )
    for algo in ("data-parallel", "even"):
        try:
            other = plan_training(
                x.profile,
                x.cluster,
                microbatch_size=x.microbatch_size,
                num_microbatches=x.num_microbatches,
                algo=algo,
                schedule=x.schedule,
                optimizer=x.optimizer,
                devices=names,
            )
        except InfeasiblePlanError:
            continue
        # Even stages are single devices in memory order: always in the HPP space. The
        # data-parallel group is when it is a run of the order and Algorithm 1 on that run
        # gives its shares (it drops devices that got no sample).
        stage = other.stages[0]
        first = names.index(stage.devices[0])
        run = ordered[first : first + len(stage.devices)]
        group = evaluate_group(costs, run, 0, x.profile.num_units, stage.warmup)
        if algo == "data-parallel" and (
            [d.name for d in run] != list(stage.devices)
            or group is None
            or group.shares != stage.shares
        ):
            continue
        assert hpp.predicted["estimate_round_s"] <= other.predicted["estimate_round_s"] * (1 + 1e-9)


# -- Algorithm 1 ---------------------------------------------------------------------------


@st.composite
def groups(draw: st.DrawFn) -> tuple[list[list[float]], list[int], int]:
    b = draw(st.integers(1, 12))
    n = draw(st.integers(1, 4))
    rows, caps = [], []
    for _ in range(n):
        per = draw(st.integers(1, 20))
        fixed = draw(st.integers(0, 30))
        exponent = draw(st.sampled_from([0.5, 0.8, 1.0, 1.3]))
        rows.append([0.0] + [fixed + per * y**exponent for y in range(1, b + 1)])
        caps.append(draw(st.integers(-1, b + 2)))
    return rows, caps, b


@settings(max_examples=300, deadline=None, database=None)
@given(groups(), st.integers(1, 3))
def test_algorithm_1_shares_sum_to_the_microbatch_within_memory(
    group: tuple[list[list[float]], list[int], int], block: int
) -> None:
    rows, caps, b = group
    shares = allocate_microbatch(rows, caps, b, block=block)
    room = sum(min(max(c, 0), b) for c in caps)
    if room < b:
        assert shares is None
        return
    assert shares is not None
    assert sum(shares) == b
    assert all(0 <= y <= max(c, 0) for y, c in zip(shares, caps, strict=True))
    # Phase 2 only ever makes the straggler faster than phase 1 left it.
    capacities = [1 / r[b] for r in rows]
    first = _balance_by_capacity(capacities, [min(max(c, 0), b) for c in caps], b)
    assert sum(first) == b
    slowest = max(r[y] for r, y in zip(rows, shares, strict=True))
    assert slowest <= max(r[y] for r, y in zip(rows, first, strict=True))


def test_algorithm_1_balances_by_capacity_then_respects_memory() -> None:
    linear = [[float(y) for y in range(7)], [2.0 * y for y in range(7)]]  # 2:1 capacity
    assert allocate_microbatch(linear, [6, 6], 6) == (4, 2)
    # The fast device's memory holds 3: the rest goes to the slow one.
    assert allocate_microbatch(linear, [3, 6], 6) == (3, 3)
    assert allocate_microbatch(linear, [3, 2], 6) is None
    # Time not linear in the batch: device 1 pays a fixed cost whatever its share, so
    # equal capacities at 6 samples give (3, 3), where device 1 straggles at 5.4;
    # offloading moves samples to device 0 while that helps: (5, 1), slowest 5.0.
    rows = [[0.0, 1, 2, 3, 4, 5, 6], [0.0, 5, 5.2, 5.4, 5.6, 5.8, 6]]
    assert _balance_by_capacity([1 / 6, 1 / 6], [6, 6], 6) == [3, 3]
    assert allocate_microbatch(rows, [6, 6], 6) == (5, 1)
    assert allocate_microbatch(rows, [6, 6], 6, block=2) == (5, 1)
    with pytest.raises(ConfigError, match="block"):
        allocate_microbatch(linear, [6, 6], 6, block=0)


# -- the cost model ----------------------------------------------------------------------


def test_estimate_matches_the_textbook_pipeline_and_the_simulator() -> None:
    # 3 equal stages, free links: (M + S - 1) (F + B) (eq. 4-6), and the simulator agrees.
    steps_f = [1.0, 0.0, 1.0, 0.0, 1.0]
    steps_b = [2.0, 0.0, 2.0, 0.0, 2.0]
    assert estimate_round_s(steps_f, steps_b, [0.0] * 5, 4) == pytest.approx(18.0)
    # An all-reduce on the first stage starts after its last backward.
    assert estimate_round_s(steps_f, steps_b, [5.0, 0, 0, 0, 0], 4) == pytest.approx(23.0)
    profile = synthetic_profile(
        [1.0, 1.0, 1.0], [0, 0, 0], backward_times_s=[2.0, 2.0, 2.0], activation_bytes=[0, 0, 0]
    )
    cluster = ClusterSpec(tuple(ClusterDevice(f"d{k}") for k in range(3)))
    plan = plan_training(profile, cluster, microbatch_size=1, num_microbatches=4, algo="even")
    assert plan.predicted["estimate_round_s"] == pytest.approx(18.0)
    assert plan.predicted["round_s"] == pytest.approx(18.0)
    assert plan.predicted["samples_per_s"] == pytest.approx(4 / 18.0)


def test_interpolation_between_and_beyond_measured_sizes() -> None:
    table = at_batch_sizes([2, 4], [[2.0, 10.0], [6.0, 10.0]], 8)
    assert table[:, 0].tolist() == pytest.approx([0, 1, 2, 4, 6, 7.5, 9, 10.5, 12])
    assert table[:, 1].tolist() == pytest.approx([0, 5, 10, 10, 10, 12.5, 15, 17.5, 20])


def test_memory_model_counts_optimizer_state_and_warmup() -> None:
    profile = synthetic_profile(
        [1.0, 1.0],
        [0, 0],
        param_bytes=[100, 50],
        backward_times_s=[1.0, 1.0],
        activation_bytes=[10, 20],
    )
    cluster = ClusterSpec((ClusterDevice("a", memory_bytes=1000, speed=0.5),))
    for optimizer, copies, step_copies in (("sgd", 0, 0), ("sgd-momentum", 1, 1), ("adam", 2, 0)):
        costs = TrainingCosts(profile, cluster, microbatch_size=4, optimizer=optimizer)
        # eq. 3: weights + gradients + optimizer copies, plus K x activations at the share,
        # plus the step's temporaries (copies of the weights; none for Adam's fused step;
        # this profile's forward needs nothing)
        step = step_copies * 150
        assert costs.memory_bytes(0, 2, 4, 3) == (2 + copies) * 150 + 3 * 4 * 30 + step
        assert costs.forward_s(cluster.devices[0], 0, 2, 4) == pytest.approx(16.0)
    costs = TrainingCosts(profile, cluster, microbatch_size=4, optimizer="sgd")
    # (1000 - 300) / (2 x 30 per sample) -> 11 samples fit, capped at the micro-batch
    assert costs.max_share(cluster.devices[0], 0, 2, 2) == 4
    assert costs.max_share(cluster.devices[0], 0, 2, 5) == 4
    costs = TrainingCosts(profile, cluster, microbatch_size=4, optimizer="adam")
    # 1000 - 600 of weights, gradients and moments leaves 400 for K x 30 per sample
    assert costs.max_share(cluster.devices[0], 0, 2, 2) == 4  # 6 fit, capped at 4
    assert costs.max_share(cluster.devices[0], 0, 2, 5) == 2
    with pytest.raises(ConfigError, match="unknown optimizer"):
        TrainingCosts(profile, cluster, microbatch_size=4, optimizer="lion")


def test_allreduce_uses_the_slowest_link_of_the_ring() -> None:
    profile = synthetic_profile(
        [1.0], [0], param_bytes=[10 * MB], backward_times_s=[1.0], activation_bytes=[0]
    )
    devices = tuple(ClusterDevice(f"d{k}", bandwidth_mbps=1000) for k in range(4))
    cluster = ClusterSpec(devices, links={("d1", "d2"): ClusterLink(bandwidth_mbps=100)})
    costs = TrainingCosts(profile, cluster, microbatch_size=1)
    # eq. 5: 2 (n - 1) / n x 80 Mbit over the 100 Mbit/s link
    assert costs.allreduce_s(["d0", "d1", "d2", "d3"], 0, 1) == pytest.approx(1.5 * 0.8)
    assert costs.allreduce_s(["d0"], 0, 1) == 0.0


def test_a_device_with_its_own_profile_uses_its_own_times() -> None:
    model = synthetic_profile(
        [1.0, 2.0], [0, 0], backward_times_s=[3.0, 4.0], activation_bytes=[0, 0]
    )
    trained = synthetic_profile(
        [2.0, 2.0], [0, 0], backward_times_s=[5.0, 1.0], activation_bytes=[0, 0]
    )
    forward_only = synthetic_profile([2.0, 6.0], [0, 0])
    cluster = ClusterSpec(
        (
            ClusterDevice("own", profile=trained, speed=0.1),  # speed is ignored
            ClusterDevice("scaled", profile=forward_only),
            ClusterDevice("slow", speed=0.5),
        )
    )
    costs = TrainingCosts(model, cluster, microbatch_size=2)
    own, scaled, slow = cluster.devices
    assert costs.forward_s(own, 0, 2, 1) == pytest.approx(4.0)
    assert costs.backward_s(own, 0, 2, 1) == pytest.approx(6.0)
    # No backward measured on it: the model's, scaled by its forward's slowdown (2x, 3x).
    assert costs.backward_s(scaled, 0, 2, 1) == pytest.approx(3.0 * 2 + 4.0 * 3)
    assert costs.backward_s(slow, 0, 2, 2) == pytest.approx(2 * 7.0 / 0.5)


# -- plans ---------------------------------------------------------------------------------


def _small_case() -> tuple[ModelProfile, ClusterSpec]:
    profile = ModelProfile(
        batch_sizes=(1, 2, 4),
        units=tuple(
            UnitProfile(
                f"u{k}",
                2 * MB,
                (0.001, 0.0018, 0.0035),
                (MB, 2 * MB, 4 * MB),
                (0, 0, 0),
                (0.002, 0.0036, 0.007),
                (3 * MB, 6 * MB, 12 * MB),
            )
            for k in range(4)
        ),
        input_bytes=(MB, 2 * MB, 4 * MB),
    )
    cluster = ClusterSpec(
        (
            # 2 samples: 16 MB of weights and gradients, 24 MB saved, 2 MB of running input
            ClusterDevice("small", memory_bytes=42 * MB, speed=1.0, bandwidth_mbps=1000),
            ClusterDevice("big", memory_bytes=120 * MB, speed=0.5, bandwidth_mbps=1000),
            ClusterDevice("mid", memory_bytes=50 * MB, speed=1.0, bandwidth_mbps=1000),
        )
    )
    return profile, cluster


def test_training_plan_round_trips_and_refuses_malformed_input() -> None:
    profile, cluster = _small_case()
    plan = plan_training(profile, cluster, microbatch_size=4, num_microbatches=4)
    data = json.loads(json.dumps(plan.to_dict()))
    assert TrainingPlan.from_dict(data) == plan
    assert "round_s" in plan.predicted and "samples_per_s" in plan.predicted
    assert all(f"stage{i}_memory_bytes" in plan.predicted for i in range(plan.num_stages))
    assert "stage" in plan.describe([u.name for u in profile.units])

    good = {
        "algo": "hpp",
        "schedule": "1f1b",
        "num_units": 4,
        "microbatch_size": 4,
        "num_microbatches": 3,
        "stages": [
            {"devices": ["a", "b"], "start": 0, "end": 2, "shares": [3, 1], "warmup": 3},
            {"devices": ["c"], "start": 2, "end": 4, "shares": [4], "warmup": 1},
        ],
    }
    TrainingPlan.from_dict(good)
    broken: list[tuple[str, object, str]] = [
        ("shares", [3, 2], "sum to 5"),
        ("shares", [4], "one share per device"),
        ("shares", [5, -1], "integers >= 0"),
        ("devices", ["a", "c"], "appears in stage 0 and stage 1"),
        ("devices", [], "one or more"),
        ("warmup", 0, "warmup must be in 1..3"),
        ("warmup", 4, "warmup must be in 1..3"),
        ("warmup", True, "integer"),
        ("end", 1, "starts at unit 2, expected 1"),
        ("start", 1, "starts at unit 1, expected 0"),
    ]
    for key, value, message in broken:
        bad = json.loads(json.dumps(good))
        bad["stages"][0][key] = value
        with pytest.raises(ConfigError, match=message):
            TrainingPlan.from_dict(bad)
    for key, value, message in [
        ("schedule", "zigzag", "unknown schedule"),
        ("num_units", 5, "cover units"),
        ("num_microbatches", 0, "num_microbatches must be"),
        ("stages", "x", "stages must be a list"),
    ]:
        bad = dict(good, **{key: value})
        with pytest.raises(ConfigError, match=message):
            TrainingPlan.from_dict(bad)
    with pytest.raises(ConfigError, match="missing key 'stages'"):
        TrainingPlan.from_dict({k: v for k, v in good.items() if k != "stages"})
    gpipe = dict(good, schedule="gpipe")
    with pytest.raises(ConfigError, match="gpipe runs all 3 forwards"):
        TrainingPlan.from_dict(gpipe)
    with pytest.raises(ConfigError, match="a device serves one stage"):
        TrainingPlan("x", "1f1b", 1, 1, 1, (TrainStage(("a", "a"), 0, 1, (1, 0), 1),))


def test_hpp_groups_devices_and_respects_memory_in_order() -> None:
    profile, cluster = _small_case()
    plan = plan_training(profile, cluster, microbatch_size=4, num_microbatches=4)
    assert plan.algo == "hpp" and plan.schedule == "1f1b"
    # Memory order is big, mid, small; big is half as fast, so the best plan skips it and
    # trains data-parallel on the two fast devices.
    assert [(s.devices, s.shares) for s in plan.stages] == [(("mid", "small"), (2, 2))]
    for stage in plan.stages:
        assert sum(stage.shares) == 4
    assert plan.predicted["memory_violations"] == 0
    gpipe = plan_training(profile, cluster, microbatch_size=2, num_microbatches=2, schedule="gpipe")
    assert gpipe.warmups == [2] * gpipe.num_stages


def test_infeasible_plans_say_by_how_much() -> None:
    profile, cluster = _small_case()
    tiny = ClusterSpec(tuple(ClusterDevice(f"t{k}", memory_bytes=5 * MB) for k in range(3)))
    # 4 units x 2 MB x (2 + 2 adam copies) = 32 MB of state alone, 15 MB held.
    for algo in ("hpp", "straight", "data-parallel"):
        with pytest.raises(InfeasiblePlanError, match=r"MB short"):
            plan_training(
                profile, tiny, microbatch_size=1, num_microbatches=2, algo=algo, optimizer="adam"
            )
    with pytest.raises(InfeasiblePlanError, match=r"short: use the hpp planner"):
        plan_training(profile, cluster, microbatch_size=4, num_microbatches=8, algo="even")
    # 60 MB held together (Adam's step takes 16 MB more than its state at peak)
    one_unit_too_big = ClusterSpec(
        tuple(ClusterDevice(f"t{k}", memory_bytes=7_500_000) for k in range(8))
    )
    with pytest.raises(InfeasiblePlanError, match=r"unit 0 \(u0\) alone needs 8.0 MB"):
        plan_training(
            profile, one_unit_too_big, microbatch_size=1, num_microbatches=1, optimizer="adam"
        )


def test_plan_training_checks_its_arguments() -> None:
    profile, cluster = _small_case()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"algo": "best"}, "unknown training planner"),
        ({"schedule": "zigzag"}, "unknown schedule"),
        ({"num_microbatches": 0}, "num_microbatches must be >= 1"),
        ({"microbatch_size": 0}, "microbatch_size must be >= 1"),
        ({"devices": ["nope"]}, "no device 'nope'"),
    ]
    for kwargs, message in cases:
        args: dict[str, Any] = {"microbatch_size": 2, "num_microbatches": 2, **kwargs}
        with pytest.raises(ConfigError, match=message):
            plan_training(profile, cluster, **args)
    forward_only = synthetic_profile([1.0], [1])
    with pytest.raises(ConfigError, match="profile with --train"):
        plan_training(forward_only, cluster, microbatch_size=1, num_microbatches=1)


def _straight_round(
    profile: ModelProfile, cluster: ClusterSpec, size: int, order: Sequence[str]
) -> TrainingPlan | None:
    try:
        return plan_training(
            profile,
            cluster,
            microbatch_size=size,
            num_microbatches=4,
            algo="straight",
            devices=order,
        )
    except InfeasiblePlanError:
        return None


def test_ecofl_search_takes_the_largest_microbatch_an_order_can_hold() -> None:
    profile, cluster = _small_case()
    plan = search_microbatch_and_order(profile, cluster, num_microbatches=4)
    # Brute force: sizes from the largest down, every order; the first size with an order
    # whose stages hold Eco-FL's P_s, and the least estimated round among those orders.
    for size in sorted(profile.batch_sizes, reverse=True):
        plans = [
            p
            for order in itertools.permutations(cluster.names)
            if (p := _straight_round(profile, cluster, size, order)) is not None
        ]
        free = [p for p in plans if p.predicted["ddb_free"] == 1.0]
        if free:
            break
    assert free, "the instance should have a DDB-free order"
    assert plan.microbatch_size == size
    assert plan.predicted["ddb_free"] == 1.0
    best = min(p.predicted["estimate_round_s"] for p in free)
    assert plan.predicted["estimate_round_s"] == pytest.approx(best)
    stage_f = [plan.predicted[f"stage{i}_forward_s"] for i in range(plan.num_stages)]
    stage_b = [plan.predicted[f"stage{i}_backward_s"] for i in range(plan.num_stages)]
    send_f = [plan.predicted[f"stage{i}_send_forward_s"] for i in range(plan.num_stages)]
    send_b = [plan.predicted[f"stage{i}_send_backward_s"] for i in range(plan.num_stages)]
    assert plan.warmups == ecofl_warmup(stage_f, stage_b, send_f, send_b, 4)
    assert size < max(profile.batch_sizes)  # memory forced a smaller micro-batch here


def test_plan_command_plans_training(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile, cluster = _small_case()
    profile_path, cluster_path, out = tmp_path / "p.json", tmp_path / "c.json", tmp_path / "t.json"
    profile.save(profile_path)
    cluster_path.write_text(json.dumps(cluster.to_dict()))
    args = ["--train", "--profile", str(profile_path), "--cluster", str(cluster_path)]
    assert plan_main([*args, "--microbatch-size", "2", "--json", str(out), "--compare"]) == 0
    printed = capsys.readouterr().out
    assert "hpp (1f1b)" in printed and "straight (1f1b)" in printed
    plan = TrainingPlan.from_dict(json.loads(out.read_text()))
    assert plan.algo == "hpp" and plan.microbatch_size == 2 and plan.num_microbatches == 8
    assert plan_main([*args, "--algo", "straight", "--search", "--json", "-"]) == 0
    assert '"algo": "straight"' in capsys.readouterr().out
    gpipe = ["--schedule", "gpipe", "--optimizer", "adam", "--microbatches", "2"]
    assert plan_main([*args, *gpipe]) == 0
    with pytest.raises(SystemExit):
        plan_main([*args, "--algo", "pipeedge"])
    assert "plans inference" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan_main(["--profile", str(profile_path), "--cluster", str(cluster_path), "--algo", "hpp"])
    assert "add --train" in capsys.readouterr().err
    forward_only = tmp_path / "f.json"
    synthetic_profile([1.0] * 4, [1] * 4).save(forward_only)
    untrained = ["--train", "--profile", str(forward_only), "--cluster", str(cluster_path)]
    assert plan_main(untrained) == 1
    assert "profile with --train" in capsys.readouterr().err


def test_a_problem_too_large_to_plan_exactly_is_refused_with_advice() -> None:
    units = 1000
    profile = synthetic_profile(
        [0.001] * units, [1000] * units, backward_times_s=[0.002] * units,
        activation_bytes=[1000] * units,
    )  # fmt: skip
    cluster = ClusterSpec(tuple(ClusterDevice(f"d{k}") for k in range(8)))
    with pytest.raises(ConfigError, match=r"too many to finish.*coarser units"):
        plan_training(profile, cluster, microbatch_size=1, num_microbatches=2)
