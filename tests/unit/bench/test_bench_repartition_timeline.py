"""bench/_repartition_timeline.py: a live re-partition run as phases (pure)."""

from __future__ import annotations

import pytest

from bench._repartition_timeline import repartition_timeline


def _arrivals(gaps: list[float]) -> list[float]:
    out, t = [], 1.0
    for gap in gaps:
        t += gap
        out.append(t)
    return out


def test_phases_detection_and_move_from_the_loss_times() -> None:
    # 20 losses every 0.1 s (a move before 5), the change after loss 19 (t 3.0),
    # 10 at 0.4 s on the old cuts, a look before 30 that moves (0.9 s pause), then 0.2 s
    gaps = [0.1] * 20 + [0.4] * 10 + [0.9] + [0.2] * 10
    times = _arrivals(gaps)
    change = times[19]
    looks = [{"at": 5, "moved": True}, {"at": 20, "moved": False}, {"at": 30, "moved": True}]
    out = repartition_timeline(times, looks, change, bound_periods_s=(0.05, 0.1))
    assert out["detect_at"] == 30
    assert out["before_s"] == pytest.approx(0.1)
    assert out["slow_s"] == pytest.approx(0.4)
    assert out["after_s"] == pytest.approx(0.2)
    assert out["detect_s"] == pytest.approx(4.0)  # ten slow losses
    assert out["move_s"] == pytest.approx(0.9)
    assert out["slow_batches"] == 10
    # the slow phase cost 4.0 s where the moved cuts take 2.0; the pause 0.7 beyond a period
    assert out["lost_s"] == pytest.approx(2.0 + 0.7)
    assert out["after_over_bound"] == pytest.approx(0.5)
    assert out["before_over_bound"] == pytest.approx(0.5)
    assert out["looks_after_change"] == 2  # the one at 20 kept the cuts


def test_a_change_no_move_answers_leaves_detection_open() -> None:
    times = _arrivals([0.1] * 10 + [0.4] * 10)
    out = repartition_timeline(times, [{"at": 5, "moved": False}], times[9])
    assert out["detect_at"] is None and out["detect_s"] is None and out["lost_s"] is None
    assert out["slow_s"] == pytest.approx(0.4)
    assert "after_over_bound" not in out


def test_a_drain_splits_detection_into_the_decision_and_the_losses_in_flight() -> None:
    # as above; the look that moved before 30 decided while the pipeline ran, 1.2 s
    # (three slow losses) before the loss it was asked after
    gaps = [0.1] * 20 + [0.4] * 10 + [0.9] + [0.2] * 10
    times = _arrivals(gaps)
    looks = [{"at": 5, "moved": True}, {"at": 30, "moved": True}]
    out = repartition_timeline(times, looks, times[19], drains={30: 1.2, 5: 0.3})
    assert out["detect_s"] == pytest.approx(4.0)
    assert out["drain_s"] == pytest.approx(1.2)
    assert out["decide_s"] == pytest.approx(2.8)
    assert out["decided_batches"] == 7
    assert "drain_s" not in repartition_timeline(times, looks, times[19])
