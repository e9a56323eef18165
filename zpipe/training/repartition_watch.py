"""An early look when the pipeline slows between two scheduled ones (FTPipeHD III-D).

FTPipeHD looks at the stages every ``every`` mini-batches. When a device slows down
right after a look, the run keeps the old cuts for all of the next ``every``
mini-batches, each now at the slowed period: the time to notice grows with the very
slowdown it should answer (in ``bench/training_async.py`` a look every 10 let ten
mini-batches run about 4x slower, 3.7 s, before the move). The client sees every
loss come back, so it can tell when the pipeline's period jumps: :class:`SlowdownWatch`
asks for a look as soon as the median of the last ``window`` gaps between losses is
``factor`` times the median of the interval between the two looks before
(``RepartitionSettings.watch``; 0: off, only the scheduled looks). The attempt's
start counts as a look: the losses before the first look are the baseline of the
interval after it (a first move that lands on a device slowing meanwhile left
ten mini-batches at 1.3 s each in ``bench/training_async.py``'s ``r24_middle``).

The look itself is the controller's as at any other time (its window is the
mini-batches since the last look): the watch changes when the pipeline is looked
at, never what a look decides. Only gaps between losses of mini-batches fed after
the last look count (a look that moves pauses the feed: that gap is the move's, not
the pipeline's), and an early look that keeps the cuts makes its own interval the
next baseline, so a pipeline that stays slow is not looked at over and over.

A look that moves the cuts makes the interval before it a wrong baseline: it ran
on the old cuts. In ``bench/training_async.py``'s ``r24_middle`` the first move (at
mini-batch 10) took the period from about 0.5 s (the even cuts) to 0.09-0.13 s; the
device then slowed and the losses came back at 0.93-1.0 s, under twice the old cuts'
0.5 s, so the watch never fired and ten to thirteen slow mini-batches ran before the
next scheduled look. After a move the baseline is the period the look predicted for
its new cuts (:meth:`SlowdownWatch.moved`); without one, the old interval's as
before (a move that lands on a device slowing meanwhile is still seen then).

Pure: the shell feeds the losses' times (its clock is an input here), the looks
and the mini-batches about to be fed.
"""

from __future__ import annotations

import math
import statistics

from zpipe._errors import ConfigError


class SlowdownWatch:
    """Whether to look before the next mini-batch because the losses slowed down."""

    def __init__(self, factor: float, *, window: int = 3) -> None:
        if not factor > 1.0:
            raise ConfigError(f"a slowdown watch's factor must be > 1, got {factor}")
        if window < 1:
            raise ConfigError(f"a slowdown watch's window must be >= 1, got {window}")
        self.factor = float(factor)
        self.window = int(window)
        self._since: int | None = None  # the last look's mini-batch (None: none yet)
        self._last: tuple[int, float] | None = None  # the last loss counted: (step, time)
        self._gaps: list[float] = []  # per mini-batch, since the last look
        self._baseline: float | None = None  # the interval before the last look's median

    def looked(self, step: int) -> None:
        """A look before mini-batch ``step`` (scheduled or early), or the attempt's
        start at ``step``: the interval that ended there becomes the baseline."""
        if self._gaps:
            self._baseline = statistics.median(self._gaps)
        self._since, self._last, self._gaps = step, None, []

    def moved(self, period_s: float | None) -> None:
        """The look just made (:meth:`looked`) moved the cuts, to ones it predicts run
        at ``period_s`` per mini-batch: that is the baseline, not the old cuts'
        interval (None or not > 0: not predicted, the old interval's stays)."""
        if period_s is not None and math.isfinite(period_s) and period_s > 0:
            self._baseline = float(period_s)

    def acknowledged(self, step: int, now: float) -> None:
        """Every mini-batch before ``step`` has its loss back, at time ``now``."""
        if self._since is None or step <= self._since:
            return  # before the first look, or a mini-batch fed before the last one
        if self._last is not None:
            before, at = self._last
            if step > before and now >= at:
                self._gaps.extend([(now - at) / (step - before)] * (step - before))
        self._last = (step, now)

    def due(self) -> bool:
        """Whether the pipeline has slowed since the last look (see the module notes)."""
        if self._baseline is None or self._baseline <= 0 or len(self._gaps) < self.window:
            return False
        recent = statistics.median(self._gaps[-self.window :])
        return recent > self.factor * self._baseline
