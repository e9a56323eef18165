"""Emulated compute: a stage that sleeps for its units' profiled time instead of computing.

``python -m zpipe.stage --emulate-compute PROFILE.json`` runs a stage whose compute
thread, for each micro-batch, waits for the time the profile gives its units at
that micro-batch's size, times the stage's ``--slowdown``, and then hands on
tensors of the real output shapes. Everything else is real: registration,
heartbeats, the planner, assignments, the data port, the sends, recovery. Many
such stages share two cores (a stage spends its time asleep, not computing), so
clusters of 16 to 64 devices can be run on one machine.

Output shapes come from running the stage's units on the ``meta`` device (nothing
is allocated, nothing computed), once per input signature; the zero-filled output
tensors are kept and sent again for every micro-batch of that signature (a sent
buffer is never written, so sharing it is safe). Under ``dtype="bfloat16"``
floating outputs are shipped as bfloat16, the size autocast's outputs have.

Times for a micro-batch size the profile lacks are interpolated linearly between
the nearest profiled sizes (and scaled in proportion beyond them). When the
coordinator asks this stage to profile a model, it answers from the same file
(:func:`emulated_profile`), so the planner plans from exactly what the stage will
emulate.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections.abc import Sequence

import torch

from zpipe._errors import ConfigError
from zpipe.log import get_logger
from zpipe.models import ModelSpec, load_layer_sequence, run_units
from zpipe.planner.profile import ModelProfile, UnitProfile
from zpipe.protocol.stage_control import ProfileReply, ProfileRequest
from zpipe.stage.shard import COMPUTE_DTYPES, Shard
from zpipe.stage.supervision import describe_error
from zpipe.transport.slowdown import slowdown_factor

log = get_logger("zpipe.stage")

# (shape, dtype) of each tensor of a micro-batch
Signature = tuple[tuple[tuple[int, ...], torch.dtype], ...]


def _at_batch(batch_sizes: Sequence[int], values: Sequence[float], rows: int) -> float:
    """``values`` (one per profiled batch size) at ``rows``: linear between the
    nearest profiled sizes, in proportion to the nearest one outside them."""
    if rows <= batch_sizes[0]:
        return values[0] * rows / batch_sizes[0]
    if rows >= batch_sizes[-1]:
        return values[-1] * rows / batch_sizes[-1]
    upper = bisect.bisect_left(batch_sizes, rows)
    if batch_sizes[upper] == rows:
        return values[upper]
    b0, b1 = batch_sizes[upper - 1], batch_sizes[upper]
    v0, v1 = values[upper - 1], values[upper]
    return v0 + (v1 - v0) * (rows - b0) / (b1 - b0)


def unit_times_at(profile: ModelProfile, rows: int) -> list[float]:
    """Every unit's forward seconds for a micro-batch of ``rows`` samples."""
    sizes = profile.batch_sizes
    return [_at_batch(sizes, unit.time_s, rows) for unit in profile.units]


def check_emulation_profile(profile: ModelProfile, num_units: int) -> None:
    if profile.num_units != num_units:
        raise ConfigError(
            f"--emulate-compute: the profile describes {profile.num_units} units but the "
            f"model has {num_units}; profile the model the run uses (python -m zpipe profile)"
        )


def emulated_profile(
    profile: ModelProfile, *, batch_size: int, slowdown: float, device_name: str
) -> ModelProfile:
    """The profile this emulated stage shows the planner: ``profile`` at ``batch_size``,
    its times stretched by ``slowdown``, as the stage will emulate them."""
    sizes = profile.batch_sizes

    def at(values: Sequence[float]) -> float:
        return _at_batch(sizes, values, batch_size)

    units = tuple(
        UnitProfile(
            unit.name,
            unit.param_bytes,
            (at(unit.time_s) * slowdown,),
            (round(at(unit.output_bytes)),),
            (round(at(unit.memory_bytes)),),
        )
        for unit in profile.units
    )
    return ModelProfile(
        batch_sizes=(batch_size,),
        units=units,
        input_bytes=(round(at(profile.input_bytes)),),
        model=profile.model,
        device={**profile.device, "name": device_name, "slowdown": slowdown, "emulated": True},
    )


