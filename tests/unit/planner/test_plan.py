"""Plans as plain data: validation, even partitions, explicit partitions."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zpipe._errors import ConfigError
from zpipe.planner import Plan, StagePlan, even_ranges, plan_even_partition, plan_from_partition


@given(units=st.integers(1, 200), stages=st.integers(1, 50))
def test_even_ranges_cover_in_order_and_differ_by_at_most_one(units: int, stages: int) -> None:
    if stages > units:
        with pytest.raises(ConfigError, match="at most"):
            even_ranges(units, stages)
        return
    ranges = even_ranges(units, stages)
    assert ranges[0][0] == 0 and ranges[-1][1] == units
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    sizes = [e - s for s, e in ranges]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_plan_round_trips_through_json() -> None:
    plan = plan_even_partition(10, ["a", "b", "c"])
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan
    assert [s.num_units for s in again.stages] == [4, 3, 3]


@pytest.mark.parametrize(
    ("ranges", "fragment"),
    [
        ([[0, 3], [4, 10]], "contiguous"),
        ([[0, 3], [3, 3]], "empty"),
        ([[0, 3], [3, 9]], "cover units"),
        ([[1, 3], [3, 10]], "start at 0"),
        ([[0, 3]], "2 devices"),
        ([[0, 3, 5], [3, 10]], "must be"),
    ],
)
def test_bad_explicit_partitions_are_refused(ranges: list[list[int]], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        plan_from_partition(10, ["a", "b"], ranges)


def test_a_device_cannot_hold_two_stages() -> None:
    with pytest.raises(ConfigError, match="more than one stage"):
        Plan("x", 4, (StagePlan("a", 0, 2), StagePlan("a", 2, 4)))


def test_malformed_plan_dict_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="malformed plan"):
        Plan.from_dict({"algo": "even", "stages": [["a", 0]]})
