"""Per-peer rate limits, so that one flooding peer cannot take a socket's loop time.

A stage's probe port answers every cluster member (link probes, backups, unit
fetches). A peer that floods it with small messages made the stage's event
loop spend its time decoding and answering them, and heartbeats and the
coordinator's probes went out late enough for a live stage to be declared
dead. :class:`PeerRateLimiter` keeps a token bucket per peer: a peer within its
rate is served as before, and the excess of a flooding peer is dropped before
it is decoded, counted, and reported by a log line at most every
``report_every_s`` (:meth:`PeerRateLimiter.report_due`), so the flood cannot
flood the log either. Peers are told apart by their CURVE key when there is
one (an attacker cannot make new keys), else by connection.

Pure: every method takes ``now`` (seconds, any monotonic clock), so tests drive
it with a fake clock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from zpipe._errors import ConfigError

# A link measurement sends bursts of up to 32 MiB in chunks of at least 64 KiB
# (zpipe.stage.linkprobe.ProbeSettings): about 512 messages at once, several
# times a second while the coordinator measures links.
DEFAULT_RATE_PER_S = 2000.0
DEFAULT_BURST = 1024.0
# Buckets remembered at once: a connection flood without keys makes a new peer
# per connection; the oldest are forgotten (a forgotten peer starts full again).
DEFAULT_MAX_PEERS = 1024
DEFAULT_REPORT_EVERY_S = 5.0


@dataclass
class TokenBucket:
    """``burst`` tokens, refilled at ``rate_per_s``; a message takes one."""

    rate_per_s: float
    burst: float
    tokens: float
    updated: float

    @classmethod
    def full(cls, rate_per_s: float, burst: float, now: float) -> TokenBucket:
        return cls(rate_per_s, burst, burst, now)

    def take(self, now: float, cost: float = 1.0) -> bool:
        """Take ``cost`` tokens if there are that many now; False leaves the bucket as is."""
        if now > self.updated:
            self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate_per_s)
            self.updated = now
        if self.tokens >= cost:
            self.tokens -= cost
            return True
        return False


@dataclass(frozen=True)
class FloodReport:
    """What was dropped since the last report: in all, and by the worst peer."""

    dropped: int
    worst_peer: bytes
    worst_dropped: int
    over_s: float


@dataclass
class PeerRateLimiter:
    rate_per_s: float = DEFAULT_RATE_PER_S
    burst: float = DEFAULT_BURST
    max_peers: int = DEFAULT_MAX_PEERS
    report_every_s: float = DEFAULT_REPORT_EVERY_S
    dropped_total: int = 0
    _buckets: OrderedDict[bytes, TokenBucket] = field(default_factory=OrderedDict)
    _dropped_since: dict[bytes, int] = field(default_factory=dict)
    _last_report: float | None = None

    def __post_init__(self) -> None:
        if not (self.rate_per_s > 0 and self.burst >= 1 and self.max_peers >= 1):
            raise ConfigError(
                f"a rate limit needs rate_per_s > 0, burst >= 1 and max_peers >= 1, got "
                f"{self.rate_per_s}, {self.burst}, {self.max_peers}"
            )

    def allow(self, peer: bytes, now: float) -> bool:
        """Whether ``peer``'s next message is served; an excess one is counted as dropped."""
        bucket = self._buckets.get(peer)
        if bucket is None:
            bucket = TokenBucket.full(self.rate_per_s, self.burst, now)
            self._buckets[peer] = bucket
            while len(self._buckets) > self.max_peers:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(peer)
        if bucket.take(now):
            return True
        self.dropped_total += 1
        if peer in self._dropped_since or len(self._dropped_since) < self.max_peers:
            self._dropped_since[peer] = self._dropped_since.get(peer, 0) + 1
        if self._last_report is None:
            self._last_report = now - self.report_every_s  # the first drop is reported at once
        return False

    def report_due(self, now: float) -> FloodReport | None:
        """A report of the drops since the last one, at most every ``report_every_s``;
        None when nothing was dropped or the last report is too recent."""
        if not self._dropped_since or self._last_report is None:
            return None
        if now - self._last_report < self.report_every_s:
            return None
        worst = max(self._dropped_since, key=lambda p: self._dropped_since[p])
        report = FloodReport(
            dropped=sum(self._dropped_since.values()),
            worst_peer=worst,
            worst_dropped=self._dropped_since[worst],
            over_s=now - self._last_report,
        )
        self._dropped_since.clear()
        self._last_report = now
        return report
