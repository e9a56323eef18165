"""A stage's watch of its own passes: whether its device's speed changed for good.

Pure: seconds in, a verdict out; no clock, no I/O. The client's loss watch
(:mod:`zpipe.training.repartition_watch`) sees a device slow down only through the
pipeline's period, and only against the interval before the last look. A stage sees
its own passes at once. :class:`ForwardWatch` (named after the ``forward_watch``
setting that turns it on) takes each forward's and, where the stage feeds them, each
backward's compute time, each judged against the median of its own kind (a backward
costs about twice a forward: against one median of both, every backward would look
slow). It fires when ``k`` consecutive passes, in the order they ran, lie beyond
``factor`` times (either way) their kind's median (of at least ``least`` passes of
that kind, the newest ``history``), so one slow pass (a host that took the core away
for a moment) is not a change, while a step is seen on its ``k``-th pass (``k`` 4 by
default). Having fired, it starts again from the new level: each kind's passes of the
streak are its new baseline (a kind the streak did not see, its old median times the
streak's ratio, provisionally: see below), so a device that stays slow is reported
once. A stage whose units change (a move) calls :meth:`ForwardWatch.reset`: its
passes then take another time without the device changing.

**Why backwards too.** In 1F1B a stage alternates a forward and a backward, and a
device that slows makes both slow, so ``k`` passes span ``k / 2`` mini-batches, not
``k``: a 5x step is seen on its fourth pass (F B F B, the second slow mini-batch),
a 10x step on its third (F B F, the far rule below), where forwards alone took the
fourth and third forward (the fourth and third mini-batch).

**What a hiccup can fake** (the false-positive argument). The watch counts passes,
so the rule is one of duration, and with two passes per mini-batch a streak spans
half the mini-batches it did:

- a pass held up on its own (the noise of ``tests/unit/training/
  test_forward_watch.py``: one pass in 20 held up 3-6x, independently, on a
  lognormal spread of 0.25): on a host that does that, three in a row come about
  once in 7,000 passes and four about once in 150,000; per pass nothing changes, per
  mini-batch there are twice the passes: over four seeded series of 500,000
  mini-batches, 14 false verdicts in a million mini-batches (8 from their forwards
  alone, as before);
- a slowdown of the whole host (other processes taking a share of the core for a
  while) stretches every pass it covers: to fake a verdict it must slow the stage
  beyond ``factor`` for about two mini-batches (F B, the update, F B: two periods
  less an update), where forwards alone it had to last three periods and a forward;
  beyond 8x, for a period and a forward (F B F), where forwards alone took two
  periods and a forward. That is the price of seeing a step twice as soon, and
  nothing tells the two apart sooner: a slowdown that lasts is what the watch
  reports. A verdict costs one look, and a look that keeps the cuts pauses nothing;
- no pass counts twice. There is one streak over both kinds, in the order the passes
  ran, and a normal pass of either kind ends it: a hiccup that holds up a forward
  while the backward after it runs at its usual time is not carried across that
  backward (every forward in a hiccup, every backward normal: no verdict; forwards
  alone fired at the third). Each pass joins only its own kind's history. A stall
  (the core taken away) holds up only the pass it falls in: the pass ends after the
  stall, and the next one starts after that. A hiccup that holds up a forward and
  the backward right after it (the backward follows at once in 1F1B) is two slow
  passes, as it is a slowdown that covers both: with one such pair in 20
  mini-batches, two in a row fake a verdict, 2,458 times in a million mini-batches
  (29 from their forwards alone) over the same four series: the second case at its
  shortest. Real passes are far from that: in a traced run shaped as ``r24_middle``
  without its change (four emulated devices, 500 mini-batches each, load 2.6-3.3 on
  two cores), 4.9% of the passes lay beyond 2x their kind's median and 6.1% of the
  passes right after such a pass did (near independence, not pairs), and neither
  watch fired on any stage, at factor 2 or 3.

A move is also when a device is most likely caught changing unseen: in
``bench/training_async.py``'s ``r24_middle`` the device slows during the first
move's pause, so every pass on the new cuts is already slow and a watch that starts
from nothing takes them for its baseline (the loss watch then saw it eight slow
mini-batches later). So :meth:`ForwardWatch.reset` takes a ``scale``: the new
units' share of the old (by count, or by work where known), and until ``least``
passes of a kind on the new cuts are in, that kind's old median times ``scale`` is a
provisional baseline, judged with ``PROVISIONAL_MARGIN`` times the factor (4 at the
usual 2: a scale by count is off when a fixed cost per pass does not scale, and a
loaded host's waits for a core add to every pass alike, which shrinks a ratio: a
wait of three times the work makes 10x read 7.5x; with a margin of 4, 8 in all, one
``r24_middle`` run at load 5 on two cores relayed no verdict at all). A wrong verdict
costs one look, and a look that keeps the cuts pauses nothing.

A step far beyond any hiccup need not wait for ``k`` passes: a streak whose every
pass lies beyond ``FAR_MARGIN`` times the factor (8x its kind's median at the usual
2) fires on its ``far_k``-th pass (3 by default; None: off). Why that is no less
safe: the host's hiccups the ``k`` rule is sized for hold a pass up 3-6x, short of
8x on their own, but with the noise on top of them (that of the tests above) one pass
in about 745 lies beyond 8x. Two in a row then come about once in 550,000 passes,
and that test's seeded series holds such a pair; three in a row, about once in 4e8,
add nothing to the ``k`` rule's rate. A loaded host's waits for a core shrink a real
step's ratio (10x read 7.5x at load 5; ``r24_middle``'s 10x read 8.2x at load 4):
then the far rule does not fire and the ``k`` rule sees the step as before, so no
step is seen later than without it. (A backward's ratio shrinks less than a
forward's: the same wait is a smaller share of a longer pass.)

What to do with a verdict (tell the coordinator, so that the run is looked at before
its next scheduled look) is the caller's. Its ``ratio`` is the median, over the
streak, of each pass over its own kind's baseline, so forwards and backwards of one
step agree; ``baseline_s`` is the forwards' baseline and ``now_s`` that times the
ratio (in forward seconds, as a watch of forwards alone reported). The cost per
pass is a comparison with a cached median; each kind's median is recomputed once
every ``history // 4`` passes of it and when a streak starts (a few microseconds: a
sort of ``history`` floats).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Literal

from zpipe._errors import ConfigError

# how much further than ``factor`` a pass must lie from a provisional baseline (the
# old median scaled after a move) to count: the scale is a guess (see the notes)
PROVISIONAL_MARGIN = 2.0
# how much further than ``factor`` every pass of a streak must lie for the streak to
# count at ``far_k`` passes, not ``k``: beyond any host hiccup (see the notes)
FAR_MARGIN = 4.0

PassKind = Literal["forward", "backward"]
PASS_KINDS: tuple[PassKind, ...] = ("forward", "backward")


@dataclass(frozen=True)
class SpeedChange:
    """A sustained change of a stage's compute time: ``ratio`` is the median of the
    streak's passes, each over its own kind's baseline (> 1: slower); ``baseline_s``
    is the forwards' baseline (the backwards' when no forward was judged yet) and
    ``now_s`` that baseline times ``ratio``: in forward seconds either way."""

    ratio: float
    baseline_s: float
    now_s: float


@dataclass(frozen=True)
class _Judged:
    """A pass of the current streak: its kind, its seconds and the baseline it was
    judged against (its own kind's)."""

    kind: PassKind
    seconds: float
    base: float


class _KindBaseline:
    """One kind's recent passes and their cached median; the old median scaled, until
    ``least`` passes are in, after a move (see the module notes)."""

    def __init__(self, history: int) -> None:
        self.history: deque[float] = deque(maxlen=history)
        self.refresh = max(history // 4, 1)  # passes between two medians
        self.cached: float | None = None
        self.stale = 0  # passes added since the cached median
        self.provisional: float | None = None

    def add(self, seconds: float) -> None:
        self.history.append(seconds)
        self.stale += 1

    def median(self, *, fresh: bool = False) -> float:
        if self.cached is None or fresh or self.stale >= self.refresh:
            self.cached = statistics.median(self.history)
            self.stale = 0
        return self.cached

    def restart(self, seconds: list[float], provisional: float | None) -> None:
        """Forget every pass; ``seconds`` are the first of the new level."""
        self.history.clear()
        self.cached, self.stale, self.provisional = None, 0, provisional
        for value in seconds:
            self.add(value)


class ForwardWatch:
    """Whether a stage's forwards and backwards changed speed for good (see the module
    notes; named after the ``forward_watch`` setting that turns it on)."""

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
        # a far streak never needs more passes than any streak
        self.far_k = self.k if far_k is None else min(int(far_k), self.k)
        self.least = int(least)
        self._kinds = {kind: _KindBaseline(int(history)) for kind in PASS_KINDS}
        # one streak for both kinds, in the order the passes ran: a normal pass of
        # either kind ends it (see the module notes: no pass is counted twice)
        self._streak: list[_Judged] = []
        self._side = 0  # the streak's side: 1 slower, -1 faster
        self._far = True  # every pass of the streak lies beyond FAR_MARGIN x factor

    def reset(self, scale: float | None = None) -> None:
        """Forget every pass (the stage's units changed); with ``scale`` (the new units'
        work over the old), each kind's old median times it is that kind's provisional
        baseline until ``least`` new passes of it are in (see the module notes)."""
        for baseline in self._kinds.values():
            provisional = None
            if scale is not None and math.isfinite(scale) and scale > 0 and baseline.history:
                provisional = baseline.median(fresh=True) * scale
            baseline.restart([], provisional)
        self._streak, self._side, self._far = [], 0, True

    def observe(self, seconds: float, kind: PassKind = "forward") -> SpeedChange | None:
        """One pass's seconds (a forward, or a backward); the change when this pass
        completes a streak. An unknown ``kind`` is refused (:class:`ConfigError`)."""
        if kind not in self._kinds:
            raise ConfigError(
                f"a forward watch judges passes of kind {' or '.join(PASS_KINDS)}, got {kind!r}"
            )
        if not (seconds > 0 and math.isfinite(seconds)):
            return None  # nothing to learn from a clock that did not move
        own = self._kinds[kind]
        provisional = own.provisional is not None and len(own.history) < self.least
        if len(own.history) < self.least and not provisional:
            own.add(seconds)  # this kind has no baseline yet: the streak goes on without it
            return None
        factor = self.factor * PROVISIONAL_MARGIN if provisional else self.factor
        base = own.provisional if provisional else own.median()
        assert base is not None
        side = self._side_of(seconds, base, factor)
        if side == 0 or side != self._side:
            # a streak ends (noise: its passes join their own kind's history as any
            # other); a new one is judged on a current median
            self._end_streak()
            if side != 0 and not provisional:
                base = own.median(fresh=True)
                side = self._side_of(seconds, base, factor)
            if side == 0:
                own.add(seconds)
                return None
            self._side = side
        self._streak.append(_Judged(kind, seconds, base))
        self._far = self._far and self._side_of(seconds, base, factor * FAR_MARGIN) == side
        if len(self._streak) < (self.far_k if self._far else self.k):
            return None
        return self._fire()

    def _fire(self) -> SpeedChange:
        """The streak is a verdict: its passes are the new level from here on."""
        ratio = statistics.median(judged.seconds / judged.base for judged in self._streak)
        baseline_s = self._baseline_of("forward") or self._baseline_of("backward")
        assert baseline_s is not None  # the streak judged at least one kind
        for kind, baseline in self._kinds.items():
            seconds = [judged.seconds for judged in self._streak if judged.kind == kind]
            old = self._baseline_of(kind)
            # a kind the streak did not see (a stage's warm-up forwards): its old level
            # moved by the ratio, judged as a move's until it has its own
            provisional = old * ratio if not seconds and old is not None else None
            baseline.restart(seconds, provisional)
        self._streak, self._side, self._far = [], 0, True
        return SpeedChange(ratio, baseline_s, baseline_s * ratio)

    def _baseline_of(self, kind: PassKind) -> float | None:
        """What ``kind``'s passes are judged against now (None: nothing yet)."""
        baseline = self._kinds[kind]
        if baseline.provisional is not None and len(baseline.history) < self.least:
            return baseline.provisional
        if len(baseline.history) < self.least:
            return None
        return baseline.median()

    def _end_streak(self) -> None:
        for judged in self._streak:
            self._kinds[judged.kind].add(judged.seconds)
        self._streak, self._side, self._far = [], 0, True

    def _side_of(self, seconds: float, base: float, factor: float) -> int:
        if seconds > factor * base:
            return 1
        return -1 if seconds * factor < base else 0
