"""A model's profile on one device: what each unit costs, as plain data.

The profiler measures it (``python -m zpipe profile``); the planners read it.
Times are for one forward of a micro-batch of each profiled batch size on the
device that was profiled; a planner scales them by each device's speed.

File format (JSON)::

    {
      "format": "zpipe-profile/1",
      "model": {...ModelSpec.to_dict()...},
      "device": {"name": "laptop", "threads": 4, "dtype": "float32", "torch": "2.13.0"},
      "batch_sizes": [1, 2, 4, 8],
      "input_bytes": [b1, b2, b4, b8],             # the first unit's input per batch size
      "units": [
        {"name": "embed",
         "param_bytes": 2359296,                    # weights and buffers
         "time_s": [t1, t2, t4, t8],                # median forward time per batch size
         "output_bytes": [o1, o2, o4, o8],          # what crosses to the next unit
         "memory_bytes": [m1, m2, m4, m8]},         # peak extra memory of a forward
        ...
      ]
    }
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zpipe._errors import ConfigError

PROFILE_FORMAT = "zpipe-profile/1"


@dataclass(frozen=True)
class UnitProfile:
    name: str
    param_bytes: int
    time_s: tuple[float, ...]
    output_bytes: tuple[int, ...]
    memory_bytes: tuple[int, ...]


@dataclass(frozen=True)
class ModelProfile:
    batch_sizes: tuple[int, ...]
    units: tuple[UnitProfile, ...]
    input_bytes: tuple[int, ...]
    model: Mapping[str, Any] = field(default_factory=dict)
    device: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.batch_sizes or list(self.batch_sizes) != sorted(set(self.batch_sizes)):
            raise ConfigError(
                f"profile batch sizes must be increasing and distinct, got {self.batch_sizes}"
            )
        if any(b < 1 for b in self.batch_sizes):
            raise ConfigError(f"profile batch sizes must be >= 1, got {self.batch_sizes}")
        if not self.units:
            raise ConfigError("a profile needs at least one unit")
        n = len(self.batch_sizes)
        if len(self.input_bytes) != n:
            raise ConfigError(f"input_bytes has {len(self.input_bytes)} entries, expected {n}")
        for i, unit in enumerate(self.units):
            for key in ("time_s", "output_bytes", "memory_bytes"):
                values = getattr(unit, key)
                if len(values) != n:
                    raise ConfigError(
                        f"unit {i} ({unit.name}): {key} has {len(values)} entries, one per batch "
                        f"size ({n}) expected"
                    )
                if any(not math.isfinite(v) or v < 0 for v in values):
                    raise ConfigError(f"unit {i} ({unit.name}): {key} must be finite and >= 0")
            if unit.param_bytes < 0:
                raise ConfigError(f"unit {i} ({unit.name}): param_bytes must be >= 0")

    @property
    def num_units(self) -> int:
        return len(self.units)

    def _index(self, batch_size: int) -> int:
        try:
            return self.batch_sizes.index(batch_size)
        except ValueError:
            raise ConfigError(
                f"batch size {batch_size} was not profiled; profiled: {list(self.batch_sizes)}"
            ) from None

    def times(self, batch_size: int) -> list[float]:
        """Forward time of each unit at ``batch_size`` on the profiled device."""
        i = self._index(batch_size)
        return [u.time_s[i] for u in self.units]

    def output_bytes(self, batch_size: int) -> list[int]:
        i = self._index(batch_size)
        return [u.output_bytes[i] for u in self.units]

    def memory_bytes(self, batch_size: int) -> list[int]:
        """Memory each unit needs to run at ``batch_size``: its weights plus its activations."""
        i = self._index(batch_size)
        return [u.param_bytes + u.memory_bytes[i] for u in self.units]

    def input_bytes_at(self, batch_size: int) -> int:
        return self.input_bytes[self._index(batch_size)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "model": dict(self.model),
            "device": dict(self.device),
            "batch_sizes": list(self.batch_sizes),
            "input_bytes": list(self.input_bytes),
            "units": [
                {
                    "name": u.name,
                    "param_bytes": u.param_bytes,
                    "time_s": list(u.time_s),
                    "output_bytes": list(u.output_bytes),
                    "memory_bytes": list(u.memory_bytes),
                }
                for u in self.units
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "profile") -> ModelProfile:
        if data.get("format") != PROFILE_FORMAT:
            raise ConfigError(
                f"{source}: format must be {PROFILE_FORMAT!r}, got {data.get('format')!r}"
            )
        try:
            units = tuple(
                UnitProfile(
                    name=str(u["name"]),
                    param_bytes=int(u["param_bytes"]),
                    time_s=tuple(float(t) for t in u["time_s"]),
                    output_bytes=tuple(int(b) for b in u["output_bytes"]),
                    memory_bytes=tuple(int(b) for b in u["memory_bytes"]),
                )
                for u in data["units"]
            )
            return cls(
                batch_sizes=tuple(int(b) for b in data["batch_sizes"]),
                units=units,
                input_bytes=tuple(int(b) for b in data["input_bytes"]),
                model=dict(data.get("model", {})),
                device=dict(data.get("device", {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise ConfigError(f"{source}: {exc}") from None
            raise ConfigError(
                f"{source}: malformed profile ({type(exc).__name__}: {exc})"
            ) from None

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> ModelProfile:
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read profile {path}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"profile {path} is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"profile {path} must hold a JSON object")
        return cls.from_dict(data, source=str(path))


def synthetic_profile(
    times_s: Sequence[float],
    output_bytes: Sequence[int],
    *,
    param_bytes: Sequence[int] | None = None,
    memory_bytes: Sequence[int] | None = None,
    input_bytes: int = 0,
    batch_size: int = 1,
    names: Sequence[str] | None = None,
) -> ModelProfile:
    """A one-batch-size profile from plain lists: for tests, benchmarks and paper tables."""
    n = len(times_s)
    params = list(param_bytes) if param_bytes is not None else [0] * n
    memory = list(memory_bytes) if memory_bytes is not None else [0] * n
    labels = list(names) if names is not None else [f"unit{i}" for i in range(n)]
    if not (len(output_bytes) == len(params) == len(memory) == len(labels) == n):
        raise ConfigError("synthetic profile lists must all have one entry per unit")
    return ModelProfile(
        batch_sizes=(batch_size,),
        units=tuple(
            UnitProfile(
                labels[i],
                params[i],
                (float(times_s[i]),),
                (int(output_bytes[i]),),
                (int(memory[i]),),
            )
            for i in range(n)
        ),
        input_bytes=(input_bytes,),
    )
