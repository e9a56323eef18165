"""When a live re-partition looks and what it may move to (FTPipeHD III-D): its
settings, as the run request carries them (:mod:`zpipe.training.repartition`).

``leave_out``: eq. 5 may give a device no units at all (the paper's ``l = j``,
PipeDream's choice of how many machines to use; :func:`zpipe.planner.ftpipehd.
ftpipehd_partition`): a device so slow that even one unit costs the pipeline more
than leaving it idle is left out, when that shortens the period by ``gain`` over
the best cuts that keep every device. Off by default (every device keeps a unit,
as before); sent only when set, so a peer from before it still parses the rest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zpipe._errors import ConfigError

_DAMPING: tuple[str, ...] = ("smoothing", "deviation", "revisit_gain", "revisit_looks")
_DAMPING += ("revisit_radius", "watch", "forward_watch", "leave_out")


@dataclass(frozen=True)
class RepartitionSettings:
    """When to look (after ``first`` batches, then every ``every``) and the predicted
    gain (a share of the period) a move must bring; ``bounds``: a test hook."""

    first: int = 10
    every: int = 100
    gain: float = 0.1
    bounds: tuple[int, ...] | None = None
    # the past looks' weight in a device's capacity: low, since a look's window that
    # straddles a real change shows only part of it, and more would delay the answer
    smoothing: float = 0.25
    deviation: float = 1.0  # beyond 1 + this times either way: a real change, not noise
    # hysteresis: a move back to cuts left within the last revisit_looks looks must
    # promise this much (revisit_gain <= gain or revisit_looks 0: no hysteresis)
    revisit_gain: float = 0.3
    revisit_looks: int = 10
    # cuts whose every boundary lies within this many units of cuts left count as
    # a move back (under load the fit dithers between neighbouring cuts)
    revisit_radius: int = 1
    # an early look when the losses come back this many times slower than between
    # the two looks before (zpipe.training.repartition_watch); 0: scheduled looks only
    watch: float = 0.0
    # an early look when a stage's own forwards run this many times slower or faster
    # for good (zpipe.training.forward_watch); 0: off, as ``watch`` (opted into)
    forward_watch: float = 0.0
    # eq. 5 may leave a device out (no units) when that beats keeping everyone by gain
    leave_out: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.leave_out, bool):
            raise ConfigError(
                f"repartition leave_out must be true or false, got {self.leave_out!r}"
            )
        counts: tuple[tuple[str, int], ...] = (
            ("first", 1),
            ("every", 1),
            ("revisit_looks", 0),
            ("revisit_radius", 0),
        )
        for name, least in counts:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(
                    f"repartition {name} must be an integer >= {least}, got {value!r}"
                )
        if not (isinstance(self.gain, (int, float)) and math.isfinite(self.gain)):
            raise ConfigError(f"repartition gain must be a number, got {self.gain!r}")
        if not 0 <= self.gain < 1:
            raise ConfigError(f"repartition gain must lie in [0, 1), got {self.gain}")
        for name, low, high in (
            ("smoothing", 0.0, 1.0),
            ("deviation", 0.0, math.inf),
            ("revisit_gain", 0.0, 1.0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"repartition {name} must be a number, got {value!r}")
            if not low <= value < high:
                raise ConfigError(
                    f"repartition {name} must lie in [{low:g}, {high:g}), got {value}"
                )
        for name in ("watch", "forward_watch"):
            watch = getattr(self, name)
            if isinstance(watch, bool) or not isinstance(watch, (int, float)):
                raise ConfigError(f"repartition {name} must be a number, got {watch!r}")
            if not (watch == 0 or (math.isfinite(watch) and watch > 1)):
                raise ConfigError(
                    f"repartition {name} must be 0 (off) or a factor > 1, got {watch}"
                )

    def due(self, done: int) -> bool:
        """Whether the pipeline is looked at after ``done`` batches."""
        return done == self.first or (done > self.first and (done - self.first) % self.every == 0)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"first": self.first, "every": self.every, "gain": self.gain}
        if self.bounds is not None:
            out["bounds"] = list(self.bounds)
        # only when set: a coordinator from before damping refuses keys it does not know
        for name in _DAMPING:
            if getattr(self, name) != getattr(RepartitionSettings, name):
                out[name] = getattr(self, name)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RepartitionSettings:
        if not isinstance(data, Mapping):
            raise ConfigError(f"repartition settings must be a mapping, got {data!r}")
        unknown = sorted(set(data) - {"first", "every", "gain", "bounds", *_DAMPING})
        if unknown:
            raise ConfigError(f"unknown repartition settings {unknown}")
        try:
            bounds = data.get("bounds")
            return cls(
                first=int(data.get("first", 10)),
                every=int(data.get("every", 100)),
                gain=float(data.get("gain", 0.1)),
                bounds=None if bounds is None else tuple(int(b) for b in bounds),
                smoothing=float(data.get("smoothing", cls.smoothing)),
                deviation=float(data.get("deviation", cls.deviation)),
                revisit_gain=float(data.get("revisit_gain", cls.revisit_gain)),
                revisit_looks=int(data.get("revisit_looks", cls.revisit_looks)),
                revisit_radius=int(data.get("revisit_radius", cls.revisit_radius)),
                watch=float(data.get("watch", cls.watch)),
                forward_watch=float(data.get("forward_watch", cls.forward_watch)),
                leave_out=_flag(data.get("leave_out", cls.leave_out)),
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"malformed repartition settings {data!r}: {exc}") from None


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"repartition leave_out must be true or false, got {value!r}")
    return value
