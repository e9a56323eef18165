"""The partition as recovery sees it: stages of devices over unit ranges, plan-type free.

An inference :class:`~zpipe.planner.plan.Plan` has one device per stage, a
:class:`~zpipe.planner.training_plan.TrainingPlan` a group; weight movement and
replication only care about which devices hold which units, so both reduce to
a tuple of :class:`StageSpan`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zpipe._errors import ConfigError
from zpipe.planner.plan import Plan
from zpipe.planner.training_plan import TrainingPlan

# The name under which the coordinator holds replicas. Reserved: a stage may not use it.
COORDINATOR = "coordinator"


@dataclass(frozen=True)
class StageSpan:
    """One stage: the devices that each hold all of units ``[start, end)``."""

    devices: tuple[str, ...]
    start: int
    end: int

    def to_dict(self) -> dict[str, Any]:
        return {"devices": list(self.devices), "start": self.start, "end": self.end}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StageSpan:
        try:
            return cls(tuple(str(d) for d in data["devices"]), int(data["start"]), int(data["end"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed stage span: {exc}") from None


PartitionLike = Plan | TrainingPlan | Sequence[StageSpan]


def stage_spans(partition: PartitionLike) -> tuple[StageSpan, ...]:
    """The stages of a plan (either kind) or of given spans, checked."""
    if isinstance(partition, Plan):
        spans = tuple(StageSpan((s.device,), s.start, s.end) for s in partition.stages)
    elif isinstance(partition, TrainingPlan):
        spans = tuple(StageSpan(s.devices, s.start, s.end) for s in partition.stages)
    else:
        spans = tuple(partition)
    validate_spans(spans)
    return spans


def validate_spans(spans: Sequence[StageSpan]) -> int:
    """Check contiguity from 0, non-empty ranges and distinct devices; return the unit count."""
    if not spans:
        raise ConfigError("a partition needs at least one stage")
    expected = 0
    seen: set[str] = set()
    for i, span in enumerate(spans):
        if span.start != expected or span.end <= span.start:
            raise ConfigError(
                f"stage {i} covers [{span.start}, {span.end}); stages must be non-empty and "
                f"contiguous from unit 0 (expected a start of {expected})"
            )
        if not span.devices:
            raise ConfigError(f"stage {i} has no devices")
        for d in span.devices:
            if d == COORDINATOR:
                raise ConfigError(f"{COORDINATOR!r} is reserved for the coordinator's replicas")
            if d in seen:
                raise ConfigError(f"device {d!r} appears in more than one place in the partition")
            seen.add(d)
        expected = span.end
    return expected


def device_ranges(spans: Sequence[StageSpan]) -> dict[str, tuple[int, int]]:
    """Each device's unit range ``(start, end)``."""
    return {d: (s.start, s.end) for s in spans for d in s.devices}


def device_stage(spans: Sequence[StageSpan]) -> dict[str, int]:
    """Each device's stage index."""
    return {d: i for i, s in enumerate(spans) for d in s.devices}
