"""Time-varying device speed for experiments: a slowdown that follows a schedule.

``--slowdown-schedule "0:1,60:10"`` plays a device at full speed for its first
60 seconds and 10 times slower from then on, so a device turns into a straggler
mid-run (FTPipeHD's experiment). Each entry is ``seconds:factor``: from that
many seconds on, compute takes ``factor`` times its work
(:func:`zpipe.transport.emulation.emulate_slowdown`). The seconds count from
the stage's first compute step (its first forward), not from its start, so a
schedule means the same whatever the cluster's start-up took.

A :class:`SlowdownClock` stands where a fixed factor stands: shards ask it for
the factor of each step (:func:`slowdown_factor`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from zpipe._errors import ConfigError

MAX_FACTOR = 1000.0


@dataclass(frozen=True)
class SlowdownSchedule:
    """``(from_s, factor)`` pairs in increasing time, the first at 0."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        if not self.points:
            raise ConfigError("a slowdown schedule needs at least one seconds:factor entry")
        if self.points[0][0] != 0:
            raise ConfigError(
                f"a slowdown schedule starts at 0 seconds (say the factor until the first "
                f"change, e.g. '0:1,{self.points[0][0]:g}:{self.points[0][1]:g}')"
            )
        for (a, _), (b, _) in zip(self.points, self.points[1:], strict=False):
            if not b > a:
                raise ConfigError(f"slowdown schedule times must increase: {a:g} then {b:g}")
        for at, factor in self.points:
            if not (math.isfinite(at) and at >= 0):
                raise ConfigError(f"a slowdown schedule time must be >= 0 seconds, got {at}")
            if not (math.isfinite(factor) and 1.0 <= factor <= MAX_FACTOR):
                raise ConfigError(
                    f"a slowdown factor must lie in 1..{MAX_FACTOR:g} (times slower), "
                    f"got {factor:g} at {at:g} s"
                )

    @classmethod
    def parse(cls, text: str) -> SlowdownSchedule:
        """``"0:1,60:10"`` -> factor 1 from 0 s, factor 10 from 60 s."""
        points = []
        for entry in text.split(","):
            seconds, sep, factor = entry.strip().partition(":")
            if not sep:
                raise ConfigError(
                    f"slowdown schedule entry {entry.strip()!r} is not seconds:factor "
                    "(e.g. '0:1,60:10')"
                )
            try:
                points.append((float(seconds), float(factor)))
            except ValueError:
                raise ConfigError(
                    f"slowdown schedule entry {entry.strip()!r}: seconds and factor must be "
                    "numbers (e.g. '60:10')"
                ) from None
        return cls(tuple(points))

    def factor_at(self, elapsed_s: float) -> float:
        factor = self.points[0][1]
        for at, value in self.points:
            if elapsed_s >= at:
                factor = value
        return factor

    def __str__(self) -> str:
        return ",".join(f"{at:g}:{factor:g}" for at, factor in self.points)


class SlowdownClock:
    """A schedule that starts at the first step it is asked about."""

    def __init__(
        self, schedule: SlowdownSchedule, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.schedule = schedule
        self._clock = clock
        self._started: float | None = None
        self._lock = threading.Lock()  # compute threads of several shards may ask

    def factor(self) -> float:
        with self._lock:
            now = self._clock()
            if self._started is None:
                self._started = now
            return self.schedule.factor_at(now - self._started)


Slowdown = float | SlowdownClock


def slowdown_factor(slowdown: Slowdown) -> float:
    """The factor of the step about to be timed."""
    return slowdown.factor() if isinstance(slowdown, SlowdownClock) else slowdown
