"""A stage's own cost per mini-batch in FTPipeHD's re-partition (eq. 5 with F_i + C_i R).

Pure: the fit of a fixed cost across looks (zpipe.training.stage_cost), the
planner's period with it (zpipe.planner.ftpipehd), and the controller's decisions
with and without it (zpipe.training.repartition).
"""

from __future__ import annotations

import itertools
import math

import pytest

from zpipe._errors import ConfigError
from zpipe.planner.ftpipehd import ftpipehd_partition
from zpipe.training.repartition import (
    RepartitionController,
    RepartitionSettings,
    decide_repartition,
)
from zpipe.training.stage_cost import StageCosts, fit_fixed_share


def counters(seconds: float, batches: int) -> dict[str, float]:
    return {"forward_s": seconds, "backward_s": 0.0, "step_s": 0.0, "microbatches": batches}


def brute_force(units: list[float], caps: list[float], fixed: list[float]) -> float:
    """The least period of ``max_i F_i + C_i * R_i`` over every cut with a unit each."""
    n, best = len(caps), math.inf
    for cuts in itertools.combinations(range(1, len(units)), n - 1):
        b = [0, *cuts, len(units)]
        period = max(fixed[i] + caps[i] * math.fsum(units[b[i] : b[i + 1]]) for i in range(n))
        best = min(best, period)
    return best


def test_the_fit_recovers_a_line_and_refuses_what_it_cannot_tell() -> None:
    # T = C (phi + R) with C = 3, phi = 2.5
    assert fit_fixed_share([(1.0, 10.5), (4.0, 19.5), (2.0, 13.5)]) == pytest.approx(2.5)
    assert fit_fixed_share([(3.0, 9.0)]) is None  # one look
    assert fit_fixed_share([(3.0, 9.0), (3.0, 12.0)]) is None  # one cut, twice
    assert fit_fixed_share([(1.0, 9.0), (3.0, 6.0)]) is None  # slower with less: noise
    assert fit_fixed_share([(1.0, 1.0), (3.0, 7.0)]) == 0.0  # negative intercept
    costs = StageCosts()
    costs.observe("a", 2.0, 8.0)
    assert costs.share() == 0.0
    costs.observe("a", 4.0, 12.0)  # C = 2, phi = 2
    assert costs.share() == pytest.approx(2.0)
    assert costs.capacity(4.0, 30.0) == pytest.approx(5.0)  # b: 30 s over 4 units
    costs.changed("a")
    assert costs.share() == pytest.approx(2.0) and "a" not in costs.points
    # a wild fit of one device (two noisy looks one unit apart) does not move the median
    costs.observe("b", 1.0, 15.0)
    costs.observe("b", 2.0, 15.5)  # phi 29
    costs.observe("c", 1.0, 3.0)
    costs.observe("c", 3.0, 5.0)  # phi 2
    assert costs.fitted["b"] == pytest.approx(29.0)
    assert costs.share() == pytest.approx(2.0)


def test_the_planner_costs_each_stage_its_own_cost_plus_its_units() -> None:
    units = [1.0, 2.0, 0.5, 1.5, 1.0, 3.0, 0.5, 1.0]
    caps, fixed = [2.0, 1.0, 4.0], [3.0, 0.5, 6.0]
    plan = ftpipehd_partition(units, capacities=caps, fixed_s=fixed)
    assert plan.period_s == pytest.approx(brute_force(units, caps, fixed))
    b = plan.bounds
    for i in range(3):
        assert plan.stage_s[i] == pytest.approx(fixed[i] + caps[i] * sum(units[b[i] : b[i + 1]]))
    # no fixed cost: eq. 7 exactly as before, cuts and period
    assert ftpipehd_partition(units, capacities=caps, fixed_s=[0.0] * 3) == ftpipehd_partition(
        units, capacities=caps
    )
    with pytest.raises(ConfigError):
        ftpipehd_partition(units, capacities=caps, fixed_s=[1.0])
    with pytest.raises(ConfigError):
        ftpipehd_partition(units, capacities=caps, fixed_s=[1.0, -1.0, 0.0])


def test_a_stage_with_a_large_fixed_cost_is_given_fewer_units() -> None:
    # two equal devices, 8 equal units; a pays 4 s per batch of its own:
    # max(4 + k, 8 - k) is least at k = 2 (6 s each), not at the even k = 4
    assert ftpipehd_partition([1.0] * 8, capacities=[1.0, 1.0]).bounds == (0, 4, 8)
    plan = ftpipehd_partition([1.0] * 8, capacities=[1.0, 1.0], fixed_s=[4.0, 0.0])
    assert plan.bounds == (0, 2, 8) and plan.period_s == 6.0


