"""When fl-server probes a client for its latency, and what a probe measured (pure).

A task measures its client's response latency; a client that holds no task
(Eco-FL's dropped clients: no group's range admits them, so none selects
them) is never measured again, and Algorithm 1 could never re-admit it. So
the server probes such clients: an ``fl_probe`` asks the client to do the
work of a small task (its ``--profile-steps`` SGD steps, at its current
speed) and answer; the round trip is its latency, as a task's is. A probe
unanswered within ``timeout_s`` measures ``timeout_s``: a lower bound, which
keeps a silent client out of every group's range, as a task timeout does.

Each client has at most one probe out and is probed again only
``interval_s`` after its last probe ended. This module only decides; the
shell sends the probes and feeds what they measured to the server object.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from zpipe._errors import ConfigError


@dataclass(frozen=True)
class ProbeResult:
    probe_id: int
    client_id: int
    latency_s: float
    answered: bool  # False: it timed out, and latency_s is the timeout


@dataclass
class _Probe:
    client_id: int
    sent_at: float


@dataclass
class ProbeSchedule:
    interval_s: float  # 0: never probe
    timeout_s: float
    _out: dict[int, _Probe] = field(default_factory=dict)
    _ended_at: dict[int, float] = field(default_factory=dict)
    _next_id: int = 0

    @property
    def sent(self) -> int:
        return self._next_id

    def __post_init__(self) -> None:
        if not (self.interval_s >= 0 and math.isfinite(self.interval_s)):
            raise ConfigError(f"the probe interval must be finite and >= 0, not {self.interval_s}")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ConfigError(f"the probe timeout must be finite and > 0, not {self.timeout_s}")

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0

    def _probing(self, client_id: int) -> bool:
        return any(p.client_id == client_id for p in self._out.values())

    def _due_at(self, client_id: int) -> float:
        ended = self._ended_at.get(client_id)
        return -math.inf if ended is None else ended + self.interval_s

    def due(self, now: float, candidates: Iterable[int]) -> list[tuple[int, int]]:
        """(probe id, client) for each candidate to probe now; they count as sent."""
        if not self.enabled:
            return []
        chosen: list[tuple[int, int]] = []
        for client in sorted(set(candidates)):
            if self._probing(client) or self._due_at(client) > now:
                continue
            probe_id = self._next_id
            self._next_id += 1
            self._out[probe_id] = _Probe(client, now)
            chosen.append((probe_id, client))
        return chosen

    def answered(self, probe_id: int, client_id: int, now: float) -> ProbeResult | None:
        """The latency a reply measured; None for a probe that is not this client's
        (late, repeated, forged): the caller drops the message."""
        probe = self._out.get(probe_id)
        if probe is None or probe.client_id != client_id:
            return None
        del self._out[probe_id]
        self._ended_at[client_id] = now
        return ProbeResult(probe_id, client_id, max(0.0, now - probe.sent_at), True)

    def expired(self, now: float) -> list[ProbeResult]:
        """The probes whose deadline passed, each measuring the timeout."""
        late = [i for i, p in self._out.items() if p.sent_at + self.timeout_s <= now]
        results = []
        for probe_id in sorted(late):
            probe = self._out.pop(probe_id)
            self._ended_at[probe.client_id] = now
            results.append(ProbeResult(probe_id, probe.client_id, self.timeout_s, False))
        return results

    def outstanding(self) -> int:
        return len(self._out)

    def next_event(self, candidates: Iterable[int]) -> float:
        """When this schedule next has something to do: a deadline, or a probe due."""
        times = [p.sent_at + self.timeout_s for p in self._out.values()]
        if self.enabled:
            times += [self._due_at(c) for c in candidates if not self._probing(c)]
        return min(times, default=math.inf)
