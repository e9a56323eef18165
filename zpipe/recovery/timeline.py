"""A recovery's timeline as plain data: when it failed, was detected, re-planned, resumed.

The coordinator marks each phase with its own monotonic clock as it passes
it, logs :meth:`RecoveryTimeline.log_fields` as one structured event, and
summarises every recovery of a run at its end with
:func:`summarize_recoveries`. ``failed_at`` is known only where the failure
is caused on purpose (a benchmark that kills a stage); without it the
detection time is unknown, not zero.

    failed --detection--> detected --replan--> replanned --weights--> weights_moved
        --resume--> first_step            recovery = first_step - detected
                                          downtime = first_step - failed
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zpipe._errors import ConfigError

PHASES = ("failed", "detected", "replanned", "weights_moved", "first_step")
CAUSES = ("failure", "slowdown", "join")


@dataclass(frozen=True)
class RecoveryTimeline:
    """One recovery: what caused it, which policy repaired it, and when each phase ended.

    Immutable: :meth:`mark` returns a new timeline, so a logged one never changes.
    """

    run: str
    cause: str
    devices: tuple[str, ...]
    policy: str
    epoch: int | None = None
    failed_at: float | None = None
    detected_at: float | None = None
    replanned_at: float | None = None
    weights_moved_at: float | None = None
    first_step_at: float | None = None
    units_moved: int | None = None
    bytes_moved: int | None = None

    def __post_init__(self) -> None:
        if self.cause not in CAUSES:
            raise ConfigError(f"unknown recovery cause {self.cause!r}; use one of {CAUSES}")
        last_phase, last = "", -math.inf
        for phase in PHASES:
            at = self.at(phase)
            if at is None:
                continue
            if not math.isfinite(at):
                raise ConfigError(f"recovery phase {phase!r}: time must be finite, got {at!r}")
            if at < last:
                raise ConfigError(
                    f"recovery phase {phase!r} at {at} comes before {last_phase!r} at {last}; "
                    "mark phases with one monotonic clock, in order"
                )
            last_phase, last = phase, at

    def at(self, phase: str) -> float | None:
        if phase not in PHASES:
            raise ConfigError(f"unknown recovery phase {phase!r}; use one of {PHASES}")
        value: float | None = getattr(self, f"{phase}_at")
        return value

    def mark(self, phase: str, at: float, **counts: int) -> RecoveryTimeline:
        """This timeline with ``phase`` ended at ``at`` (and ``units_moved``/``bytes_moved``)."""
        if self.at(phase) is not None:
            raise ConfigError(f"recovery phase {phase!r} is already marked")
        unknown = set(counts) - {"units_moved", "bytes_moved"}
        if unknown:
            raise ConfigError(f"unknown recovery counts {sorted(unknown)}")
        changes: dict[str, Any] = {f"{phase}_at": float(at), **counts}
        return dataclasses.replace(self, **changes)

    @property
    def complete(self) -> bool:
        """Detected and stepping again: the recovery is over."""
        return self.detected_at is not None and self.first_step_at is not None

    def summary(self) -> dict[str, float]:
        """Durations in seconds, each only when both its ends are known."""
        # Inference moves no weights (stages build units from the model spec): it resumes
        # straight after the new plan is assigned.
        resumed_from = self.weights_moved_at
        if resumed_from is None:
            resumed_from = self.replanned_at
        spans = {
            "detection_s": (self.failed_at, self.detected_at),
            "replan_s": (self.detected_at, self.replanned_at),
            "weights_s": (self.replanned_at, self.weights_moved_at),
            "resume_s": (resumed_from, self.first_step_at),
            "recovery_s": (self.detected_at, self.first_step_at),
            "downtime_s": (self.failed_at, self.first_step_at),
        }
        return {k: b - a for k, (a, b) in spans.items() if a is not None and b is not None}

    def log_fields(self) -> dict[str, Any]:
        """Flat key-values for one structured log event (durations rounded to ms)."""
        fields: dict[str, Any] = {
            "run": self.run,
            "cause": self.cause,
            "devices": list(self.devices),
            "policy": self.policy,
        }
        if self.epoch is not None:
            fields["epoch"] = self.epoch
        for key in ("units_moved", "bytes_moved"):
            if getattr(self, key) is not None:
                fields[key] = getattr(self, key)
        fields.update({k: round(v, 3) for k, v in self.summary().items()})
        return fields

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["devices"] = list(self.devices)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RecoveryTimeline:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise ConfigError(f"malformed recovery timeline: unknown key(s) {sorted(unknown)}")
        try:
            values = dict(data)
            values["devices"] = tuple(str(d) for d in data["devices"])
            return cls(**values)
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"malformed recovery timeline: {exc}") from None


def summarize_recoveries(timelines: Sequence[RecoveryTimeline]) -> dict[str, dict[str, float]]:
    """Per policy: how many recoveries completed, and the mean and worst of each duration."""
    by_policy: dict[str, list[RecoveryTimeline]] = {}
    for t in timelines:
        by_policy.setdefault(t.policy, []).append(t)
    out: dict[str, dict[str, float]] = {}
    for policy, group in sorted(by_policy.items()):
        row: dict[str, float] = {
            "count": float(len(group)),
            "completed": float(sum(t.complete for t in group)),
        }
        summaries = [t.summary() for t in group]
        keys = sorted({k for s in summaries for k in s})
        for key in keys:
            values = [s[key] for s in summaries if key in s]
            row[f"mean_{key}"] = statistics.fmean(values)
            row[f"max_{key}"] = max(values)
        out[policy] = row
    return out
