"""bench/training_async.py's bounds (eq. 5 on equal units) and a look's pause in parts."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from bench._look_pauses import pause_parts
from bench._repartition_bounds import (
    Setup,
    after_change,
    even_bounds,
    fitted_phase_bound,
    phase_bound,
    residual_unit_weights,
    run_bound,
    time_to_step,
)

CAPS = [4.0, 8.0, 20.0, 40.0]


def test_even_cuts_give_the_rest_to_the_last_stage() -> None:
    assert even_bounds(12, 4) == [0, 3, 6, 9, 12]
    assert even_bounds(14, 4) == [0, 3, 6, 9, 14]


def test_twelve_units_cap_the_gain_at_three_then_two_when_the_best_slows() -> None:
    before = phase_bound(CAPS, 12)
    # even: 3 units on the 40x device; best: 7, 3, 1, 1 units -> max(28, 24, 20, 40)
    assert (before.even_period, before.best_period) == (120.0, 40.0)
    assert before.best_bounds == (0, 7, 10, 11, 12)
    assert before.ratio == pytest.approx(3.0)
    after = phase_bound(after_change(CAPS, 0), 12)
    assert after.ratio == pytest.approx(2.0)
    # more units let the cuts follow the speeds more closely, never past a continuous split
    continuous = sum(1 / c for c in CAPS) * max(CAPS)  # 4.5
    assert 3.0 < phase_bound(CAPS, 16).ratio <= continuous
    # a middle device turning slow makes a straggler the even cuts cannot leave
    assert phase_bound(after_change(CAPS, 1), 16).ratio == pytest.approx(4.0)


def test_a_run_bound_follows_both_pipelines_through_the_change() -> None:
    assert time_to_step(10, before_s=1.0, after_s=3.0, change_s=20.0) == 10.0
    assert time_to_step(10, before_s=1.0, after_s=3.0, change_s=4.0) == pytest.approx(22.0)
    setup = Setup("s", 12, 0, 100, change_s=1.0)
    before, after, bound = run_bound(CAPS, setup, unit_s=0.001, step=100)
    # PipeDream: 1 s at 0.12 s, the rest at 0.12 s (its bottleneck does not change);
    # FTPipeHD: 1 s at 0.04 s (25 steps), 75 steps at 0.06 s
    assert (before.ratio, after.ratio) == (pytest.approx(3.0), pytest.approx(2.0))
    assert bound == pytest.approx(12.0 / (1.0 + 75 * 0.06))


def _line(event: str, at: float, **fields: object) -> str:
    stamp = datetime.fromtimestamp(at, tz=UTC).isoformat().replace("+00:00", "Z")
    return json.dumps({"event": event, "timestamp": stamp, "step": 5, **fields})


def test_a_pause_is_split_by_its_events_stamps() -> None:
    t = 1_800_000_000.0
    logs = {
        "coordinator": "\n".join(
            [
                _line("repartition_started", t + 0.01),
                _line("repartition_considered", t + 0.31),
                _line("repartition_fetching", t + 0.33),
                _line("repartition_started", t + 9.0, step=25),  # another look
            ]
        ),
        "d0": "\n".join(
            [
                "not json",
                _line("repartition_prepared", t + 0.2, flush_wait_s=0.15, snapshot_s=0.01),
                _line("repartition_fetched", t + 0.4),
                _line("repartition_committed", t + 0.45, regroup_s=0.03),
            ]
        ),
        "d1": "\n".join(
            [
                _line("repartition_prepared", t + 0.3, flush_wait_s=0.28, snapshot_s=0.02),
                _line("repartition_fetched", t + 0.5),
                _line("repartition_committed", t + 0.52, regroup_s=0.01),
            ]
        ),
    }
    parts = pause_parts(logs, 5, t, t + 0.7)
    assert parts == {
        "request_s": 0.01,
        "prepare_s": 0.29,
        "look_s": 0.01,
        "allow_s": 0.02,
        "fetch_s": 0.17,
        "commit_s": 0.02,
        "resume_s": 0.18,
        "flush_wait_max_s": 0.28,
        "snapshot_max_s": 0.02,
        "regroup_max_s": 0.03,
    }
    assert pause_parts(logs, 7, t, t + 1.0) == {}  # no events of that look


def test_a_look_before_the_pause_is_split_from_the_move() -> None:
    t = 1_800_000_000.0
    logs = {
        "coordinator": "\n".join(
            [
                _line("repartition_started", t + 0.01, flush=False),
                _line("repartition_considered", t + 0.06, flush=False),
                _line("repartition_started", t + 0.5),
                _line("repartition_considered", t + 0.9),
            ]
        ),
        "d0": _line("repartition_prepared", t + 0.8, flush_wait_s=0.2, snapshot_s=0.01),
    }
    parts = pause_parts(logs, 5, t, t + 1.2)
    assert parts["look_before_s"] == 0.05  # the look, while the pipeline ran
    assert parts["drain_s"] == 0.44  # its answer to the move's request: the pause, the drain
    assert parts["request_s"] == 0.5 and parts["prepare_s"] == 0.3 and parts["look_s"] == 0.1


def test_a_stages_own_cost_lowers_the_bound() -> None:
    caps = [4.0, 80.0, 20.0, 40.0]
    plain = phase_bound(caps, 12)
    assert fitted_phase_bound(caps, [0.0] * 4, 12) == plain
    # 1.3 ms of its own per batch against 0.45 ms per unit, both times the slowdown:
    # the 80x device pays 104 ms even at one unit, against 212 ms at the even three
    fitted = fitted_phase_bound([0.45 * c for c in caps], [1.3 * c for c in caps], 12)
    assert fitted.ratio == pytest.approx((1.3 + 3 * 0.45) / (1.3 + 0.45))
    assert fitted.ratio < plain.ratio


def test_a_residual_mlps_units_are_costed_by_their_multiply_adds() -> None:
    weights = residual_unit_weights([64, 256, 256, 256, 10])
    # 64 x 256, two blocks of 2 x 256 x 256, 256 x 10 (the last unit is a Linear)
    assert weights == pytest.approx((0.125, 1.0, 1.0, 10 / 512))
    setup = Setup("r", 4, 1, 10, 1.0, residual=True, weights=weights)
    assert setup.reference() == list(weights)
    with pytest.raises(ValueError):
        Setup("r", 5, 1, 10, 1.0, weights=weights).reference()
    # 24 units, the middle device slowing: the bounds the headline's set-up leaves
    r24 = list(residual_unit_weights([64, *[256] * 23, 10]))
    before = phase_bound(CAPS, 24, r24)
    after = phase_bound(after_change(CAPS, 1), 24, r24)
    assert before.ratio > 3.5 and after.ratio == pytest.approx(6.0)
    # most of a run lies after the change: its bound passes 4
    r24_middle = Setup("r24_middle", 24, 1, 200, 6.0, residual=True, weights=tuple(r24))
    assert run_bound(CAPS, r24_middle, unit_s=0.001, step=200)[2] > 4.0
    # light first and last units lower the even cuts' period below equal units'
    assert before.even_period < phase_bound(CAPS, 24).even_period


def test_the_headline_is_a_learning_middle_set_up_with_the_most_units() -> None:
    from bench._repartition_setups import headline_setup

    def result(units: int, slowing: int, learned: bool, ratio: float) -> dict[str, object]:
        kind = "time_to_loss" if learned else "time_to_last_step"
        return {"units": units, "slowing_index": slowing, "ratio_kind": kind, "ratio": ratio}

    results = {
        "u12_best": result(12, 0, True, 9.0),
        "u12_middle": result(12, 1, True, 1.5),
        "u16_middle": result(16, 1, False, 5.0),
        "r16_middle": result(16, 1, True, 2.0),
        "r24_middle": result(24, 1, True, 1.0),
    }
    # not the largest number: the rule
    assert headline_setup(results) == "r24_middle"
    results["r24_middle"] = result(24, 1, False, 1.0)
    assert headline_setup(results) == "r16_middle"
    assert headline_setup({k: results[k] for k in ("u12_best", "u12_middle")}) == "u12_middle"
    assert headline_setup({"u16_middle": results["u16_middle"]}) == "u16_middle"
    assert headline_setup({}) is None


def test_a_stages_own_cost_lowers_the_bound_and_none_leaves_it() -> None:
    assert phase_bound(CAPS, 12, fixed_units=0.0) == phase_bound(CAPS, 12)
    # u12_middle after the change: even 3 units each, the 80x device pays 80 * (3 + 3);
    # at best it holds one unit and pays 80 * (3 + 1): no cut does better than 1.5
    after = phase_bound(after_change(CAPS, 1), 12, fixed_units=3.0)
    assert after.even_period == pytest.approx(480.0)
    assert after.best_period == pytest.approx(320.0)
    assert after.ratio == pytest.approx(1.5)
    setup = Setup("u12_middle", 12, 1, 160, 6.0)
    plain = run_bound(CAPS, setup, unit_s=0.001, step=150)[2]
    fixed = run_bound(CAPS, setup, unit_s=0.001, step=150, fixed_units=3.0)[2]
    assert 1.0 < fixed < plain


def test_the_fixed_cost_in_units_is_the_median_over_the_looks_that_fitted_one() -> None:
    from bench._repartition_setups import fixed_units_of

    def look(phi: float, r: float) -> dict[str, object]:
        # capacities 1 and 2, two units each: the period is b's 2 * (phi + 2 r)
        return {"capacities": {"a": 1.0, "b": 2.0}, "fixed_s": {"a": phi, "b": 2 * phi},
                "current": [0, 2, 4], "period_s": 2 * phi + 2 * 2 * r}  # fmt: skip

    unfitted = {"capacities": {"a": 1.0, "b": 2.0}, "fixed_s": {"a": 0.0, "b": 0.0},
                "current": [0, 2, 4], "period_s": 4.0}  # fmt: skip
    assert fixed_units_of([unfitted], ["a", "b"]) is None
    assert (
        fixed_units_of([look(3.0, 1.0), unfitted, look(1.0, 0.5), look(9.0, 1.0)], ["a", "b"])
        == 3.0
    )


def test_a_bound_with_leave_out_uses_the_runs_dp_and_is_never_below_keeping_everyone() -> None:
    # u12_middle after the change with a stage's own cost of 3 units: keeping the 80x
    # device costs it 80 * (3 + 1) at best; leaving it out, the other three share 12
    after = phase_bound(after_change(CAPS, 1), 12, fixed_units=3.0)
    left = phase_bound(after_change(CAPS, 1), 12, fixed_units=3.0, leave_out=True)
    assert left.even_period == after.even_period
    assert len(left.best_bounds) == 4 and left.best_period < after.best_period
    assert left.ratio > after.ratio
    # the first and last devices are never left out (the run's DP keeps its ends)
    slow_first = phase_bound([400.0, 8.0, 20.0, 40.0], 12, fixed_units=3.0, leave_out=True)
    assert len(slow_first.best_bounds) == 5
    # a look after a leave-out names the devices kept only: still read
    from bench._repartition_setups import fixed_units_of

    kept = {"capacities": {"a": 1.0, "c": 2.0}, "fixed_s": {"a": 3.0, "c": 6.0},
            "current": [0, 2, 4], "period_s": 2 * 3.0 + 2 * 2 * 1.0}  # fmt: skip
    assert fixed_units_of([kept], ["a", "b", "c"]) == 3.0
