"""How late the coordinator's event loop wakes: its lag, as a window of samples. Pure.

A task asks to wake every few tens of milliseconds; how much later than asked it
woke is the time the loop was busy with other work (or the process was starved
of CPU). Heartbeat acknowledgements and probes wait as long, so this is
the number that must stay small while a coordinator holds hundreds of members.

Which of the two a late wake was is told by the loop thread's own CPU time over
the sample (``busy``): a wake 100 ms late after 3 ms of the loop's work waited
for a core (or for a blocking call), one after 100 ms of work was the loop's own.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class LagSummary:
    samples: int
    p50_s: float
    p99_s: float
    max_s: float
    # the loop thread's CPU time within a sample (its sleep and its lateness): p99, max
    busy_p99_s: float = 0.0
    busy_max_s: float = 0.0

    def to_fields(self) -> dict[str, float | int]:
        return {
            "samples": self.samples,
            "p50_ms": round(self.p50_s * 1e3, 3),
            "p99_ms": round(self.p99_s * 1e3, 3),
            "max_ms": round(self.max_s * 1e3, 3),
            "busy_p99_ms": round(self.busy_p99_s * 1e3, 3),
            "busy_max_ms": round(self.busy_max_s * 1e3, 3),
        }


class LoopLag:
    """The last ``window`` lateness samples and when to report them."""

    def __init__(self, *, window: int = 2048, report_every_s: float = 10.0) -> None:
        self._samples: deque[float] = deque(maxlen=window)
        self._busy: deque[float] = deque(maxlen=window)
        self.report_every_s = report_every_s
        self._reported_at: float | None = None

    def woke(self, asked_at: float, woke_at: float, busy_s: float = 0.0) -> None:
        """The loop asked to wake at ``asked_at`` and woke at ``woke_at``, its thread
        having run for ``busy_s`` of CPU since it asked."""
        self._samples.append(max(0.0, woke_at - asked_at))
        self._busy.append(max(0.0, busy_s))

    def summary(self) -> LagSummary | None:
        if not self._samples:
            return None
        ordered = sorted(self._samples)
        busy = sorted(self._busy)
        n = len(ordered)
        p99 = min(n - 1, int(0.99 * n))
        return LagSummary(n, ordered[n // 2], ordered[p99], ordered[-1], busy[p99], busy[-1])

    def due(self, now: float) -> LagSummary | None:
        """The summary to report now (every ``report_every_s``), else None; a report
        starts a new window."""
        if self._reported_at is None:
            self._reported_at = now
            return None
        if now - self._reported_at < self.report_every_s:
            return None
        self._reported_at = now
        summary = self.summary()
        self._samples.clear()
        self._busy.clear()
        return summary
