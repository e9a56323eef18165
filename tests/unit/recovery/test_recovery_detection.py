"""Adaptive deadlines: median + k * MAD over a window, a floor, a cold start; slow vs dead."""

from __future__ import annotations

import math

import pytest

from zpipe._errors import ConfigError
from zpipe.recovery.detection import (
    DeadlinePolicy,
    HeartbeatWatch,
    LatencyWindow,
    StallWatch,
    Verdict,
    adaptive_deadline,
    judge_wait,
)

POLICY = DeadlinePolicy(k=5.0, window=16, min_samples=4, floor_s=0.5, cold_start_s=60.0)


def test_cold_start_waits_long_until_enough_samples_exist():
    assert adaptive_deadline([], POLICY) == 60.0
    assert adaptive_deadline([1.0, 1.0, 1.0], POLICY) == 60.0
    # A model slower than the cold-start value is not killed by it.
    assert adaptive_deadline([30.0, 31.0], POLICY) == pytest.approx(93.0)
    assert adaptive_deadline([1.0] * 4, POLICY) < 60.0


def test_deadline_is_median_plus_k_mads():
    samples = [1.0, 2.0] * 4  # median 1.5, every deviation 0.5
    assert adaptive_deadline(samples, POLICY) == pytest.approx(1.5 + 5 * 0.5)


def test_identical_samples_still_leave_room_for_jitter():
    # MAD 0 would make the deadline the median itself; the relative floor keeps 5 %.
    assert adaptive_deadline([2.0] * 10, POLICY) == pytest.approx(2.0 + 5 * 0.1)


def test_one_stall_does_not_move_the_deadline():
    calm = adaptive_deadline([1.0] * 10, POLICY)
    assert adaptive_deadline([1.0] * 9 + [100.0], POLICY) == pytest.approx(calm)


def test_absolute_floor_for_fast_waits():
    assert adaptive_deadline([0.001] * 10, POLICY) == 0.5


def test_the_window_forgets_an_old_regime():
    window = LatencyWindow(POLICY, [1.0] * 16)
    assert window.deadline() == pytest.approx(1.25)
    for _ in range(16):
        window.observe(3.0)
    assert window.deadline() == pytest.approx(3.75)
    assert len(window.samples) == 16


def test_a_slow_device_is_told_from_a_dead_one_and_its_deadline_follows_it():
    window = LatencyWindow(POLICY, [1.0] * 16)
    # It now takes 2.5 s: late against 1.25 s. Still answering probes: slow, not dead.
    assert window.judge(2.5, responsive=True) is Verdict.SLOW
    assert window.judge(2.5, responsive=False) is Verdict.DEAD
    assert window.judge(1.1, responsive=False) is Verdict.ON_TIME
    for _ in range(9):  # its completed (late) waits enter the window ...
        window.observe(2.5)
    # ... and once they are the majority the new pace is on time.
    assert window.judge(2.5, responsive=False) is Verdict.ON_TIME
    # A silent stall far beyond the new pace is still dead.
    assert window.judge(30.0, responsive=False) is Verdict.DEAD


def test_judge_wait_boundary_is_on_time():
    assert judge_wait(2.0, 2.0, responsive=False) is Verdict.ON_TIME
    assert judge_wait(2.0001, 2.0, responsive=False) is Verdict.DEAD


def test_policy_is_validated_and_round_trips():
    with pytest.raises(ConfigError, match="min_samples"):
        DeadlinePolicy(window=4, min_samples=8)
    with pytest.raises(ConfigError, match="k must"):
        DeadlinePolicy(k=-1.0)
    with pytest.raises(ConfigError, match="window must"):
        DeadlinePolicy(window=0)
    with pytest.raises(ConfigError, match="unknown"):
        DeadlinePolicy.from_dict({"kk": 3})
    assert DeadlinePolicy.from_dict(POLICY.to_dict()) == POLICY


def test_latencies_must_be_real_durations():
    window = LatencyWindow(POLICY)
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ConfigError, match="latency"):
            window.observe(bad)


def _quick() -> DeadlinePolicy:
    return DeadlinePolicy(k=3.0, window=8, min_samples=3, floor_s=0.01, cold_start_s=5.0)


