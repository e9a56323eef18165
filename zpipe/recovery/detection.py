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

    def __post_init__(self) -> None:
        for name in ("k", "floor_s", "cold_start_s", "cold_factor", "mad_floor_ratio"):
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
    return max(p.floor_s, centre + p.k * max(mad, p.mad_floor_ratio * centre))


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
