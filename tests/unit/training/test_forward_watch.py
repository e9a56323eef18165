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


# ---------------------------------------------------------------- backwards too
# A stage runs a forward and a backward per mini-batch, alternating in 1F1B, and a
# backward costs about twice a forward: each is judged against its own kind's median.

FORWARD_S, BACKWARD_S = 0.05, 0.10


def _alternating(forwards: list[float], backwards: list[float]) -> list[tuple[str, float]]:
    series = []
    for forward, backward in zip(forwards, backwards, strict=True):
        series += [("forward", forward), ("backward", backward)]
    return series


def _passes_fire_at(watch: ForwardWatch, series: list[tuple[str, float]]) -> list[int]:
    return [i for i, (kind, s) in enumerate(series) if watch.observe(s, kind) is not None]  # type: ignore[arg-type]


def _steady(rng: random.Random, n: int, times: float = 1.0) -> list[tuple[str, float]]:
    return _alternating(
        [FORWARD_S * times * rng.uniform(0.9, 1.1) for _ in range(n)],
        [BACKWARD_S * times * rng.uniform(0.9, 1.1) for _ in range(n)],
    )


@pytest.mark.parametrize(("times", "nth"), [(10.0, 3), (5.0, 4)])
def test_a_step_seen_in_forwards_and_backwards_fires_on_its_third_or_fourth_pass(
    times: float, nth: int
) -> None:
    # 10x: every pass beyond 8x (the far rule: its third pass, F B F, the second
    # mini-batch's forward); 5x: the k rule's fourth pass (F B F B, two mini-batches).
    # Forwards alone took three and four forwards: three and four mini-batches.
    rng = random.Random(int(times))
    steady, slow = _steady(rng, 20), _steady(rng, 20, times)
    watch = ForwardWatch(2.0)
    assert _passes_fire_at(watch, steady + slow) == [40 + nth - 1]  # once while slow
    change = ForwardWatch(2.0)
    _passes_fire_at(change, steady)
    verdict = [change.observe(s, kind) for kind, s in slow[:nth]][-1]  # type: ignore[arg-type]
    assert verdict is not None
    # each pass over its own kind's median: the step's factor, not a backward's 2x
    assert verdict.ratio == pytest.approx(times, rel=0.15)
    # in forward seconds: the forwards' baseline and the forward the ratio implies
    assert verdict.baseline_s == pytest.approx(FORWARD_S, rel=0.1)
    assert verdict.now_s == pytest.approx(verdict.baseline_s * verdict.ratio)


def test_a_backward_is_judged_against_backwards_not_forwards() -> None:
    # backwards three times a forward, steady: against one median of both kinds every
    # backward would lie beyond 2x and every forward inside it
    rng = random.Random(3)
    series = _alternating(
        [FORWARD_S * rng.uniform(0.9, 1.1) for _ in range(200)],
        [3 * FORWARD_S * rng.uniform(0.9, 1.1) for _ in range(200)],
    )
    assert _passes_fire_at(ForwardWatch(2.0, k=2, far_k=None), series) == []


@pytest.mark.parametrize("seed", range(5))
def test_no_alarm_on_noisy_but_steady_forwards_and_backwards(seed: int) -> None:
    # the noise of the forwards-only test above, on every pass of either kind: one in
    # 20 held up 3-6x, independently (twice the passes per mini-batch: the same rate
    # per pass, twice per mini-batch: 14 false verdicts in a million mini-batches, 8
    # from their forwards alone, over four seeded series)
    rng = random.Random(seed)
    series = []
    for kind, base in [("forward", FORWARD_S), ("backward", BACKWARD_S)] * 1500:
        value = base * rng.lognormvariate(0.0, 0.25)
        if rng.random() < 0.05:
            value *= rng.uniform(3.0, 6.0)
        series.append((kind, value))
    assert _passes_fire_at(ForwardWatch(2.0), series) == []


