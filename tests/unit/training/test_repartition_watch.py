"""zpipe/training/repartition_watch.py: an early look when the losses slow down (pure)."""

from __future__ import annotations

import pytest

from zpipe._errors import ConfigError
from zpipe.training.repartition import RepartitionSettings
from zpipe.training.repartition_watch import SlowdownWatch


def _feed(watch: SlowdownWatch, first: int, gaps: list[float], start: float) -> float:
    """Losses of mini-batches ``first``, ``first + 1``, ... at the given gaps; the last time."""
    t = start
    for i, gap in enumerate(gaps):
        t += gap
        watch.acknowledged(first + i + 1, t)
    return t


def test_a_jump_in_the_loss_period_asks_for_a_look_before_the_next_scheduled_one() -> None:
    watch = SlowdownWatch(2.0, window=3)
    watch.looked(10)
    t = _feed(watch, 10, [0.1] * 10, 0.0)  # the interval 10-20 at 0.1 s: the baseline
    watch.looked(20)
    # the first loss after the look starts the gaps: 0.1, 0.1, 0.4
    t = _feed(watch, 20, [0.1, 0.1, 0.1, 0.4], t)
    assert not watch.due()  # one slow gap of three is not the median
    watch.acknowledged(25, t + 0.4)
    assert watch.due()


def test_no_baseline_before_the_second_look_and_no_alarm_at_a_steady_period() -> None:
    watch = SlowdownWatch(2.0, window=3)
    _feed(watch, 0, [0.1] * 5, 0.0)  # before any look: nothing counts
    watch.looked(5)
    t = _feed(watch, 5, [0.5] * 5, 1.0)
    assert not watch.due()  # no interval before this one to compare with
    watch.looked(10)
    _feed(watch, 10, [0.5, 0.6, 0.9, 0.5], t)
    assert not watch.due()  # within the factor


def test_losses_of_mini_batches_fed_before_the_look_do_not_count() -> None:
    watch = SlowdownWatch(2.0, window=2)
    watch.looked(0)
    t = _feed(watch, 0, [0.1] * 6, 0.0)
    watch.looked(6)
    # the look moved: the feed paused, and the losses in flight (mini-batches 3-5)
    # came back before it; the pause is the gap to mini-batch 6's loss
    watch.acknowledged(5, t + 0.1)
    watch.acknowledged(6, t + 0.2)
    watch.acknowledged(7, t + 2.0)  # mini-batch 6 after the move's 1.8 s pause
    watch.acknowledged(8, t + 2.1)
    watch.acknowledged(9, t + 2.2)
    assert not watch.due()


def test_an_early_look_that_keeps_the_cuts_makes_the_slow_period_the_baseline() -> None:
    watch = SlowdownWatch(2.0, window=3)
    watch.looked(0)
    t = _feed(watch, 0, [0.1] * 10, 0.0)
    watch.looked(10)
    t = _feed(watch, 10, [0.4] * 4, t)
    assert watch.due()
    watch.looked(14)  # the early look kept the cuts
    _feed(watch, 14, [0.4] * 6, t)
    assert not watch.due()


def test_several_mini_batches_in_one_acknowledgement_share_its_gap() -> None:
    watch = SlowdownWatch(2.0, window=3)
    watch.looked(0)
    _feed(watch, 0, [0.1] * 5, 0.0)
    watch.looked(5)
    watch.acknowledged(6, 10.0)
    watch.acknowledged(9, 10.3)  # three at once: 0.1 each, not one gap of 0.3
    assert not watch.due()


@pytest.mark.parametrize("factor", [0.5, 1.0, -2.0])
def test_a_factor_that_is_not_a_slowdown_is_refused(factor: float) -> None:
    with pytest.raises(ConfigError, match="factor must be > 1"):
        SlowdownWatch(factor)


def test_the_settings_carry_watch_off_by_default_and_refuse_bad_values() -> None:
    assert RepartitionSettings().watch == 0
    assert "watch" not in RepartitionSettings().to_dict()  # an older coordinator reads it
    on = RepartitionSettings.from_dict({"first": 10, "every": 10, "watch": 2.0})
    assert on.watch == 2.0 and on.to_dict()["watch"] == 2.0
    assert RepartitionSettings.from_dict(on.to_dict()) == on
    for bad in (1.0, 0.5, -1.0, float("inf")):
        with pytest.raises(ConfigError, match="watch must be 0"):
            RepartitionSettings(watch=bad)


def test_after_a_move_the_baseline_is_the_period_predicted_for_the_new_cuts() -> None:
    # r24_middle: the even cuts ran at 0.5 s, the first move's cuts at 0.1 s; the
    # device then slowed to 0.95 s, under twice the old cuts' period
    watch = SlowdownWatch(2.0, window=3)
    watch.looked(0)
    t = _feed(watch, 0, [0.5] * 10, 0.0)
    watch.looked(10)
    watch.moved(0.12)
    t = _feed(watch, 10, [0.1] * 4, t + 1.5)
    assert not watch.due()
    t = _feed(watch, 14, [0.95], t)
    assert not watch.due()  # one slow gap of three is not the median
    _feed(watch, 15, [0.95], t)
    assert watch.due()


def test_without_a_move_the_old_interval_stays_the_baseline() -> None:
    # the same losses, but the look kept the cuts: 0.95 s is under twice 0.5 s
    watch = SlowdownWatch(2.0, window=3)
    watch.looked(0)
    t = _feed(watch, 0, [0.5] * 10, 0.0)
    watch.looked(10)
    _feed(watch, 10, [0.1] * 4 + [0.95] * 6, t)
    assert not watch.due()


def test_a_move_without_a_predicted_period_keeps_the_old_interval_as_baseline() -> None:
    watch = SlowdownWatch(2.0, window=3)
    watch.looked(0)
    t = _feed(watch, 0, [0.1] * 10, 0.0)
    watch.looked(10)
    for unknown in (None, 0.0, float("nan"), -1.0):
        watch.moved(unknown)
    t = _feed(watch, 10, [0.15] * 4, t)
    assert not watch.due()
    _feed(watch, 14, [0.3] * 2, t)
    assert watch.due()  # twice the old cuts' 0.1 s
