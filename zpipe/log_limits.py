"""A cap on the lines a flood of bad input can write to a log.

Every dropped message is logged (peer, reason), which is what an operator needs
for the first few; a peer that sends a hundred thousand junk messages a second
would otherwise write tens of megabytes of log per minute and spend the
process's CPU on it. :class:`FloodLimit` is a structlog processor: for the
events it names, each (event, peer) pair keeps a token bucket (a burst, then a
steady rate); past it the event is counted and dropped, and the next line that
passes carries ``suppressed=N``, the lines left out since the last one. Other
events, and other peers' drops, are never held back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import structlog

# the events a peer's bad input makes a process write, one per message
FLOOD_EVENTS = frozenset(
    {
        "dropped_message",
        "fl_message_dropped",
        "probe_dropped",
        "probe_flood_dropped",
        "lossy_ack_dropped",
        "role_refused",
        "backup_refused",
        "fetch_refused",
        "peer_refused",
        "connection_cut",
    }
)
BURST = 50  # lines of one event from one peer before the rate applies
PER_SECOND = 5.0  # then this many a second, per event and peer
MAX_KEYS = 4096  # (event, peer) pairs remembered; the oldest is forgotten first


@dataclass
class _Bucket:
    tokens: float
    at: float
    suppressed: int = 0


@dataclass
class FloodLimit:
    """structlog processor: rate-limits :data:`FLOOD_EVENTS` per (event, peer)."""

    events: frozenset[str] = FLOOD_EVENTS
    burst: int = BURST
    per_second: float = PER_SECOND
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[tuple[str, str], _Bucket] = field(default_factory=dict)

    def __call__(
        self, _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        event = event_dict.get("event")
        if event not in self.events:
            return event_dict
        key = (str(event), str(event_dict.get("peer", "")))
        now = self.clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= MAX_KEYS:  # many peers: forget the oldest pair
                self._buckets.pop(next(iter(self._buckets)))
            bucket = self._buckets[key] = _Bucket(tokens=float(self.burst), at=now)
        bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.at) * self.per_second)
        bucket.at = now
        if bucket.tokens < 1.0:
            bucket.suppressed += 1
            raise structlog.DropEvent
        bucket.tokens -= 1.0
        if bucket.suppressed:
            event_dict["suppressed"] = bucket.suppressed
            bucket.suppressed = 0
        return event_dict
