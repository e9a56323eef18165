"""Deadlines that adapt to observed latency, so a slow device is not declared dead.

A fixed timeout is either too short for a device that is merely slow (a
straggler, a load spike) or too long to notice a dead one quickly. Here the
deadline on a wait (a heartbeat's answer, FTPipeHD's backward of a
mini-batch at the data source) follows the latencies seen recently:

    deadline = max(floor, median + k * max(MAD, mad_floor_ratio * median))

over the last ``window`` observations, where MAD is the median absolute
deviation: unlike a mean and standard deviation, one stalled observation
neither drags the centre nor inflates the spread. The spread has a floor
relative to the median because identical samples give a MAD of 0, which
would make any jitter late. Until ``min_samples`` observations exist the
deadline is the cold-start value (or a multiple of the slowest latency seen,
if that is longer): the first mini-batches include warm-up and allocation.

Past its deadline a wait is judged by whether the device still shows life
(answers heartbeats or the coordinator's probe, Asteroid section 3.4):
``SLOW`` if it does (rebalance its work; its completed latencies widen the
window, so the deadline follows it), ``DEAD`` if it does not (re-plan
without it). Nothing here reads a clock: callers pass elapsed times.

Liveness (:class:`HeartbeatWatch`) uses the same deadline over a member's heartbeat
gaps, with one more term: ``tail_factor`` times the longest gap in the window. The
median and MAD are robust to a stall, which is what a wait on work wants and what a
liveness check must not have: a process starved of CPU for 2 s that then spoke
again is alive, and will be starved again; its deadline keeps that gap (with a
margin) for as long as the gap is in its window.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from zpipe._errors import ConfigError


class Verdict(enum.Enum):
    ON_TIME = "on_time"
    SLOW = "slow"  # late, but it answers: rebalance, do not re-plan around it
    DEAD = "dead"  # late and silent: re-plan without it


@dataclass(frozen=True)
class DeadlinePolicy:
    """How a deadline adapts: ``k`` spreads over the median, a window, a floor and a cold start."""

    k: float = 5.0
    window: int = 64
    min_samples: int = 8
    floor_s: float = 0.5
    cold_start_s: float = 60.0
    cold_factor: float = 3.0
    mad_floor_ratio: float = 0.05
    # the deadline is at least this multiple of the longest sample in the window
    # (0: off; a liveness deadline keeps the longest gap a live member has shown)
    tail_factor: float = 0.0

    def __post_init__(self) -> None:
        for name in (
            "k",
            "floor_s",
            "cold_start_s",
            "cold_factor",
            "mad_floor_ratio",
            "tail_factor",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not (
                isinstance(value, (int, float)) and math.isfinite(value) and value >= 0
            ):
                raise ConfigError(f"deadline policy: {name} must be a number >= 0, got {value!r}")
        for name in ("window", "min_samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"deadline policy: {name} must be an integer >= 1, got {value!r}")
        if self.min_samples > self.window:
            raise ConfigError(
                f"deadline policy: min_samples ({self.min_samples}) cannot exceed the window "
                f"({self.window}), or the deadline would never leave its cold-start value"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeadlinePolicy:
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"deadline policy: unknown key(s) {sorted(unknown)}")
        return cls(**data)


def adaptive_deadline(samples: Sequence[float], policy: DeadlinePolicy | None = None) -> float:
    """The deadline, in seconds, after the latencies ``samples`` (oldest first)."""
    p = policy or DeadlinePolicy()
    recent = list(samples)[-p.window :]
    if len(recent) < p.min_samples:
        return max(p.floor_s, p.cold_start_s, p.cold_factor * max(recent, default=0.0))
    centre = statistics.median(recent)
    mad = statistics.median(abs(x - centre) for x in recent)
    spread = centre + p.k * max(mad, p.mad_floor_ratio * centre)
    return max(p.floor_s, spread, p.tail_factor * max(recent))


def judge_wait(elapsed_s: float, deadline_s: float, *, responsive: bool) -> Verdict:
    """A wait of ``elapsed_s`` against its deadline; ``responsive``: the device answered since."""
    if elapsed_s <= deadline_s:
        return Verdict.ON_TIME
    return Verdict.SLOW if responsive else Verdict.DEAD


class LatencyWindow:
    """The last latencies of one kind of wait on one device, and the deadline they give."""

    def __init__(self, policy: DeadlinePolicy | None = None, samples: Iterable[float] = ()) -> None:
        self.policy = policy or DeadlinePolicy()
        self._samples: deque[float] = deque(maxlen=self.policy.window)
        for s in samples:
            self.observe(s)

    def observe(self, latency_s: float) -> None:
        """Record a completed wait (late ones too: that is how a slow device's deadline grows)."""
        if not (math.isfinite(latency_s) and latency_s >= 0):
            raise ConfigError(f"a latency must be a number of seconds >= 0, got {latency_s!r}")
        self._samples.append(float(latency_s))

    @property
    def samples(self) -> list[float]:
        return list(self._samples)

    def deadline(self) -> float:
        return adaptive_deadline(self._samples, self.policy)

    def judge(self, elapsed_s: float, *, responsive: bool) -> Verdict:
        return judge_wait(elapsed_s, self.deadline(), responsive=responsive)


# The data source's deadline: a unit out for longer than median + 5 MAD of the recent
# latencies (at least 0.25 s; 10 s for the first four, which include warm-up) has the
# coordinator probe the stages. A false alarm costs one probe message per stage.
DEFAULT_STALL_DEADLINE = DeadlinePolicy(
    k=5.0, window=32, min_samples=4, floor_s=0.25, cold_start_s=10.0
)


class StallWatch:
    """FTPipeHD's deadline at the data source: how long the source may wait for the
    result of work in flight before it asks whether a device died.

    The source calls :meth:`sent` when it starts a unit of work (a mini-batch, a
    micro-batch) and :meth:`completed` when one comes back; results come back in
    order. The deadline is on the age of the oldest unit still out, against the
    latencies (sent to result) of the units before it: queueing behind earlier
    units is in those latencies as it is in the age, and a unit sent into an empty
    pipeline is younger than the usual latency, not older. :meth:`stalled` reports
    a unit past its deadline once; the caller then has the devices probed: a device
    that answers is slow, and its late result widens the window, so the deadline
    follows it.
    """

    def __init__(self, policy: DeadlinePolicy | None = None) -> None:
        self.latency = LatencyWindow(policy)
        self._out: deque[float] = deque()  # when each unit still out was sent
        self._reported = False  # the oldest unit's stall was reported

    @property
    def outstanding(self) -> int:
        return len(self._out)

    def sent(self, now: float) -> None:
        self._out.append(now)

    def completed(self, now: float) -> None:
        if not self._out:
            raise ConfigError("a result came back with no work in flight")
        self.latency.observe(max(0.0, now - self._out.popleft()))
        self._reported = False

    def deadline(self) -> float:
        """The deadline on the oldest unit's age."""
        return self.latency.deadline()

    def stalled(self, now: float) -> tuple[float, float] | None:
        """(age, deadline) the first time the oldest unit passes its deadline."""
        if not self._out or self._reported:
            return None
        age, deadline = now - self._out[0], self.deadline()
        if age <= deadline:
            return None
        self._reported = True
        return age, deadline


# Heartbeat gaps and response delays of one member. The floors are the caller's
# (the configured suspect and probe times); these only ever lengthen them. Four gaps
# are enough to leave the cold start (where the deadline is twice the longest gap
# seen, so one early stall is covered at once); the window of 128 gaps keeps a stall
# in mind for about two minutes at a heartbeat a second. Twice the longest gap, not
# 1.5 times: over 240,000 simulated log-normal gaps (sigma 0.5) 1.5 lost a live
# member three times, 2 never (tests/unit/coordinator/test_membership.py keeps one such run).
DEFAULT_HEARTBEAT_GAPS = DeadlinePolicy(
    k=5.0,
    window=128,
    min_samples=4,
    floor_s=0.0,
    cold_start_s=0.0,
    cold_factor=2.0,
    tail_factor=2.0,
)


class HeartbeatWatch:
    """One member's liveness deadlines, from when its heartbeats and probe answers came.

    ``suspect_deadline()``: how long the member may be silent before it is suspected
    and probed, ``max(suspect_floor_s, deadline of its heartbeat gaps)``.
    ``probe_deadline()``: how long a probe waits for an answer,
    ``max(probe_floor_s, deadline of its response delays)``, where a response delay
    is a probe's round trip or a heartbeat's lateness (its gap past the interval):
    both measure how long the member's event loop takes to get to a message. A
    member that is late but speaks widens its own deadlines; one that was punctual
    keeps the floors, so its death is found as fast as with fixed deadlines.
    """

    def __init__(
        self,
        *,
        interval_s: float,
        suspect_floor_s: float,
        probe_floor_s: float,
        policy: DeadlinePolicy = DEFAULT_HEARTBEAT_GAPS,
    ) -> None:
        self.interval_s = interval_s
        self.suspect_floor_s = suspect_floor_s
        self.probe_floor_s = probe_floor_s
        self.gaps = LatencyWindow(policy)
        self.responses = LatencyWindow(policy)
        self._last_heartbeat: float | None = None
        # (suspect, probe) deadlines, computed again only after a new sample: the
        # coordinator asks for them on every tick, a few times per heartbeat
        self._deadlines: tuple[float, float] | None = None

    def heartbeat(self, now: float) -> None:
        """A heartbeat arrived at ``now``."""
        if self._last_heartbeat is not None:
            gap = max(0.0, now - self._last_heartbeat)
            self.gaps.observe(gap)
            self.responses.observe(max(0.0, gap - self.interval_s))
            self._deadlines = None
        self._last_heartbeat = now

    def forgive(self, paused_s: float) -> None:
        """The watcher itself was paused for ``paused_s``: the gap now running is not
        the member's lateness, so it is measured as if the pause had not happened."""
        if self._last_heartbeat is not None and paused_s > 0:
            self._last_heartbeat += paused_s

    def probe_answered(self, round_trip_s: float) -> None:
        self.responses.observe(max(0.0, round_trip_s))
        self._deadlines = None

    def deadlines(self) -> tuple[float, float]:
        """(suspect, probe) deadlines in seconds."""
        if self._deadlines is None:
            self._deadlines = (
                max(self.suspect_floor_s, self.gaps.deadline()),
                max(self.probe_floor_s, self.responses.deadline()),
            )
        return self._deadlines

    def suspect_deadline(self) -> float:
        return self.deadlines()[0]

    def probe_deadline(self) -> float:
        return self.deadlines()[1]
