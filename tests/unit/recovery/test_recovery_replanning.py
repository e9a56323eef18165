"""Re-planning after a failure: lightweight (Asteroid), heavy (full planners), ResPipe."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zpipe._errors import ConfigError
from zpipe.planner.cluster import ClusterDevice, ClusterLink, ClusterSpec
from zpipe.planner.hpp import plan_training
from zpipe.planner.pipeedge import plan_pipeedge
from zpipe.planner.plan import Plan, plan_from_partition
from zpipe.planner.profile import synthetic_profile
from zpipe.planner.training_plan import TrainingPlan, TrainStage
from zpipe.recovery.errors import RecoveryError
from zpipe.recovery.redistribution import Replica, plan_redistribution
from zpipe.recovery.replanning import (
    heavy_replan_inference,
    heavy_replan_training,
    lightweight_replan,
    rebalance_boundaries,
    respipe_replan,
    stage_work,
    surviving_cluster,
    unit_work_from_profile,
)


def ranges_of(plan: Plan | TrainingPlan) -> list[tuple[int, int]]:
    return [(s.start, s.end) for s in plan.stages]


def training_plan(groups, bounds, shares, warmups, m=4) -> TrainingPlan:
    stages = tuple(
        TrainStage(tuple(g), a, b, tuple(y), k)
        for g, (a, b), y, k in zip(groups, itertools.pairwise(bounds), shares, warmups, strict=True)
    )
    return TrainingPlan("hpp", "1f1b", bounds[-1], sum(shares[0]), m, stages)


# -- lightweight -----------------------------------------------------------------------------


def test_a_dead_last_stage_goes_to_its_neighbour_and_work_follows_capacity():
    # Asteroid Fig. 9: the last single-device stage D fails; A and B take over.
    plan = plan_from_partition(12, ["A", "B", "D"], [[0, 4], [4, 8], [8, 12]])
    new = lightweight_replan(plan, failed={"D"}, unit_work=[1.0] * 12, speeds={"A": 1, "B": 2})
    assert new.devices == ["A", "B"] and new.algo == "lightweight"
    assert ranges_of(new) == [(0, 4), (4, 12)]  # B, twice as fast, runs twice the work


def test_a_dead_middle_stage_is_split_between_both_neighbours():
    plan = plan_from_partition(9, ["a", "b", "c"], [[0, 3], [3, 6], [6, 9]])
    new = lightweight_replan(plan, failed={"b"}, unit_work=[1.0] * 9)
    assert ranges_of(new) in ([(0, 4), (4, 9)], [(0, 5), (5, 9)])
    assert max(stage_work(new, [1.0] * 9)) == 5.0


def test_with_no_failure_new_speeds_migrate_work_off_a_slowed_stage():
    # Eco-FL section 4.4: device 2 of three gets a load spike; it gives units to both sides.
    plan = plan_from_partition(12, ["x", "y", "z"], [[0, 4], [4, 8], [8, 12]])
    new = lightweight_replan(
        plan, failed=(), unit_work=[1.0] * 12, speeds={"x": 1, "y": 0.25, "z": 1}
    )
    assert new.devices == plan.devices
    speeds = {"x": 1, "y": 0.25, "z": 1}
    # In proportion: 5.3, 1.3 and 5.3 units; the least bottleneck (6) leaves y one unit.
    _, (y_start, y_end), _ = ranges_of(new)
    assert y_end - y_start == 1 and y_start in (5, 6)
    assert max(stage_work(new, [1.0] * 12, speeds)) == 6.0
    # Unchanged speeds keep the plan: nothing moves for nothing.
    same = lightweight_replan(plan, failed=(), unit_work=[1.0] * 12)
    assert ranges_of(same) == ranges_of(plan)


def test_units_move_only_to_adjacent_stages_even_when_a_farther_move_would_balance_better():
    # Stage c is very fast: balancing freely would hand it units from a, two stages away.
    plan = plan_from_partition(6, ["a", "b", "c"], [[0, 4], [4, 5], [5, 6]])
    new = lightweight_replan(
        plan, failed=(), unit_work=[1.0] * 6, speeds={"a": 1, "b": 1, "c": 100}
    )
    a, b, c = ranges_of(new)
    assert c[0] >= 4  # c draws only from b's old range and its own
    assert a[1] >= 0 and b[0] <= 5


def test_the_tie_break_moves_the_fewest_weight_bytes():
    plan = plan_from_partition(4, ["a", "b"], [[0, 2], [2, 4]])
    # Work 1, 0, 0, 1: boundaries 1, 2 and 3 all give the bottleneck 1; 2 moves nothing.
    new = lightweight_replan(plan, failed=(), unit_work=[1, 0, 0, 1])
    assert ranges_of(new) == [(0, 2), (2, 4)]
    # Work 0, 1, 1, 0 over a twice as fast a: boundaries 2 and 3 both give the bottleneck 1;
    # moving unit 2 to a costs its bytes, so a heavy unit 2 stays where it is.
    light = lightweight_replan(
        plan, failed=(), unit_work=[0, 1, 1, 0], speeds={"a": 2, "b": 1}, unit_bytes=[1, 1, 9, 1]
    )
    assert ranges_of(light) == [(0, 2), (2, 4)]
    # A slower b must give a unit up: the bottleneck comes first, bytes second.
    slow = lightweight_replan(
        plan, failed=(), unit_work=[1, 1, 1, 1], speeds={"a": 3, "b": 1}, unit_bytes=[1, 1, 9, 1]
    )
    assert ranges_of(slow) == [(0, 3), (3, 4)]


def test_training_group_losing_a_member_keeps_its_units_and_respreads_its_samples():
    plan = training_plan([["a", "b", "c"], ["d"]], [0, 5, 8], [[4, 3, 1], [8]], [3, 1])
    new = lightweight_replan(
        plan, failed={"b"}, unit_work=[1.0] * 8, speeds={"a": 1, "b": 1, "c": 1, "d": 2}
    )
    assert isinstance(new, TrainingPlan)
    first, _ = new.stages
    assert first.devices == ("a", "c") and sum(first.shares) == 8
    assert first.shares == (6, 2)  # b's 3 samples split by speed: 1.5 each, remainder to a
    assert [s.warmup for s in new.stages] == [3, 1]  # same depth: same warm-ups
    # Capacity a + c = 2 equals d's 2: the work splits evenly.
    assert ranges_of(new) == [(0, 4), (4, 8)]


def test_training_stage_lost_entirely_recomputes_warmups():
    plan = training_plan([["a"], ["b"], ["c"]], [0, 2, 4, 6], [[2], [2], [2]], [4, 3, 1])
    new = lightweight_replan(plan, failed={"a"}, unit_work=[1.0] * 6)
    assert [s.devices for s in new.stages] == [("b",), ("c",)]
    assert [s.warmup for s in new.stages] == [3, 1]  # Asteroid: min(2 (P - p) - 1, M)
    assert new.microbatch_size == 2 and new.num_microbatches == 4


def test_nothing_left_is_a_recovery_error():
    plan = plan_from_partition(4, ["a", "b"], [[0, 2], [2, 4]])
    with pytest.raises(RecoveryError, match="no stage survives"):
        lightweight_replan(plan, failed={"a", "b"}, unit_work=[1.0] * 4)
    with pytest.raises(RecoveryError):
        respipe_replan(plan, failed={"a", "b"})
    with pytest.raises(ConfigError, match="unit_work"):
        lightweight_replan(plan, failed=(), unit_work=[1.0] * 3)


def _brute_force(old, alive, caps, work, weights):
    """Every partition of the survivors obeying adjacency: (bottleneck, moved) -> ranges."""
    n = len(work)
    kept = [r for r, a in zip(old, alive, strict=True) if a]
    m = len(kept)
    best = None
    for cuts in itertools.combinations(range(1, n), m - 1):
        b = [0, *cuts, n]
        if any(not kept[j - 1][0] <= b[j] <= kept[j][1] for j in range(1, m)):
            continue
        bottleneck = max(sum(work[b[j] : b[j + 1]]) / caps[j] for j in range(m))
        moved = sum(
            weights[u]
            for j in range(m)
            for u in range(b[j], b[j + 1])
            if not kept[j][0] <= u < kept[j][1]
        )
        key = (round(bottleneck, 9), moved)
        if best is None or key < best[0]:
            best = (key, b)
    return best


@st.composite
def rebalance_cases(draw):
    n = draw(st.integers(2, 9))
    k = draw(st.integers(1, min(5, n)))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), min_size=k - 1, max_size=k - 1)))
    bounds = [0, *cuts, n]
    old = list(itertools.pairwise(bounds))
    alive = draw(st.lists(st.booleans(), min_size=k, max_size=k).filter(any))
    m = sum(alive)
    caps = draw(st.lists(st.integers(1, 4), min_size=m, max_size=m))
    work = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    weights = draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
    return old, alive, caps, work, weights


@settings(max_examples=120, deadline=None)
@given(rebalance_cases())
def test_lightweight_partition_is_the_least_bottleneck_then_fewest_bytes_under_adjacency(case):
    old, alive, caps, work, weights = case
    got = rebalance_boundaries(old, alive, [float(c) for c in caps], work, weights)
    (want_bottleneck, want_moved), _ = _brute_force(old, alive, caps, work, weights)
    kept = [r for r, a in zip(old, alive, strict=True) if a]
    assert got[0][0] == 0 and got[-1][1] == len(work)
    assert all(a < b for a, b in got) and all(x[1] == y[0] for x, y in itertools.pairwise(got))
    for j, (a, b) in enumerate(got):  # adjacent moves only
        lo = kept[j - 1][0] if j > 0 else 0
        hi = kept[j + 1][1] if j + 1 < len(kept) else len(work)
        assert lo <= a and b <= hi
    bottleneck = max(sum(work[a:b]) / c for (a, b), c in zip(got, caps, strict=True))
    moved = sum(
        weights[u]
        for j, (a, b) in enumerate(got)
        for u in range(a, b)
        if not kept[j][0] <= u < kept[j][1]
    )
    assert round(bottleneck, 9) == want_bottleneck
    assert moved == want_moved


# -- ResPipe -----------------------------------------------------------------------------------


def test_respipe_next_stage_takes_over_and_the_last_goes_back():
    plan = plan_from_partition(8, ["a", "b", "c", "d"], [[0, 2], [2, 4], [4, 6], [6, 8]])
    assert ranges_of(respipe_replan(plan, failed={"b"})) == [(0, 2), (2, 6), (6, 8)]
    assert respipe_replan(plan, failed={"b"}).devices == ["a", "c", "d"]
    assert ranges_of(respipe_replan(plan, failed={"d"})) == [(0, 2), (2, 4), (4, 8)]
    assert ranges_of(respipe_replan(plan, failed={"a"})) == [(0, 4), (4, 6), (6, 8)]
    two = respipe_replan(plan, failed={"b", "c"})
    assert two.devices == ["a", "d"] and ranges_of(two) == [(0, 2), (2, 8)]
    assert respipe_replan(plan, failed={"b"}).algo == "respipe"


def test_respipe_moves_fewest_weights_and_lightweight_balances_better():
    plan = plan_from_partition(8, ["a", "b", "c", "d"], [[0, 2], [2, 4], [4, 6], [6, 8]])
    work = [1.0] * 8
    res = respipe_replan(plan, failed={"b"})
    light = lightweight_replan(plan, failed={"b"}, unit_work=work)
    assert max(stage_work(light, work)) < max(stage_work(res, work))
    chain = [Replica("c", 2, 4, 0)]  # b's chain replica on c, as FTPipeHD keeps it
    moved = {
        name: plan_redistribution(plan, p, failed={"b"}, live_version=0, replicas=chain)
        for name, p in (("respipe", res), ("light", light))
    }
    assert moved["respipe"].units_moved == 0  # c holds b's units already
    assert moved["light"].units_moved > 0


# -- heavy -------------------------------------------------------------------------------------


def _inference_cluster() -> ClusterSpec:
    return ClusterSpec(
        (
            ClusterDevice("fast", speed=2.0, bandwidth_mbps=100),
            ClusterDevice("mid", speed=1.0, bandwidth_mbps=100),
            ClusterDevice("slow", speed=0.5, bandwidth_mbps=100),
        ),
        links={("fast", "mid"): ClusterLink(bandwidth_mbps=50), ("mid", "fast"): ClusterLink(50)},
    )


def test_heavy_inference_replans_with_pipeedge_over_the_survivors():
    profile = synthetic_profile([1.0, 2.0, 1.0, 3.0, 1.0, 2.0], [1000] * 6)
    cluster = _inference_cluster()
    new = heavy_replan_inference(profile, cluster, failed={"fast"}, batch_size=1)
    assert "fast" not in new.devices and new.algo == "pipeedge"
    survivors = ClusterSpec((cluster.device("mid"), cluster.device("slow")))
    assert new.stages == plan_pipeedge(profile, survivors, batch_size=1).stages
    left = surviving_cluster(cluster, {"fast"})
    assert left.names == ["mid", "slow"] and left.links == {}


def test_heavy_training_replans_with_hpp_over_the_survivors():
    n = 6
    profile = synthetic_profile(
        [1.0] * n,
        [1000] * n,
        param_bytes=[1000] * n,
        backward_times_s=[2.0] * n,
        activation_bytes=[100] * n,
        batch_size=4,
    )
    cluster = ClusterSpec(tuple(ClusterDevice(f"d{i}", bandwidth_mbps=1000) for i in range(4)))
    new = heavy_replan_training(
        profile, cluster, failed={"d1", "d2"}, microbatch_size=4, num_microbatches=4
    )
    assert set(new.devices) <= {"d0", "d3"} and new.algo == "hpp"
    want = plan_training(
        profile, surviving_cluster(cluster, {"d1", "d2"}), microbatch_size=4, num_microbatches=4
    )
    assert new == want
    assert unit_work_from_profile(profile, 4, training=True) == [3.0] * n
    assert unit_work_from_profile(profile, 4) == [1.0] * n
    with pytest.raises(RecoveryError, match="every device failed"):
        surviving_cluster(cluster, {"d0", "d1", "d2", "d3"})
