"""zpipe/training/forward_watch.py: a stage's watch of its own forward times (pure)."""

from __future__ import annotations

import random
import time

import pytest

from zpipe._errors import ConfigError
from zpipe.training.forward_watch import ForwardWatch


def _fire_at(watch: ForwardWatch, series: list[float]) -> list[int]:
    return [i for i, s in enumerate(series) if watch.observe(s) is not None]


@pytest.mark.parametrize("seed", range(5))
def test_no_alarm_on_a_noisy_but_steady_series(seed: int) -> None:
    rng = random.Random(seed)
    # lognormal noise (sigma 0.25) and one forward in 20 held up 3-6x by the host
    series = []
    for _ in range(3000):
        value = 0.05 * rng.lognormvariate(0.0, 0.25)
        if rng.random() < 0.05:
            value *= rng.uniform(3.0, 6.0)
        series.append(value)
    assert _fire_at(ForwardWatch(2.0), series) == []  # k=4 (3 in a row: about 1 in 7,000)


@pytest.mark.parametrize("k", [2, 3, 4])
def test_a_step_fires_on_its_kth_forward_and_once(k: int) -> None:
    rng = random.Random(k)
    steady = [0.05 * rng.uniform(0.9, 1.1) for _ in range(30)]
    # 5x: beyond the factor, short of the far rule's FAR_MARGIN x factor (8x)
    slow = [0.25 * rng.uniform(0.9, 1.1) for _ in range(40)]
    watch = ForwardWatch(2.0, k=k)
    fired = [i for i, s in enumerate(steady + slow) if watch.observe(s) is not None]
    assert fired == [30 + k - 1]  # the k-th slow forward, and never again while slow


def test_the_change_says_how_much_slower_and_a_recovery_fires_the_other_way() -> None:
    watch = ForwardWatch(2.0, k=3, far_k=None)
    for _ in range(10):
        assert watch.observe(0.1) is None
    changes = [watch.observe(s) for s in [1.0, 1.0, 1.0]]
    assert changes[:2] == [None, None]
    change = changes[2]
    assert change is not None and change.ratio == pytest.approx(10.0)
    assert (change.baseline_s, change.now_s) == (pytest.approx(0.1), pytest.approx(1.0))
    for _ in range(6):
        assert watch.observe(1.0) is None
    back = [watch.observe(0.1) for _ in range(3)]
    assert back[2] is not None and back[2].ratio == pytest.approx(0.1)


def test_a_streak_broken_by_a_normal_forward_starts_again() -> None:
    watch = ForwardWatch(2.0, k=3)
    for _ in range(10):
        watch.observe(0.1)
    assert _fire_at(watch, [0.5, 0.5, 0.1, 0.5, 0.5, 0.1]) == []
    assert _fire_at(watch, [0.5, 0.5, 0.5]) == [2]


def test_a_step_far_beyond_any_hiccup_fires_on_its_third_forward() -> None:
    rng = random.Random(7)
    steady = [0.05 * rng.uniform(0.9, 1.1) for _ in range(30)]
    slow = [0.5 * rng.uniform(0.9, 1.1) for _ in range(40)]  # 10x: beyond 8x
    assert _fire_at(ForwardWatch(2.0), steady + slow) == [32]  # k=4 alone: 33
    assert _fire_at(ForwardWatch(2.0, far_k=None), steady + slow) == [33]
    faster = [0.005] * 10  # 10x faster: as far the other way
    watch = ForwardWatch(2.0)
    assert _fire_at(watch, steady + faster) == [32]


def test_a_streak_counts_as_far_only_while_every_forward_is_far() -> None:
    watch = ForwardWatch(2.0)
    for _ in range(10):
        watch.observe(0.1)
    # 10x, 3x (slow, not far), 10x: one streak that is not far: it needs k=4
    assert _fire_at(watch, [1.0, 0.3, 1.0]) == []
    assert _fire_at(watch, [1.0]) == [0]
    # two far forwards are not yet a verdict (far_k 3)
    watch = ForwardWatch(2.0)
    for _ in range(10):
        watch.observe(0.1)
    assert _fire_at(watch, [1.0, 1.0]) == []
    watch = ForwardWatch(2.0)
    for _ in range(10):
        watch.observe(0.1)
    # far forwards broken by normal ones: each streak ends short of a verdict
    assert _fire_at(watch, [1.0, 1.0, 0.1, 1.0, 1.0, 0.1]) == []


@pytest.mark.parametrize("seed", range(3))
def test_no_alarm_from_the_far_rule_on_hiccups_of_up_to_six_times(seed: int) -> None:
    # every fifth forward held up 3-6x (four times the rate of the test above), never
    # two in a row: each lies beyond the factor, none beyond 8x, so neither rule fires
    rng = random.Random(seed)
    series = [
        0.05 * rng.uniform(0.95, 1.05) * (rng.uniform(3.0, 6.0) if i % 5 == 4 else 1.0)
        for i in range(2000)
    ]
    assert _fire_at(ForwardWatch(2.0, k=2, far_k=1), series) == []
    assert _fire_at(ForwardWatch(2.0, k=4, far_k=1), series) == []


def test_no_verdict_before_enough_forwards_and_reset_forgets_them() -> None:
    watch = ForwardWatch(2.0, k=2, least=6)
    assert _fire_at(watch, [0.1] * 5 + [1.0]) == []  # the sixth forward joins the history
    watch.reset()  # the stage's units changed: its forwards take another time
    assert _fire_at(watch, [1.0] * 6 + [1.0, 1.0]) == []
    assert _fire_at(watch, [3.0, 3.0]) == [1]


def test_bad_forward_times_are_ignored() -> None:
    watch = ForwardWatch(2.0, k=2)
    for _ in range(8):
        watch.observe(0.1)
    assert _fire_at(watch, [0.0, -1.0, float("nan"), float("inf")]) == []
    assert _fire_at(watch, [0.5, 0.5]) == [1]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"factor": 1.0},
        {"factor": float("inf")},
        {"k": 0},
        {"least": 0},
        {"history": 3},
        {"far_k": 0},
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="forward watch"):
        ForwardWatch(**kwargs)  # type: ignore[arg-type]


def test_a_forward_costs_a_few_microseconds() -> None:
    # not a speed assertion: a bound a thousand times the expected cost, so that a
    # watch that sorted its whole history at every forward on a slow host still passes
    watch = ForwardWatch(2.0)
    rng = random.Random(0)
    series = [0.05 * rng.uniform(0.9, 1.1) for _ in range(2000)]
    started = time.perf_counter()
    for s in series:
        watch.observe(s)
    assert (time.perf_counter() - started) / len(series) < 5e-3