def test_a_stall_is_reported_once_per_unit_and_a_late_result_widens_the_window():
    watch = StallWatch(_quick())
    assert watch.stalled(100.0) is None  # nothing in flight: nothing to wait for
    watch.sent(0.0)
    watch.sent(0.0)
    assert watch.stalled(4.9) is None  # cold start: the first waits include warm-up
    assert watch.stalled(5.1) == pytest.approx((5.1, 5.0))
    assert watch.stalled(6.0) is None  # reported once
    watch.completed(6.0)  # latency 6.0; the second unit (sent at 0) is next
    assert watch.stalled(17.9) is None  # cold start: 3 x the slowest latency seen (18 s)
    assert watch.stalled(18.1) is not None
    t = 20.0
    watch.completed(t)  # latency 20
    for _ in range(4):  # then a steady latency of 0.1 s
        watch.sent(t)
        watch.completed(t + 0.1)
        t += 1.0
    # median 0.1 (two long ones do not move it), MAD 0: its floor, 5 % of the median
    assert watch.deadline() == pytest.approx(0.1 + 3 * 0.005)
    watch.sent(t)
    assert watch.stalled(t + 0.1) is None
    late = watch.stalled(t + 0.2)
    assert late is not None and late[0] == pytest.approx(0.2)
    # the device was slow, not dead: its late result widens the window
    watch.completed(t + 1.0)
    assert watch.outstanding == 0 and watch.stalled(t + 500) is None
    assert watch.latency.samples[-1] == pytest.approx(1.0)


def test_the_oldest_units_age_counts_so_a_unit_sent_into_an_idle_pipeline_is_not_late():
    watch = StallWatch(_quick())
    t = 0.0
    for _ in range(4):  # three in flight at a time: latency 0.3 s, a result every 0.1 s
        for k in range(3):
            watch.sent(t + 0.1 * k)
        for k in range(3):
            watch.completed(t + 0.3 + 0.1 * k)
        t += 1.0
    assert watch.deadline() == pytest.approx(0.3 + 3 * 0.05 * 0.3)
    watch.sent(t)  # into an empty pipeline
    assert watch.stalled(t + 0.2) is None  # younger than the usual latency
    watch.sent(t + 0.25)
    assert watch.stalled(t + 0.3) is None
    stall = watch.stalled(t + 0.4)  # the oldest is 0.4 s old: past 0.345 s
    assert stall is not None and stall[0] == pytest.approx(0.4)
    watch.completed(t + 0.41)
    # the next unit is judged afresh, on its own age
    assert watch.stalled(t + 0.5) is None
    assert watch.stalled(t + 0.65) is not None


def test_a_result_with_nothing_in_flight_is_a_caller_bug():
    with pytest.raises(ConfigError, match="no work in flight"):
        StallWatch().completed(1.0)


def test_the_tail_factor_keeps_the_longest_gap_in_the_window():
    policy = DeadlinePolicy(k=5.0, window=16, min_samples=4, floor_s=0.0, tail_factor=2.0)
    calm = [1.0] * 15
    # median and MAD ignore one stall; the tail term does not
    assert adaptive_deadline([*calm, 4.0], POLICY) == pytest.approx(1.25)
    assert adaptive_deadline([*calm, 4.0], policy) == pytest.approx(8.0)
    # once the stall leaves the window, the deadline is the median's again
    assert adaptive_deadline([4.0, *calm, 1.0], policy) == pytest.approx(2.0)
    with pytest.raises(ConfigError, match="tail_factor"):
        DeadlinePolicy(tail_factor=-1.0)


def test_a_heartbeat_watch_learns_gaps_and_lateness_above_its_floors():
    watch = HeartbeatWatch(interval_s=1.0, suspect_floor_s=3.0, probe_floor_s=2.0)
    assert watch.deadlines() == (3.0, 2.0)  # nothing seen: the floors
    for t in (0.0, 1.0, 2.0, 3.0, 4.0):
        watch.heartbeat(t)
    assert watch.deadlines() == (3.0, 2.0)  # punctual: still the floors
    watch.heartbeat(6.5)  # 2.5 s gap, 1.5 s late
    assert watch.deadlines() == pytest.approx((5.0, 3.0))
    watch.probe_answered(2.5)
    assert watch.probe_deadline() == pytest.approx(5.0)


def test_a_heartbeat_watch_forgives_the_watchers_own_pause():
    watch = HeartbeatWatch(interval_s=1.0, suspect_floor_s=3.0, probe_floor_s=2.0)
    for t in (0.0, 1.0, 2.0, 3.0, 4.0):
        watch.heartbeat(t)
    watch.forgive(3.0)  # the watcher was paused 3 s: the next gap is measured without it
    watch.heartbeat(8.0)
    assert watch.gaps.samples[-1] == pytest.approx(1.0)
    assert watch.deadlines() == (3.0, 2.0)
