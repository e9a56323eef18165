"""A training stage's watch of its own passes, as the message that reports a verdict.

Pure: a forward's or a backward's seconds in, a
:class:`~zpipe.protocol.repartition.SpeedChanged` out when
:class:`~zpipe.training.forward_watch.ForwardWatch` finds the device's speed
changed for good; no clock, no socket. The asynchronous executor feeds it each
forward's and each backward's compute time (the thread's own time, not the waits
for inputs or gradients: a stage that waits on a slow neighbour is not slow
itself), each judged against its own kind's median, so a slowdown is seen from two
passes per mini-batch; it sends what it returns to the coordinator, which relays it
to the run's client: the client then looks before its next mini-batch instead of
at its next scheduled look (``RepartitionSettings.forward_watch``). A verdict's
``step`` is the mini-batch of the pass that completed it (a backward's is older
than the newest forward's); its ``ratio`` is the streak's median of each pass over
its own kind's baseline, and ``baseline_s``/``now_s`` are in forward seconds.

A verdict names the plan epoch of the cuts its forwards ran on. A move changes
the stage's units, and so its forward time, with no change of the device: the
commit calls :meth:`StageSpeedWatch.committed`, which takes the new epoch and,
when this stage's units moved, forgets every pass (keeping each kind's old median,
scaled by the units' count, as a provisional baseline: a device that slows during
the move's pause would otherwise look like the new cuts' own time).
"""

from __future__ import annotations

from zpipe.protocol.repartition import SpeedChanged
from zpipe.training.forward_watch import ForwardWatch, PassKind


class StageSpeedWatch:
    """One stage's watch of its passes for run ``run`` (see the module notes)."""

    def __init__(
        self, *, run: int, name: str, epoch: int, factor: float, plan_epoch: int = 0
    ) -> None:
        self.run = run
        self.name = name
        self.epoch = epoch  # the run's (the envelope's), as every message of the run
        self.plan_epoch = plan_epoch
        self.watch = ForwardWatch(factor)
        self.verdicts = 0

    def observe(self, step: int, seconds: float, kind: PassKind = "forward") -> SpeedChanged | None:
        """Mini-batch ``step``'s pass of ``kind`` took ``seconds``: the report when
        that pass completes a verdict."""
        change = self.watch.observe(seconds, kind)
        if change is None:
            return None
        self.verdicts += 1
        return SpeedChanged(
            run=self.run,
            name=self.name,
            step=step,
            plan_epoch=self.plan_epoch,
            ratio=change.ratio,
            baseline_s=change.baseline_s,
            now_s=change.now_s,
            epoch=self.epoch,
        )

    def committed(self, plan_epoch: int, *, scale: float | None = None) -> None:
        """A commit switched the run to the cuts of ``plan_epoch``; ``scale`` (None: this
        stage's units did not change): the new units' share of the old, so its passes
        take another time from here on without the device changing. The watch starts
        again, from each kind's old median times ``scale`` until it has its own baseline
        (:meth:`~zpipe.training.forward_watch.ForwardWatch.reset`)."""
        self.plan_epoch = plan_epoch
        if scale is not None:
            self.watch.reset(scale)