def test_a_device_whose_time_is_mostly_its_own_cost_is_given_more_units() -> None:
    """Two equal devices (C = 1) each paying 4 reference seconds per batch of their
    own, 8 units cut [0, 2, 8]: eq. 3 alone reads a (6 s over 2 units) as slower
    per unit than b (10 s over 6) and takes a unit from b to a; the next look, at a
    second cut, fits the fixed cost and gives the cuts the model's optimum."""
    phi, caps = 4.0, {"a": 1.0, "b": 1.0}
    controller = RepartitionController(
        RepartitionSettings(first=1, every=1, gain=0.05),
        devices=["a", "b"],
        bounds=[0, 2, 8],
        reference_unit_s=[1.0] * 8,
    )
    total = dict.fromkeys(caps, 0.0)

    def look(k: int, speed: dict[str, float] | None = None):  # type: ignore[no-untyped-def]
        b = controller.bounds
        for i, d in enumerate(caps):
            total[d] += 10 * (speed or caps)[d] * (phi + b[i + 1] - b[i])
        decision = controller.look(10 * k, {d: counters(total[d], 10 * k) for d in caps})
        if decision.moves:
            controller.committed(decision)
        return decision

    first = look(1)
    assert first.fixed_s == {"a": 0.0, "b": 0.0}  # one cut run: nothing to fit yet
    assert first.bounds == (0, 3, 8)
    second = look(2)
    assert second.fixed_s == {"a": pytest.approx(4.0), "b": pytest.approx(4.0)}
    assert second.capacities == {"a": pytest.approx(1.0), "b": pytest.approx(1.0)}
    # eq. 3 alone would stay at [0, 3, 8] (7/3 and 9/5 per unit); the model moves on
    old = decide_repartition(
        RepartitionSettings(gain=0.05),
        at=20,
        devices=["a", "b"],
        bounds=[0, 3, 8],
        reference_unit_s=[1.0] * 8,
        measured_s={"a": 7.0, "b": 9.0},
    )
    assert not old.moves
    assert second.bounds == (0, 4, 8)
    assert second.new_period_s == pytest.approx(brute_force([1.0] * 8, [1.0, 1.0], [4.0, 4.0]))
    assert second.period_s == pytest.approx(9.0)
    assert not look(3).moves  # the optimum holds
    # a becomes 10x slower: a real change, its fixed cost scaled with it at once
    slow = look(4, {"a": 10.0, "b": 1.0})
    assert slow.capacities["a"] == pytest.approx(10.0)
    assert slow.fixed_s["a"] == pytest.approx(40.0)
    assert slow.bounds == (0, 1, 8)  # 40 + 10 = 50 against 4 + 7 = 11: a keeps one unit


def test_with_no_fixed_cost_the_decisions_are_eq_3s() -> None:
    """Times exactly proportional to the units held (no cost of a stage's own):
    the fit finds none, every capacity is eqs. 1-2's, and every decision is the
    one eq. 5 makes on those capacities without any fixed cost."""
    devices = ["a", "b", "c"]
    speeds = [[1.0, 3.0, 2.0]] * 3 + [[6.0, 3.0, 2.0]] * 3
    controller = RepartitionController(
        RepartitionSettings(first=1, every=1, gain=0.05, smoothing=0.0),
        devices=devices,
        bounds=[0, 4, 8, 12],
        reference_unit_s=[1.0, 2.0, 1.0, 1.5, 1.0, 1.0, 0.5, 2.0, 1.0, 1.0, 1.5, 1.0],
    )
    ref = controller.reference_unit_s
    total = dict.fromkeys(devices, 0.0)
    moved = 0
    for k, speed in enumerate(speeds, start=1):
        b = controller.bounds
        for i, d in enumerate(devices):
            total[d] += 10 * speed[i] * math.fsum(ref[b[i] : b[i + 1]])
        decision = controller.look(10 * k, {d: counters(total[d], 10 * k) for d in devices})
        assert decision.fixed_s == dict.fromkeys(devices, 0.0)
        assert list(decision.capacities.values()) == pytest.approx(speed)
        plain = decide_repartition(
            RepartitionSettings(gain=0.05),
            at=10 * k,
            devices=devices,
            bounds=b,
            reference_unit_s=ref,
            capacities=decision.capacities,
            tried=dict(controller.tried),
        )
        assert (plain.bounds, plain.period_s, plain.new_period_s) == (
            decision.bounds,
            decision.period_s,
            decision.new_period_s,
        )
        if decision.moves:
            moved += 1
            controller.committed(decision)
    assert moved >= 2  # it did move, before and after the change


def test_one_look_slowed_by_load_does_not_tilt_the_fit() -> None:
    # T = 2.5 + R on four cuts; cut 2 measured once more while the host was loaded
    clean = [(1.0, 3.5), (2.0, 4.5), (3.0, 5.5), (4.0, 6.5)]
    assert fit_fixed_share([*clean, (2.0, 9.0)]) == pytest.approx(2.5)
    assert fit_fixed_share([*clean, (4.0, 2.0)]) == pytest.approx(2.5)


def test_a_fixed_cost_beyond_the_limit_is_taken_at_the_limit() -> None:
    costs = StageCosts(most=3.0)
    assert costs.share() == 0.0
    for units, seconds in ((1.0, 11.0), (2.0, 12.0)):  # phi 10
        costs.observe("a", units, seconds)
    assert costs.fitted["a"] == pytest.approx(10.0)
    assert costs.share() == 3.0
    assert costs.capacity(2.0, 10.0) == pytest.approx(2.0)
    # the controller's limit: an even stage's reference seconds
    controller = RepartitionController(
        RepartitionSettings(), devices=["a", "b"], bounds=[0, 4, 8], reference_unit_s=[0.5] * 8
    )
    assert controller.costs.most == pytest.approx(2.0)
