"""Eq. 5's link term in the live re-partition: a slow link, not compute, decides a cut
(pure; see :mod:`zpipe.training.repartition` and :mod:`zpipe.training.repartition_links`)."""

from __future__ import annotations

import math

import pytest

from zpipe._errors import ConfigError
from zpipe.planner import ClusterLink, ClusterSpec
from zpipe.planner.cluster import ClusterDevice
from zpipe.planner.profile import synthetic_profile
from zpipe.training.repartition import (
    RepartitionController,
    RepartitionSettings,
    decide_repartition,
)
from zpipe.training.repartition_links import boundary_bytes, link_bandwidths

DEVICES = ["a", "b", "c"]
CUTS = [0, 2, 4, 6]  # two units each: equal compute on equal devices
BIG = 4_000_000.0  # unit 1's output: what crosses the a|b cut at 2
SIZES = [1_000.0, BIG, 1_000.0, 1_000.0, 1_000.0, 1_000.0]
SLOW, FAST = 10e6, 1e9  # bytes per second: 2 x 4 MB over the slow link is 0.8 s
SETTINGS = RepartitionSettings(first=1, every=1, gain=0.1)


def counters(per_batch_s: float, batches: int) -> dict[str, float]:
    seconds = per_batch_s * batches
    return {"forward_s": seconds / 3, "backward_s": 2 * seconds / 3, "step_s": 0.0,
            "microbatches": batches}  # fmt: skip


def equal_compute(batches: int) -> dict[str, dict[str, float]]:
    """Every stage 0.1 s a unit, 2 units: 0.2 s a batch (the cuts are balanced)."""
    return {d: counters(0.2, batches) for d in DEVICES}


def test_a_slow_link_moves_a_cut_that_compute_alone_keeps() -> None:
    common = dict(at=10, devices=DEVICES, bounds=CUTS, reference_unit_s=[1.0] * 6)
    measured = {d: 0.2 for d in DEVICES}
    blind = decide_repartition(SETTINGS, measured_s=measured, **common)
    assert not blind.moves and blind.reason == "the best cuts are the current ones"
    # the same compute, the a-b link slow: 2 x 4 MB / 10 MB/s = 0.8 s a batch at cut 2
    seen = decide_repartition(
        SETTINGS, measured_s=measured, output_bytes=SIZES, bandwidths_bps=[SLOW, FAST], **common
    )
    assert seen.moves and seen.bounds is not None
    assert seen.period_s == pytest.approx(0.8)  # the link, not compute, sets the period
    assert seen.new_period_s == pytest.approx(0.3)  # three units on one stage
    assert seen.bounds[1] != 2  # the big activation does not cross a-b
    # the same link slow between b and c: the cut at 2 stays where the fast link is
    other = decide_repartition(
        SETTINGS, measured_s=measured, output_bytes=SIZES, bandwidths_bps=[FAST, SLOW], **common
    )
    assert not other.moves


def test_the_controller_sees_a_link_that_slows_between_looks() -> None:
    controller = RepartitionController(
        SETTINGS,
        devices=DEVICES,
        bounds=CUTS,
        reference_unit_s=[1.0] * 6,
        output_bytes=SIZES,
        bandwidths_bps=[FAST, FAST],
    )
    total = dict.fromkeys(DEVICES, 0.0)

    def window(at: int) -> dict[str, dict[str, float]]:
        """10 more batches at 0.1 s a unit on every device, on the current cuts."""
        b = controller.bounds
        for i, d in enumerate(DEVICES):
            total[d] += 10 * 0.1 * (b[i + 1] - b[i])
        return {d: counters(total[d] / at, at) for d in DEVICES}

    first = controller.look(10, window(10))
    assert not first.moves
    # the links probed again since: a-b is now slow; compute is what it was
    second = controller.look(20, window(20), bandwidths_bps=[SLOW, FAST])
    assert second.moves and second.bounds is not None and second.bounds[1] != 2
    assert second.measured and second.reason == "eq. 5 on measured capacities"
    controller.committed(second)
    # the link recovers: the balanced cuts measured 0.2 s of compute when run, and
    # their link is costed as it is now (fast), not as it was when they were left
    third = controller.look(30, window(30), bandwidths_bps=[FAST, FAST])
    assert third.bounds == tuple(CUTS)
    assert third.new_period_s == pytest.approx(0.2)


def test_without_link_information_the_controller_keeps_balanced_cuts() -> None:
    controller = RepartitionController(
        SETTINGS, devices=DEVICES, bounds=CUTS, reference_unit_s=[1.0] * 6
    )
    assert not controller.look(10, equal_compute(10)).moves
    with pytest.raises(ConfigError, match="no links to cost"):
        controller.look(20, equal_compute(20), bandwidths_bps=[SLOW, FAST])


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"output_bytes": SIZES}, "both boundary sizes and bandwidths"),
        ({"output_bytes": SIZES[:5], "bandwidths_bps": [FAST, FAST]}, "5 boundary sizes"),
        ({"output_bytes": SIZES, "bandwidths_bps": [FAST]}, "3 stages have 2 links"),
        ({"output_bytes": SIZES, "bandwidths_bps": [FAST, 0.0]}, "must be > 0"),
    ],
)
def test_bad_link_inputs_are_named(kwargs: dict[str, object], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        RepartitionController(
            SETTINGS,
            devices=DEVICES,
            bounds=CUTS,
            reference_unit_s=[1.0] * 6,
            **kwargs,  # type: ignore[arg-type]
        )


def test_boundary_bytes_are_the_profiled_outputs_at_the_micro_batch_size() -> None:
    profile = synthetic_profile([0.1] * 3, [10, 20, 30], batch_size=4)
    assert boundary_bytes(profile, 4) == [10.0, 20.0, 30.0]
    with pytest.raises(ConfigError, match="batch size 2 was not profiled"):
        boundary_bytes(profile, 2)


def test_link_bandwidths_combine_both_directions_in_bytes_per_second() -> None:
    cluster = ClusterSpec(
        devices=(
            ClusterDevice("a", bandwidth_mbps=80.0),
            ClusterDevice("b", bandwidth_mbps=800.0),
            ClusterDevice("c"),
        ),
        links={("a", "b"): ClusterLink(bandwidth_mbps=40.0), ("b", "a"): ClusterLink(120.0)},
    )
    a_b, b_c = link_bandwidths(["a", "b", "c"], cluster)
    # 2 x D / B = D / 40 Mbit/s + D / 120 Mbit/s: B = 60 Mbit/s = 7.5 MB/s
    assert a_b == pytest.approx(7.5e6)
    # no link given: the access links' smaller (800 Mbit/s; c is unlimited)
    assert b_c == pytest.approx(100e6)
    unlimited = ClusterSpec(devices=(ClusterDevice("x"), ClusterDevice("y")))
    assert link_bandwidths(["x", "y"], unlimited) == [math.inf]
