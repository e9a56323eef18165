"""A model's profile on one device: what each unit costs, as plain data.

The profiler measures it (``python -m zpipe profile``); the planners read it.
Times are for one forward of a micro-batch of each profiled batch size on the
device that was profiled; a planner scales them by each device's speed.

Training measurements are optional (``python -m zpipe profile --train``): a
profile has them for every unit or for none, and a file without them is still
a valid ``zpipe-profile/1`` file (the inference planners never read them).

File format (JSON)::

    {
      "format": "zpipe-profile/1",
      "model": {...ModelSpec.to_dict()...},
      "device": {"name": "laptop", "threads": 4, "dtype": "float32", "torch": "2.13.0",
                 "kind": "cpu", "device": "cpu"},       # kind: cpu, cuda, mps (--device)
      "batch_sizes": [1, 2, 4, 8],
      "input_bytes": [b1, b2, b4, b8],             # the first unit's input per batch size
      "units": [
        {"name": "embed",
         "param_bytes": 2359296,                    # weights and buffers
         "time_s": [t1, t2, t4, t8],                # median forward time per batch size
         "output_bytes": [o1, o2, o4, o8],          # what crosses to the next unit
         "memory_bytes": [m1, m2, m4, m8],          # input + measured peak of a forward
         "backward_time_s": [g1, g2, g4, g8],       # optional (--train): median backward
         "activation_bytes": [s1, s2, s4, s8]},     # optional (--train): saved for backward
        ...
      ]
    }

``backward_time_s`` is the time of the unit's backward given the gradient of
its output: the gradients of its input (except for the first unit, whose
input is data) and of its parameters. ``activation_bytes`` is what the unit
keeps alive from its forward until its backward: the tensors autograd saves,
each storage counted once, the unit's own parameters left out (they are
weights, counted in ``param_bytes``).
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zpipe._errors import ConfigError

PROFILE_FORMAT = "zpipe-profile/1"
# Sane ranges, so that no sum or quotient a planner forms overflows (to inf, or past
# int64 in numpy) and then reads as something else ("out of memory"): a unit's time at
# most 10**6 s (11 days); a byte count an integer of at most 2**53 (8 PiB, exact as a
# float), and one batch size's units together at most 2**62 bytes.
MAX_UNIT_TIME_S = 1e6
MAX_BYTES = 2**53
MAX_TOTAL_BYTES = 2**62
_NO_TRAINING = "profile has no training measurements; profile with --train"
_PER_BATCH_KEYS: tuple[str, ...] = ("time_s", "output_bytes", "memory_bytes")
_TRAINING_KEYS: tuple[str, ...] = ("backward_time_s", "activation_bytes")
_TIME_KEYS = frozenset({"time_s", "backward_time_s"})


def training_profile_sizes(microbatch_size: int) -> list[int]:
    """The batch sizes a live training profile measures for micro-batches of ``B``:
    1, B/4, B/2 and B. A stage of a data-parallel group computes a share of ``B``
    (Asteroid's Algorithm 1), and time per sample falls with the batch size, so
    the shares are read from this curve, not from a line through ``B`` alone."""
    b = max(1, int(microbatch_size))
    return sorted({1, max(1, b // 4), max(1, b // 2), b})


@dataclass(frozen=True)
class UnitProfile:
    name: str
    param_bytes: int
    time_s: tuple[float, ...]
    output_bytes: tuple[int, ...]
    memory_bytes: tuple[int, ...]
    # Training measurements (``--train``); None in a forward-only profile.
    backward_time_s: tuple[float, ...] | None = None
    activation_bytes: tuple[int, ...] | None = None

    @property
    def has_training(self) -> bool:
        return self.backward_time_s is not None and self.activation_bytes is not None


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
        if not all(_is_integer(b) for b in self.batch_sizes):
            raise ConfigError(f"profile batch sizes must be integers, got {self.batch_sizes}")
        if any(b < 1 for b in self.batch_sizes):
            raise ConfigError(f"profile batch sizes must be >= 1, got {self.batch_sizes}")
        if not self.units:
            raise ConfigError("a profile needs at least one unit")
        n = len(self.batch_sizes)
        if len(self.input_bytes) != n:
            raise ConfigError(f"input_bytes has {len(self.input_bytes)} entries, expected {n}")
        _check_byte_counts("input_bytes", self.input_bytes)
        trained = [u.has_training for u in self.units]
        if any(trained) and not all(trained):
            raise ConfigError(
                "training measurements (backward_time_s, activation_bytes) must be given for "
                f"every unit or for none; units {[i for i, t in enumerate(trained) if not t]} "
                "lack them"
            )
        keys = _PER_BATCH_KEYS + (_TRAINING_KEYS if all(trained) else ())
        for i, unit in enumerate(self.units):
            where = f"unit {i} ({unit.name})"
            for key in keys:
                values = getattr(unit, key)
                if len(values) != n:
                    raise ConfigError(
                        f"{where}: {key} has {len(values)} entries, one per batch "
                        f"size ({n}) expected"
                    )
                if key in _TIME_KEYS:
                    _check_times(f"{where}: {key}", values)
                else:
                    _check_byte_counts(f"{where}: {key}", values)
            _check_byte_count(f"{where}: param_bytes", unit.param_bytes)
        for k, b in enumerate(self.batch_sizes):
            total = sum(u.param_bytes + u.memory_bytes[k] for u in self.units)
            if total > MAX_TOTAL_BYTES:
                raise ConfigError(
                    f"param_bytes and memory_bytes at batch size {b} add up to {total} bytes "
                    f"over the units, more than 2**62: not a model any device holds"
                )

    @property
    def num_units(self) -> int:
        return len(self.units)

    @property
    def has_training(self) -> bool:
        """Whether the profile holds backward times and activation sizes (``--train``)."""
        return self.units[0].has_training

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

    def peak_bytes(self, batch_size: int) -> list[int]:
        """Each unit's forward peak at ``batch_size``: its input plus what its forward
        allocates (the profile's ``memory_bytes``, weights left out)."""
        i = self._index(batch_size)
        return [u.memory_bytes[i] for u in self.units]

    def input_bytes_at(self, batch_size: int) -> int:
        return self.input_bytes[self._index(batch_size)]

    def param_bytes(self) -> list[int]:
        """Each unit's weights and buffers, in bytes."""
        return [u.param_bytes for u in self.units]

    def backward_times(self, batch_size: int) -> list[float]:
        """Backward time of each unit at ``batch_size`` on the profiled device."""
        i = self._training_index(batch_size)
        return [(u.backward_time_s or ())[i] for u in self.units]

    def activation_bytes(self, batch_size: int) -> list[int]:
        """Bytes each unit keeps alive between its forward and its backward at ``batch_size``."""
        i = self._training_index(batch_size)
        return [(u.activation_bytes or ())[i] for u in self.units]

    def _training_index(self, batch_size: int) -> int:
        if not self.has_training:
            raise ConfigError(_NO_TRAINING)
        return self._index(batch_size)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "model": dict(self.model),
            "device": dict(self.device),
            "batch_sizes": list(self.batch_sizes),
            "input_bytes": list(self.input_bytes),
            "units": [_unit_to_dict(u) for u in self.units],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "profile") -> ModelProfile:
        """A profile from plain data (a file, or a stage's reply): any malformed content
        is a ConfigError naming ``source``, never another exception."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: a profile is a JSON object, got {type(data).__name__}")
        if data.get("format") != PROFILE_FORMAT:
            raise ConfigError(
                f"{source}: format must be {PROFILE_FORMAT!r}, got {data.get('format')!r}"
            )
        try:
            units = tuple(_unit_from_dict(k, u) for k, u in enumerate(data["units"]))
            return cls(
                batch_sizes=_integers("batch_sizes", data["batch_sizes"]),
                units=units,
                input_bytes=_integers("input_bytes", data["input_bytes"]),
                model=dict(data.get("model", {})),
                device=dict(data.get("device", {})),
            )
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            # AttributeError: a unit that is not an object; OverflowError: int(1e400)
            if isinstance(exc, ConfigError):
                raise ConfigError(f"{source}: {exc}") from None
            raise ConfigError(
                f"{source}: malformed profile ({type(exc).__name__}: {exc})"
            ) from None

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n")

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


def _unit_to_dict(u: UnitProfile) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": u.name,
        "param_bytes": u.param_bytes,
        "time_s": list(u.time_s),
        "output_bytes": list(u.output_bytes),
        "memory_bytes": list(u.memory_bytes),
    }
    # Written only when measured, so a forward-only profile's file is unchanged.
    if u.backward_time_s is not None:
        entry["backward_time_s"] = list(u.backward_time_s)
    if u.activation_bytes is not None:
        entry["activation_bytes"] = list(u.activation_bytes)
    return entry


def _unit_from_dict(k: int, u: Mapping[str, Any]) -> UnitProfile:
    name = str(u["name"])
    where = f"unit {k} ({name})"
    backward = u.get("backward_time_s")
    activations = u.get("activation_bytes")
    return UnitProfile(
        name=name,
        param_bytes=_integer(f"{where}: param_bytes", u["param_bytes"]),
        time_s=_numbers(f"{where}: time_s", u["time_s"]),
        output_bytes=_integers(f"{where}: output_bytes", u["output_bytes"]),
        memory_bytes=_integers(f"{where}: memory_bytes", u["memory_bytes"]),
        backward_time_s=(
            None if backward is None else _numbers(f"{where}: backward_time_s", backward)
        ),
        activation_bytes=(
            None if activations is None else _integers(f"{where}: activation_bytes", activations)
        ),
    )


def _integer(what: str, value: Any) -> int:
    """A count from a file: 3 and 3.0 pass; 3.5, "3", true and 1e400 are refused by name
    (``int()`` would truncate 3.5 to 3 without a word)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{what} must be an integer, got {value!r}")
    if isinstance(value, float) and not value.is_integer():
        raise ConfigError(f"{what} must be a whole number, got {value!r}")
    return int(value)


def _integers(what: str, values: Any) -> tuple[int, ...]:
    if isinstance(values, (str, Mapping)) or not isinstance(values, Sequence):
        raise ConfigError(f"{what} must be a list of integers, got {values!r}")
    return tuple(_integer(f"{what}[{k}]", v) for k, v in enumerate(values))


def _numbers(what: str, values: Any) -> tuple[float, ...]:
    if isinstance(values, (str, Mapping)) or not isinstance(values, Sequence):
        raise ConfigError(f"{what} must be a list of numbers, got {values!r}")
    out = []
    for k, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{what}[{k}] must be a number, got {v!r}")
        out.append(float(v))
    return tuple(out)


def _check_times(what: str, values: Sequence[float]) -> None:
    for k, v in enumerate(values):
        if not (math.isfinite(v) and 0 <= v <= MAX_UNIT_TIME_S):
            raise ConfigError(
                f"{what} must be finite and >= 0 and at most {MAX_UNIT_TIME_S:g} s; "
                f"entry {k} is {v!r}"
            )


def _check_byte_counts(what: str, values: Sequence[int]) -> None:
    for k, v in enumerate(values):
        _check_byte_count(what, v, f"; entry {k} is {v!r}")


def _check_byte_count(what: str, value: int, which: str = "") -> None:
    which = which or f", got {value!r}"
    if not _is_integer(value):
        raise ConfigError(f"{what} must be whole numbers of bytes{which}")
    if not 0 <= value <= MAX_BYTES:
        raise ConfigError(f"{what} must be between 0 and 2**53 bytes{which}")


def _is_integer(value: object) -> bool:
    # numbers.Integral: numpy's integers count too; a float (3.5, or even 3.0) does not
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def synthetic_profile(
    times_s: Sequence[float],
    output_bytes: Sequence[int],
    *,
    param_bytes: Sequence[int] | None = None,
    memory_bytes: Sequence[int] | None = None,
    backward_times_s: Sequence[float] | None = None,
    activation_bytes: Sequence[int] | None = None,
    input_bytes: int = 0,
    batch_size: int = 1,
    names: Sequence[str] | None = None,
) -> ModelProfile:
    """A one-batch-size profile from plain lists: for tests, benchmarks and paper tables.

    Give ``backward_times_s`` and ``activation_bytes`` together for a training
    profile; either one alone is an error.
    """
    n = len(times_s)
    params = list(param_bytes) if param_bytes is not None else [0] * n
    memory = list(memory_bytes) if memory_bytes is not None else [0] * n
    labels = list(names) if names is not None else [f"unit{i}" for i in range(n)]
    if not (len(output_bytes) == len(params) == len(memory) == len(labels) == n):
        raise ConfigError("synthetic profile lists must all have one entry per unit")
    if (backward_times_s is None) != (activation_bytes is None):
        raise ConfigError("give backward_times_s and activation_bytes together, or neither")
    backward: list[tuple[float, ...] | None] = [None] * n
    saved: list[tuple[int, ...] | None] = [None] * n
    if backward_times_s is not None and activation_bytes is not None:
        if not (len(backward_times_s) == len(activation_bytes) == n):
            raise ConfigError("synthetic profile lists must all have one entry per unit")
        backward = [(float(t),) for t in backward_times_s]
        saved = [(int(b),) for b in activation_bytes]
    return ModelProfile(
        batch_sizes=(batch_size,),
        units=tuple(
            UnitProfile(
                labels[i],
                params[i],
                (float(times_s[i]),),
                (int(output_bytes[i]),),
                (int(memory[i]),),
                backward[i],
                saved[i],
            )
            for i in range(n)
        ),
        input_bytes=(input_bytes,),
    )
