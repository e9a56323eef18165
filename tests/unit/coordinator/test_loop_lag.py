"""The loop-lag window tells a loop busy with its own work from one waiting for a core."""

from __future__ import annotations

import pytest

from zpipe.coordinator.loop_lag import LoopLag


def test_a_late_wake_carries_the_loops_own_cpu_time_beside_its_lateness() -> None:
    lag = LoopLag(report_every_s=10.0)
    assert lag.due(0.0) is None
    # 98 prompt wakes of 1 ms of work; one 120 ms late after 2 ms of work (it waited for
    # a core); one 80 ms late after 130 ms of work (the loop's own)
    for i in range(98):
        lag.woke(asked_at=float(i), woke_at=i + 0.001, busy_s=0.001)
    lag.woke(asked_at=98.0, woke_at=98.12, busy_s=0.002)
    lag.woke(asked_at=99.0, woke_at=99.08, busy_s=0.13)
    report = lag.due(10.0)
    assert report is not None
    fields = report.to_fields()
    assert fields["max_ms"] == pytest.approx(120.0)
    assert fields["busy_max_ms"] == pytest.approx(130.0)
    assert report.busy_p99_s == pytest.approx(0.13)
    assert report.p99_s == pytest.approx(0.12)
    assert lag.summary() is None  # the next window starts empty of both


def test_a_wake_reported_without_its_cpu_time_counts_none() -> None:
    lag = LoopLag()
    lag.woke(asked_at=0.0, woke_at=0.01)
    summary = lag.summary()
    assert summary is not None
    assert (summary.busy_p99_s, summary.busy_max_s) == (0.0, 0.0)