@pytest.mark.parametrize("seed", range(3))
def test_no_alarm_from_the_far_rule_on_pass_hiccups_of_up_to_six_times(seed: int) -> None:
    # every fifth pass held up 3-6x (a forward as often as a backward), never two in a
    # row: each lies beyond the factor, none beyond 8x, so neither rule fires
    rng = random.Random(seed)
    series = [
        (kind, base * rng.uniform(0.95, 1.05) * (rng.uniform(3.0, 6.0) if i % 5 == 4 else 1.0))
        for i, (kind, base) in enumerate([("forward", FORWARD_S), ("backward", BACKWARD_S)] * 1000)
    ]
    assert _passes_fire_at(ForwardWatch(2.0, k=2, far_k=1), series) == []
    assert _passes_fire_at(ForwardWatch(2.0, k=4, far_k=1), series) == []


def test_a_hiccup_that_holds_up_forwards_only_is_not_counted_across_the_backwards() -> None:
    # every forward runs in a hiccup (10x), every backward after it at its usual time:
    # the passes run one at a time, so a normal backward between two slow forwards ends
    # the streak (forwards alone: a verdict at the third slow forward)
    rng = random.Random(5)
    steady = _steady(rng, 20)
    hiccups = _alternating(
        [10 * FORWARD_S] * 20, [BACKWARD_S * rng.uniform(0.9, 1.1) for _ in range(20)]
    )
    assert _passes_fire_at(ForwardWatch(2.0), steady + hiccups) == []
    forwards = [s for kind, s in steady + hiccups if kind == "forward"]
    assert _fire_at(ForwardWatch(2.0), forwards) == [22]


def test_warm_up_forwards_then_backwards_each_need_their_own_baseline() -> None:
    # a first stage's warm-up: forwards before any backward; a kind without a baseline
    # is neither judged nor does it end a streak of the other kind
    watch = ForwardWatch(2.0)
    assert _fire_at(watch, [FORWARD_S] * 8) == []
    # the first backwards build their baseline; slow forwards between them go on
    series = [("backward", BACKWARD_S), ("forward", 10 * FORWARD_S)] * 3
    assert _passes_fire_at(watch, series) == [5]  # the third slow forward: far


def test_a_verdict_moves_the_baseline_of_a_kind_its_streak_did_not_see() -> None:
    watch = ForwardWatch(2.0)
    _passes_fire_at(watch, _steady(random.Random(1), 10))
    # a verdict from forwards alone (warm-up after a pause, say): the backwards' old
    # level times the ratio is their provisional baseline, so the next slow backwards
    # are the new level, not a second verdict
    assert _fire_at(watch, [10 * FORWARD_S] * 3) == [2]
    assert _passes_fire_at(watch, _steady(random.Random(2), 10, 10.0)) == []


def test_a_reset_keeps_each_kinds_median_as_a_provisional_baseline() -> None:
    watch = ForwardWatch(2.0)
    _passes_fire_at(watch, _steady(random.Random(4), 10))
    watch.reset(scale=2.0)  # twice the units: twice each kind's time
    assert _passes_fire_at(watch, _steady(random.Random(5), 10, 2.0)) == []
    watch.reset(scale=1.0)
    # 10x while provisional (judged at twice the factor): the k rule's fourth pass
    assert _passes_fire_at(watch, _steady(random.Random(6), 4, 20.0)) == [3]


@pytest.mark.parametrize("kind", ["Backward", "step", "", None, 1])
def test_a_pass_of_an_unknown_kind_is_refused(kind: object) -> None:
    watch = ForwardWatch(2.0)
    with pytest.raises(ConfigError, match="forward or backward"):
        watch.observe(0.1, kind)  # type: ignore[arg-type]


def test_bad_backward_times_are_ignored() -> None:
    watch = ForwardWatch(2.0, k=2, far_k=None)
    _passes_fire_at(watch, _steady(random.Random(8), 8))
    bad = [("backward", v) for v in (0.0, -1.0, float("nan"), float("inf"))]
    assert _passes_fire_at(watch, [("forward", 0.5), *bad, ("backward", 1.0)]) == [5]
