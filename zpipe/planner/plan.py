"""A plan: which device runs which contiguous range of units, as plain data.

A plan can be printed, saved, sent in a message and diffed against the
previous plan; every data message carries the epoch of the plan it belongs to.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from zpipe._errors import ConfigError


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: a device and the units ``[start, end)`` it runs."""

    device: str
    start: int
    end: int

    @property
    def num_units(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Plan:
    algo: str
    num_units: int
    stages: tuple[StagePlan, ...]
    predicted: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_stages(self.num_units, self.stages)

    @property
    def devices(self) -> list[str]:
        return [s.device for s in self.stages]

    def to_dict(self) -> dict[str, Any]:
        return {
            "algo": self.algo,
            "num_units": self.num_units,
            "stages": [[s.device, s.start, s.end] for s in self.stages],
            "predicted": dict(self.predicted),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        try:
            stages = tuple(StagePlan(str(d), int(a), int(b)) for d, a, b in data["stages"])
            return cls(
                algo=str(data["algo"]),
                num_units=int(data["num_units"]),
                stages=stages,
                predicted=read_predicted(data.get("predicted", {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed plan: {exc}") from None

    def describe(self, unit_names: Sequence[str] | None = None) -> str:
        """A table for people: one row per stage."""
        rows = [f"{'stage':>5}  {'device':<16} {'units':>11}  {'count':>5}  first .. last"]
        for i, s in enumerate(self.stages):
            span = ""
            if unit_names is not None:
                span = f"{unit_names[s.start]} .. {unit_names[s.end - 1]}"
            rows.append(
                f"{i:>5}  {s.device:<16} {f'[{s.start}, {s.end})':>11}  {s.num_units:>5}  {span}"
            )
        return "\n".join(rows)


def read_predicted(data: Any) -> dict[str, float]:
    """A plan's ``predicted`` as read from a file: numbers, and null for an unbounded
    one (:func:`plan_json` writes an infinite throughput so)."""
    return {str(k): math.inf if v is None else float(v) for k, v in dict(data).items()}


def plan_json(data: Mapping[str, Any]) -> str:
    """Standard JSON of a plan's ``to_dict()``: a value without bound (the throughput of
    a model whose every time is 0) is written null, never ``Infinity``, which is not JSON."""
    return json.dumps(_null_if_unbounded(data), indent=1, allow_nan=False)


def _null_if_unbounded(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _null_if_unbounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_null_if_unbounded(v) for v in value]
    return value


def validate_stages(num_units: int, stages: Sequence[StagePlan]) -> None:
    """Stages must cover ``[0, num_units)`` in order, each non-empty, devices distinct."""
    if num_units < 1:
        raise ConfigError(f"a model needs at least one unit, got {num_units}")
    if not stages:
        raise ConfigError("a plan needs at least one stage")
    expected = 0
    for i, s in enumerate(stages):
        if s.start != expected:
            raise ConfigError(
                f"stage {i} ({s.device}) starts at unit {s.start}, expected {expected}: "
                "ranges must be contiguous and start at 0"
            )
        if s.end <= s.start:
            raise ConfigError(f"stage {i} ({s.device}) has an empty range [{s.start}, {s.end})")
        expected = s.end
    if expected != num_units:
        raise ConfigError(f"the stages cover units [0, {expected}), but the model has {num_units}")
    names = [s.device for s in stages]
    if len(set(names)) != len(names):
        raise ConfigError(f"a device appears in more than one stage: {names}")


def even_ranges(num_units: int, num_stages: int) -> list[tuple[int, int]]:
    """Split ``num_units`` into ``num_stages`` contiguous ranges differing by at most one."""
    if num_stages < 1:
        raise ConfigError(f"need at least one stage, got {num_stages}")
    if num_stages > num_units:
        raise ConfigError(
            f"cannot split {num_units} units over {num_stages} stages: use at most {num_units}"
        )
    base, extra = divmod(num_units, num_stages)
    ranges, start = [], 0
    for i in range(num_stages):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def plan_even_partition(num_units: int, devices: Sequence[str]) -> Plan:
    """GPipe's partition: the same number of units on every device, in the given order."""
    ranges = even_ranges(num_units, len(devices))
    return Plan(
        algo="even",
        num_units=num_units,
        stages=tuple(StagePlan(d, a, b) for d, (a, b) in zip(devices, ranges, strict=False)),
    )


def plan_from_partition(
    num_units: int, devices: Sequence[str], ranges: Sequence[Sequence[int]]
) -> Plan:
    """A user-given partition, checked: one ``[start, end)`` per device."""
    if len(ranges) != len(devices):
        raise ConfigError(
            f"the partition has {len(ranges)} ranges but {len(devices)} devices take part"
        )
    stages = []
    for device, r in zip(devices, ranges, strict=False):
        if len(r) != 2:
            raise ConfigError(f"partition range {list(r)!r} must be [start, end]")
        stages.append(StagePlan(device, int(r[0]), int(r[1])))
    return Plan(algo="explicit", num_units=num_units, stages=tuple(stages))
