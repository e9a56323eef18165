"""A stage's time per mini-batch in one look's window, from its mini-batches one by one.

Pure: numbers in, numbers out. A look's window is the mini-batches since the last
look (:class:`zpipe.training.repartition.RepartitionController`). Its cumulative
counters give the window's mean, which is wrong twice over:

- a window that straddles a change of the device's speed mixes the two speeds: a
  device that turned 10x slower a third of the way through shows about 7x, and a
  move on that leaves it too many units, so a second and a third move follow (in
  ``bench/training_async.py``'s ``r24_middle`` the first move landed during the
  change, 7-10 mini-batches then ran at 1.0-1.3 s until the next moves);
- on a loaded host a few mini-batches wait for a core and the mean follows them
  (a look's time swung 1.5x, and the fixed-cost fit across looks with it).

A stage therefore also reports its newest mini-batches' forwards one by one
(``recent``: ``[mb, seconds]``; forwards, as most of a window's mini-batches have
had theirs by the look, far fewer their backwards). :func:`window_time` finds a
change point in the window's series (the split whose two sides' medians differ
most, each side at least ``MIN_SIDE`` mini-batches, every mini-batch after it
beyond the two medians' geometric middle: one slow mini-batch is load, not a
change) and, when the sides differ by more than ``limit`` times, measures the
device on the mini-batches after the change only; either way the median of what
it keeps, not the mean. The cumulative counters also hold what the forwards leave
out (the backwards, the optimizer's step): the result is the kept median times
the window's whole compute over its forwards' (the counters' own ratio: the rest
is taken to scale with the forward, as a slower device scales all of it).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

MIN_SIDE = 2  # mini-batches on each side of a change point


@dataclass(frozen=True)
class WindowTime:
    """A device's seconds per mini-batch in a window (``seconds``), whether the window
    held a change of its speed (``changed``) and how many mini-batches were kept."""

    seconds: float
    changed: bool = False
    kept: int = 0


def change_point(series: Sequence[float], limit: float) -> int | None:
    """The index of the first mini-batch after a change of speed in ``series`` (each
    mini-batch's seconds, oldest first), or None when no split's two sides' medians
    differ by more than ``limit`` times (see the module notes)."""
    values = [float(v) for v in series]
    if len(values) < 2 * MIN_SIDE or any(not (v > 0 and math.isfinite(v)) for v in values):
        return None
    best, best_ratio = None, 1.0
    for k in range(MIN_SIDE, len(values) - MIN_SIDE + 1):
        before = statistics.median(values[:k])
        after = statistics.median(values[k:])
        ratio = max(after / before, before / after)
        if ratio <= limit or ratio <= best_ratio:
            continue
        middle = math.sqrt(before * after)
        # every mini-batch after the split on the new speed's side of the middle
        if after > before:
            clean = all(v > middle for v in values[k:])
        else:
            clean = all(v < middle for v in values[k:])
        if clean:
            best, best_ratio = k, ratio
    return best


def window_time(
    total_s: float,
    spans_s: float,
    batches: int,
    recent: Sequence[float] | None,
    *,
    limit: float,
) -> WindowTime:
    """A device's seconds per mini-batch over a window of ``batches`` mini-batches that
    took ``total_s`` of compute by its counters, ``spans_s`` of it in what ``recent``
    times (forwards); ``recent``: the newest mini-batches' seconds,
    oldest first (only the window's last ``batches`` count; None or too few: the
    counters' mean); ``limit``: how many times either way a change of speed must be
    (``1 + deviation``, the controller's test of a real change)."""
    if batches <= 0 or not total_s > 0:
        raise ValueError(f"a window of {batches} mini-batches and {total_s} s has no time")
    mean = total_s / batches
    values = [float(v) for v in recent or () if v > 0 and math.isfinite(v)][-batches:]
    if len(values) < 2 * MIN_SIDE - 1 or not 0 < spans_s <= total_s:
        return WindowTime(mean)
    k = change_point(values, limit)
    kept = values if k is None else values[k:]
    scale = total_s / spans_s  # the rest of the compute, as a share of the spans
    return WindowTime(scale * statistics.median(kept), changed=k is not None, kept=len(kept))


@dataclass(frozen=True)
class SpeedVerdict:
    """A stage's own verdict that its passes changed speed for good
    (:class:`zpipe.protocol.repartition.SpeedChanged`, as the coordinator accepted it):
    at about mini-batch ``step`` of the cuts of ``plan_epoch``, by ``ratio`` (the
    median of each slow pass over its own kind's median: measured, not guessed);
    ``baseline_s`` and ``now_s``: its forward seconds before and after."""

    step: int
    ratio: float
    baseline_s: float
    now_s: float
    plan_epoch: int


def verdict_time(
    total_s: float,
    spans_s: float,
    batches: int,
    recent: Sequence[float] | None,
    verdict: SpeedVerdict,
) -> WindowTime:
    """A device's seconds per mini-batch over a window that its stage's ``verdict``
    says holds a change of its speed (arguments as :func:`window_time`'s).

    The verdict comes after three or four slow passes (two mini-batches), so the look
    it triggers sees 0-1 slow forwards in its window: too few for
    :func:`change_point` (``MIN_SIDE`` after the split), and the window's median is
    the OLD speed (a bench run's look then kept the cuts, and moved 7 mini-batches
    late). The verdict places the change instead: the window's newest forwards on
    the new speed's side of ``baseline_s`` and ``now_s``'s geometric middle (the
    longest such run at its end: an old forward that waited for a core before it is
    not counted) are after it. With ``MIN_SIDE`` of them (or nothing before them)
    the device is measured on them, as :func:`window_time` measures after a change;
    with fewer, as the median of the forwards before them times the verdict's
    ``ratio``: the window's own old speed, scaled by what the stage measured of its
    passes since. Either way times the window's compute over its forwards. Without
    forwards one by one the verdict cannot be placed: :func:`window_time`'s mean."""
    if batches <= 0 or not total_s > 0:
        raise ValueError(f"a window of {batches} mini-batches and {total_s} s has no time")
    values = [float(v) for v in recent or () if v > 0 and math.isfinite(v)][-batches:]
    if not values or not 0 < spans_s <= total_s:
        return WindowTime(total_s / batches)
    middle = math.sqrt(verdict.baseline_s * verdict.now_s)
    slower = verdict.ratio > 1.0
    k = len(values)
    while k > 0 and (values[k - 1] > middle if slower else values[k - 1] < middle):
        k -= 1
    before, after = values[:k], values[k:]
    scale = total_s / spans_s
    if len(after) >= MIN_SIDE or not before:
        return WindowTime(scale * statistics.median(after), changed=True, kept=len(after))
    seconds = scale * statistics.median(before) * verdict.ratio
    return WindowTime(seconds, changed=True, kept=len(before))
