"""A stage's watch of its own forward times: whether its device's speed changed for good.

Pure: seconds in, a verdict out; no clock, no I/O. The client's loss watch
(:mod:`zpipe.training.repartition_watch`) sees a device slow down only through the
pipeline's period, and only against the interval before the last look. A stage sees
its own forwards at once: :class:`ForwardWatch` fires when ``k`` consecutive
forwards lie beyond ``factor`` times (either way) the median of the forwards before
them (at least ``least`` of them, the newest ``history``), so one slow forward (a
host that took the core away for a moment) is not a change, while a step is seen on
its ``k``-th forward (``k`` 4 by default: on a host that holds up one forward in
20 by 3-6x, three in a row come about once in 7,000 forwards). Having fired, it
starts again from the new level: the forwards of the streak are the new baseline,
and it cannot fire again before ``least`` more forwards (a device that stays slow
is reported once). A stage whose units change (a move) calls
:meth:`ForwardWatch.reset`: its forwards then take another time without the device
changing.

A move is also when a device is most likely caught changing unseen: in
``bench/training_async.py``'s ``r24_middle`` the device slows during the first
move's pause, so every forward on the new cuts is already slow and a watch that
starts from nothing takes them for its baseline (the loss watch then saw it eight
slow mini-batches later). So :meth:`ForwardWatch.reset` takes a ``scale``: the new
units' share of the old (by count, or by work where known), and until ``least``
forwards of the new cuts are in, the old median times ``scale`` is a provisional
baseline, judged with ``PROVISIONAL_MARGIN`` times the factor (4 at the usual 2: a
scale by count is off when a fixed cost per forward does not scale, and a loaded
host's waits for a core add to every forward alike, which shrinks a ratio: a wait of
three times the work makes 10x read 7.5x; with a margin of 4, 8 in all, one
``r24_middle`` run at load 5 on two cores relayed no verdict at all). A wrong verdict
costs one look, and a look that keeps the cuts pauses nothing.

A step far beyond any hiccup need not wait for ``k`` forwards: a streak whose every
forward lies beyond ``FAR_MARGIN`` times the factor (8x the median at the usual 2)
fires on its ``far_k``-th forward (3 by default; None: off). Why that is no less
safe: the host's hiccups the ``k`` rule is sized for hold a forward up 3-6x, short of
8x on their own, but with the noise on top of them (that of
``tests/unit/training/test_forward_watch.py``: one forward in 20 held up 3-6x, a
lognormal spread of 0.25) one forward in about 745 lies beyond 8x. Two in a row then
come about once in 550,000 forwards, and that test's seeded series holds such a
pair; three in a row, about once in 4e8, add nothing to the ``k`` rule's rate (12
false verdicts in a million such forwards). A loaded host's waits for a core shrink
a real step's ratio (10x read 7.5x at load 5; ``r24_middle``'s 10x read 8.2x at load
4): then the far rule does not fire and the ``k`` rule sees the step as before, so
no step is seen later than without it. A device that slows 10x on a quiet host is
reported on its third slow forward, not its fourth: one mini-batch fewer enters on
the old cuts before the look.

What to do with a verdict (tell the coordinator, so that the run is looked at before
its next scheduled look) is the caller's. The cost per forward is a comparison with
a cached median; the median is recomputed once every ``history // 4`` forwards and
when a streak starts (a few microseconds: a sort of ``history`` floats).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from zpipe._errors import ConfigError

# how much further than ``factor`` a forward must lie from a provisional baseline (the
# old median scaled after a move) to count: the scale is a guess (see the notes)
PROVISIONAL_MARGIN = 2.0
# how much further than ``factor`` every forward of a streak must lie for the streak to
# count at ``far_k`` forwards, not ``k``: beyond any host hiccup (see the notes)
FAR_MARGIN = 4.0


@dataclass(frozen=True)
class SpeedChange:
    """A sustained change of a stage's forward time: ``ratio`` is the streak's median
    over the baseline's (> 1: slower), ``baseline_s`` and ``now_s`` the two medians."""

    ratio: float
    baseline_s: float
    now_s: float