class EmulatedShard(Shard):
    """A :class:`Shard` whose forward sleeps for the profiled time and returns zeros of
    the real output shapes."""

    def __init__(
        self,
        meta_units: Sequence[torch.nn.Module],
        unit_times: Sequence[UnitProfile],
        batch_sizes: Sequence[int],
        *,
        dtype: str = "float32",
        slowdown: float = 1.0,
    ) -> None:
        # Shard's own __init__ would move the units to a real device: not called.
        if dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"compute dtype must be one of {COMPUTE_DTYPES}, got {dtype!r}")
        self.device = torch.device("cpu")
        self.units = list(meta_units)
        self.dtype = dtype
        self.slowdown = slowdown
        self._batch_sizes = list(batch_sizes)
        self._times = [unit.time_s for unit in unit_times]
        self._outputs: dict[Signature, tuple[torch.Tensor, ...]] = {}

    @classmethod
    def build_emulated(
        cls,
        spec: ModelSpec,
        start: int,
        end: int,
        profile: ModelProfile,
        *,
        dtype: str = "float32",
        slowdown: float = 1.0,
    ) -> EmulatedShard:
        # Weights are never loaded: the meta device holds no values to load into.
        sequence = load_layer_sequence(dataclasses.replace(spec, weights=None))
        check_emulation_profile(profile, sequence.num_units)
        if not 0 <= start < end <= sequence.num_units:
            raise ConfigError(
                f"unit range [{start}, {end}) is outside the model's {sequence.num_units} units"
            )
        try:
            with torch.device("meta"):
                units = sequence.build_units(start, end)
        except Exception as exc:
            raise ConfigError(
                f"--emulate-compute needs units that can be built on the meta device: {exc}"
            ) from exc
        return cls(
            units,
            profile.units[start:end],
            profile.batch_sizes,
            dtype=dtype,
            slowdown=slowdown,
        )

    def emulated_s(self, rows: int) -> float:
        """Seconds one micro-batch of ``rows`` samples takes here (slowdown included)."""
        factor = slowdown_factor(self.slowdown)  # a schedule's factor now
        return factor * sum(_at_batch(self._batch_sizes, t, rows) for t in self._times)

    def _outputs_for(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        signature: Signature = tuple((tuple(t.shape), t.dtype) for t in inputs)
        outputs = self._outputs.get(signature)
        if outputs is None:
            meta = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in signature]
            with torch.inference_mode():
                shaped = run_units(self.units, meta)
            outputs = tuple(
                torch.zeros(t.shape, dtype=self._shipped_dtype(t.dtype)) for t in shaped
            )
            self._outputs[signature] = outputs
        return outputs

    def _shipped_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if self.dtype == "bfloat16" and dtype.is_floating_point:
            return torch.bfloat16
        return dtype

    def forward(self, inputs: Sequence[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], float]:
        started = time.perf_counter()
        rows = int(inputs[0].shape[0]) if inputs and inputs[0].dim() else 1
        emulated = self.emulated_s(rows)
        outputs = self._outputs_for(inputs)
        # The deadline counts from the start: finding the shapes is part of the time.
        left = started + emulated - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return outputs, emulated


def emulated_profile_reply(
    request: ProfileRequest, *, name: str, slowdown: float, profile: ModelProfile
) -> ProfileReply:
    """The answer to the coordinator's ``profile_request``: the emulation profile at the
    requested batch size (no model is built or run)."""
    try:
        if request.train:
            raise ConfigError("--emulate-compute emulates inference only; it has no backward")
        spec = ModelSpec.from_dict(request.model)
        check_emulation_profile(profile, load_layer_sequence(spec).num_units)
        shown = emulated_profile(
            profile, batch_size=request.batch_size, slowdown=slowdown, device_name=name
        )
        return ProfileReply(name=name, profile=shown.to_dict(), error="")
    except Exception as exc:  # reported to the coordinator, which plans without us
        error = describe_error(exc)
        log.error("profile_failed", stage=name, error=error)
        return ProfileReply(name=name, profile=None, error=error)


def profile_with_times(
    spec: ModelSpec, unit_times_s: Sequence[float], *, batch_size: int
) -> ModelProfile:
    """A profile of ``spec`` at ``batch_size`` whose times are ``unit_times_s`` and whose
    byte counts are the model's own (from the meta device): a cluster to emulate
    without profiling anything, for tests and benchmarks."""
    sequence = load_layer_sequence(dataclasses.replace(spec, weights=None))
    if len(unit_times_s) != sequence.num_units:
        raise ConfigError(
            f"{len(unit_times_s)} unit times for a model of {sequence.num_units} units"
        )
    example = sequence.example_input(batch_size)

    def nbytes(tensors: Sequence[torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    with torch.device("meta"):
        units = sequence.build_units(0, sequence.num_units)
    values: tuple[torch.Tensor, ...] = tuple(t.to("meta") for t in example)
    params, outputs, memory = [], [], []
    with torch.inference_mode():
        for unit in units:
            result = run_units([unit], values)
            params.append(sum(p.numel() * p.element_size() for p in unit.parameters()))
            outputs.append(nbytes(result))
            memory.append(nbytes(values) + nbytes(result))
            values = result
    names = sequence.unit_names()
    return ModelProfile(
        batch_sizes=(batch_size,),
        units=tuple(
            UnitProfile(names[i], params[i], (float(t),), (outputs[i],), (memory[i],))
            for i, t in enumerate(unit_times_s)
        ),
        input_bytes=(nbytes(example),),
        model=spec.to_dict(),
        device={"name": "emulated", "dtype": "float32", "slowdown": 1.0},
    )
