"""A stage's shard: its units of the model and how one micro-batch runs through them.

Runs in the stage's compute thread, never on the event loop.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from zpipe._errors import ConfigError
from zpipe.devices import BoundaryMover
from zpipe.models import ModelSpec, load_layer_sequence, run_units
from zpipe.transport.emulation import compute_cpu_s, emulate_slowdown
from zpipe.transport.slowdown import Slowdown, slowdown_factor

COMPUTE_DTYPES = ("float32", "bfloat16")


class Shard:
    def __init__(
        self,
        units: Sequence[torch.nn.Module],
        *,
        dtype: str = "float32",
        slowdown: Slowdown = 1.0,
        device: torch.device | str = "cpu",
    ) -> None:
        if dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"compute dtype must be one of {COMPUTE_DTYPES}, got {dtype!r}")
        self.device = torch.device(device)
        # the wire carries CPU tensors: moved on and off the device at the shard's edges
        self.mover = BoundaryMover(self.device)
        self.units = [u.to(self.device).eval() for u in units]
        self.dtype = dtype
        self.slowdown = slowdown

    @classmethod
    def build(
        cls,
        spec: ModelSpec,
        start: int,
        end: int,
        *,
        dtype: str = "float32",
        slowdown: Slowdown = 1.0,
        device: torch.device | str = "cpu",
    ) -> Shard:
        sequence = load_layer_sequence(spec)
        if not 0 <= start < end <= sequence.num_units:
            raise ConfigError(
                f"unit range [{start}, {end}) is outside the model's {sequence.num_units} units"
            )
        return cls(sequence.build_units(start, end), dtype=dtype, slowdown=slowdown, device=device)

    def forward(self, inputs: Sequence[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], float]:
        """Outputs of this shard for one micro-batch, and the compute seconds it took."""
        # A fixed factor of 1 (no emulated slowdown, the usual case) needs no CPU clock:
        # each read is a system call, two per micro-batch on the compute thread.
        emulated = not (isinstance(self.slowdown, int | float) and self.slowdown <= 1.0)
        started = time.perf_counter()
        cpu_started = time.thread_time() if emulated else 0.0
        moved = self.mover.to_device(inputs)
        with torch.inference_mode():
            if self.dtype == "bfloat16":
                with torch.autocast(self.device.type, dtype=torch.bfloat16):
                    outputs = run_units(self.units, moved)
            else:  # no autocast: a generator context manager costs more than an identity unit
                outputs = run_units(self.units, moved)
            outputs = self.mover.to_host(outputs)
        elapsed = time.perf_counter() - started
        if not emulated:
            return outputs, elapsed
        took = emulate_slowdown(
            slowdown_factor(self.slowdown), elapsed, compute_cpu_s(time.thread_time() - cpu_started)
        )
        return outputs, took
