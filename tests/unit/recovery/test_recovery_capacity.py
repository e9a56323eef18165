"""FTPipeHD's capacity re-estimation (eqs. 1-3) and Eco-FL's deviation threshold."""

from __future__ import annotations

import pytest

from zpipe._errors import ConfigError
from zpipe.planner.capacity import (
    CapacityHistory,
    estimate_capacities,
    find_deviations,
    scaled_unit_times,
    speeds_from_capacities,
    speeds_from_cluster,
)
from zpipe.planner.cluster import ClusterDevice, ClusterSpec
from zpipe.planner.plan import plan_from_partition
from zpipe.planner.profile import synthetic_profile
from zpipe.recovery.replanning import lightweight_replan
from zpipe.recovery.spans import device_ranges, stage_spans

REFERENCE = [1.0, 2.0, 3.0, 4.0]


def test_capacity_is_measured_time_over_the_reference_time_of_the_same_units():
    caps = estimate_capacities({"a": 6.0, "b": 3.5}, {"a": (0, 2), "b": (2, 4)}, REFERENCE)
    assert caps == {"a": pytest.approx(2.0), "b": pytest.approx(0.5)}
    assert scaled_unit_times(REFERENCE[2:], caps["b"]) == [1.5, 2.0]  # eq. 3
    assert speeds_from_capacities(caps) == {"a": pytest.approx(0.5), "b": pytest.approx(2.0)}


def test_a_group_member_running_part_of_each_microbatch_did_part_of_the_work():
    caps = estimate_capacities({"a": 3.0}, {"a": (0, 2)}, REFERENCE, work_fraction={"a": 0.5})
    assert caps["a"] == pytest.approx(2.0)


def test_capacity_errors_name_the_device():
    with pytest.raises(ConfigError, match="'x' reported a time but runs no units"):
        estimate_capacities({"x": 1.0}, {}, REFERENCE)
    with pytest.raises(ConfigError, match="take no time"):
        estimate_capacities({"a": 1.0}, {"a": (0, 1)}, [0.0, 1.0])
    with pytest.raises(ConfigError, match="> 0 s"):
        estimate_capacities({"a": 0.0}, {"a": (0, 1)}, REFERENCE)
    with pytest.raises(ConfigError, match="outside"):
        estimate_capacities({"a": 1.0}, {"a": (2, 9)}, REFERENCE)


def test_deviation_beyond_the_threshold_in_either_direction():
    history = {"a": [1.0, 1.0, 1.1], "b": [2.0, 2.0, 2.0], "c": [1.0, 1.0]}
    found = find_deviations({"a": 1.2, "b": 1.0, "c": 5.0}, history, threshold=0.25)
    assert [d.device for d in found] == ["b"]  # a within 25 %; c too little history
    assert not found[0].slower and found[0].ratio == pytest.approx(0.5)
    found = find_deviations({"a": 1.5, "b": 2.6}, history, threshold=0.25)
    assert [d.device for d in found] == ["a", "b"]  # largest first: 1.5x, then 1.3x
    assert all(d.slower for d in found)


def test_a_change_of_regime_is_reported_once():
    history = CapacityHistory(window=5, threshold=0.25, min_history=3)
    for _ in range(3):
        assert history.update({"a": 1.0, "b": 1.0}) == []
    spike = history.update({"a": 3.0, "b": 1.05})
    assert [(d.device, d.ratio) for d in spike] == [("a", pytest.approx(3.0))]
    for _ in range(5):  # the migration answered it; the same level is the new normal
        assert history.update({"a": 3.0, "b": 1.0}) == []
    back = history.update({"a": 1.0, "b": 1.0})
    assert [d.device for d in back] == ["a"] and not back[0].slower
    history.forget("b")
    assert history.history("b") == []


def test_measured_slowdown_feeds_lightweight_rebalancing():
    # Eco-FL Fig. 13: device y of three gets a load spike; FTPipeHD's capacities say 3x.
    plan = plan_from_partition(12, ["x", "y", "z"], [[0, 4], [4, 8], [8, 12]])
    reference = [1.0] * 12
    ranges = device_ranges(stage_spans(plan))
    caps = estimate_capacities({"x": 4.0, "y": 12.0, "z": 4.0}, ranges, reference)
    new = lightweight_replan(
        plan, failed=(), unit_work=reference, speeds=speeds_from_capacities(caps)
    )
    sizes = [s.num_units for s in new.stages]
    assert sizes[1] < 4 and sum(sizes) == 12
    assert sizes[1] == 2  # 12 units over speeds 1, 1/3, 1: 5.1, 1.7, 5.1 -> bottleneck 6


def test_starting_speeds_come_from_own_profiles_or_declared_speeds():
    model = synthetic_profile([1.0, 1.0, 2.0], [10] * 3)
    slow_board = synthetic_profile([4.0, 4.0, 8.0], [10] * 3)
    cluster = ClusterSpec(
        (ClusterDevice("board", profile=slow_board), ClusterDevice("laptop", speed=2.0))
    )
    assert speeds_from_cluster(model, cluster, 1) == {
        "board": pytest.approx(0.25),
        "laptop": pytest.approx(2.0),
    }