class ForwardWatch:
    """Whether a stage's forwards changed speed for good (see the module notes)."""

    def __init__(
        self,
        factor: float = 2.0,
        *,
        k: int = 4,
        history: int = 16,
        least: int = 6,
        far_k: int | None = 3,
    ) -> None:
        if not (math.isfinite(factor) and factor > 1.0):
            raise ConfigError(f"a forward watch's factor must be > 1, got {factor}")
        if k < 1 or least < 1 or history < least:
            raise ConfigError(
                f"a forward watch needs k >= 1 and 1 <= least <= history, got "
                f"k={k}, least={least}, history={history}"
            )
        if far_k is not None and far_k < 1:
            raise ConfigError(f"a forward watch needs far_k >= 1 (or None), got {far_k}")
        self.factor = float(factor)
        self.k = int(k)
        # a far streak never needs more forwards than any streak
        self.far_k = self.k if far_k is None else min(int(far_k), self.k)
        self.least = int(least)
        self._history: deque[float] = deque(maxlen=int(history))
        self._refresh = max(int(history) // 4, 1)  # forwards between two medians
        self._baseline: float | None = None  # the history's median, cached
        self._stale = 0  # forwards added since the cached median
        self._streak: list[float] = []
        self._side = 0  # the streak's side: 1 slower, -1 faster
        self._far = True  # every forward of the streak lies beyond FAR_MARGIN x factor
        # after a reset with a scale: the old median scaled, until ``least`` new forwards
        self._provisional: float | None = None

    def reset(self, scale: float | None = None) -> None:
        """Forget every forward (the stage's units changed); with ``scale`` (the new
        units' work over the old), the old median times it is the provisional baseline
        until ``least`` new forwards are in (see the module notes)."""
        provisional = None
        if scale is not None and math.isfinite(scale) and scale > 0 and len(self._history):
            provisional = self._median(fresh=True) * scale
        self._history.clear()
        self._baseline, self._stale, self._streak, self._side = None, 0, [], 0
        self._far = True
        self._provisional = provisional

    def observe(self, seconds: float) -> SpeedChange | None:
        """One forward's seconds; the change when this forward completes a streak."""
        if not (seconds > 0 and math.isfinite(seconds)):
            return None  # nothing to learn from a clock that did not move
        provisional = self._provisional is not None and len(self._history) < self.least
        if len(self._history) < self.least and not provisional:
            self._add(seconds)
            return None
        factor = self.factor * PROVISIONAL_MARGIN if provisional else self.factor
        base = self._provisional if provisional else self._median()
        assert base is not None
        side = self._side_of(seconds, base, factor)
        if side == 0 or side != self._side:
            # a streak ends (noise: its forwards join the history as any other); a
            # new one is judged on a current median
            for value in self._streak:
                self._add(value)
            self._streak, self._side, self._far = [], 0, True
            if side != 0 and not provisional:
                base = self._median(fresh=True)
                side = self._side_of(seconds, base, factor)
            if side == 0:
                self._add(seconds)
                return None
            self._side = side
        self._streak.append(seconds)
        self._far = self._far and self._side_of(seconds, base, factor * FAR_MARGIN) == side
        if len(self._streak) < (self.far_k if self._far else self.k):
            return None
        now = statistics.median(self._streak)
        change = SpeedChange(now / base, base, now)
        # the new level is the baseline from here on
        self._history.clear()
        self._baseline, self._provisional = None, None
        for value in self._streak:
            self._add(value)
        self._streak, self._side, self._far = [], 0, True
        return change

    def _side_of(self, seconds: float, base: float, factor: float) -> int:
        if seconds > factor * base:
            return 1
        return -1 if seconds * factor < base else 0

    def _add(self, seconds: float) -> None:
        self._history.append(seconds)
        self._stale += 1

    def _median(self, *, fresh: bool = False) -> float:
        if self._baseline is None or fresh or self._stale >= self._refresh:
            self._baseline = statistics.median(self._history)
            self._stale = 0
        return self._baseline
