"""What a stage did with each micro-batch, and when: a bounded ring of spans.

Every span is (micro-batch, phase, start, end) on this process's
``time.perf_counter`` clock. The phases a stage records:

- ``recv``: the data port decoding a message and handing it on (waiting while
  the compute queue is full: backpressure shows here);
- ``compute`` (inference) or ``forward``, ``backward``, ``allreduce``, ``step``
  (training): the compute thread's work, one at a time;
- ``send``: the send loop handing a result to the link (an emulated slow link
  shows here);
- ``flush`` (asynchronous training): drained at a flush, waiting to be resumed;
  ``snapshot`` and ``copy``: a copy made without draining, cloned in the compute
  thread and sent beside the data (:mod:`zpipe.stage.live_copies`).

Spans of one phase never overlap: each is recorded by one sequential loop. The
ring keeps the newest :data:`TIMELINE_CAPACITY` spans (``dropped`` counts the
rest), so a long run costs bounded memory.

Clocks differ between devices. :class:`ClockOffset` estimates the offset of the
coordinator's clock from this stage's out of heartbeat round trips (NTP's
estimate: the coordinator's time minus the midpoint of the round trip, taken
from the round trip with the shortest time, whose error is at most half of it);
the client shifts every stage's spans onto the coordinator's clock.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# about three spans per micro-batch: the newest ~2700 micro-batches of a run
TIMELINE_CAPACITY = 8192
PHASES = (
    "recv",
    "compute",
    "forward",
    "backward",
    "allreduce",
    "step",
    "send",
    "flush",
    "snapshot",
    "copy",
)

clock = time.perf_counter


@dataclass(frozen=True)
class Span:
    mb: int  # -1 when the span belongs to no single micro-batch (an all-reduce, a step)
    phase: str
    start: float
    end: float


class Timeline:
    """The newest spans of the current run (see the module notes)."""

    def __init__(self, capacity: int = TIMELINE_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"a timeline holds at least one span, got {capacity}")
        self._spans: deque[tuple[int, str, float, float]] = deque(maxlen=capacity)
        self.recorded = 0

    def record(self, mb: int, phase: str, start: float, end: float) -> None:
        self._spans.append((mb, phase, start, end))
        self.recorded += 1

    @property
    def dropped(self) -> int:
        return self.recorded - len(self._spans)

    def spans(self) -> list[Span]:
        return [Span(*s) for s in self._spans]

    def newest(self) -> Iterator[Span]:
        """The spans newest first, built one at a time: a reader that wants the last
        few stops early instead of copying the whole ring (a look reads a stage's
        newest forwards while it trains)."""
        for span in reversed(self._spans):
            yield Span(*span)

    def clear(self) -> None:
        self._spans.clear()
        self.recorded = 0

    def to_wire(self, offset: ClockOffset | None = None) -> dict[str, Any]:
        """The ``timeline`` of a ``metrics`` reply: spans as [mb, phase, start, end]
        lists, and the clock offset to the coordinator when one was measured."""
        timeline: dict[str, Any] = {
            "spans": [list(s) for s in self._spans],
            "dropped": self.dropped,
        }
        if offset is not None and offset.offset_s is not None:
            timeline["offset_s"] = offset.offset_s
            timeline["rtt_s"] = offset.rtt_s
        return timeline


class ClockOffset:
    """The coordinator's clock minus this stage's, from the best round trip seen."""

    def __init__(self) -> None:
        self.offset_s: float | None = None
        self.rtt_s: float | None = None

    def observe(self, sent: float, remote: float, received: float) -> None:
        """A heartbeat sent at ``sent`` and acknowledged at ``received`` (this clock),
        which the coordinator stamped ``remote`` (its clock)."""
        rtt = received - sent
        if not (math.isfinite(rtt) and math.isfinite(remote)) or rtt < 0:
            return  # a reply to something else, or a mangled stamp
        if self.rtt_s is None or rtt < self.rtt_s:
            self.rtt_s = rtt
            self.offset_s = remote - (sent + received) / 2
