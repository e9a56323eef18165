"""A model as a sequence of units, and how units are run one after another.

Convention: a unit is called with the previous unit's outputs unpacked as
positional arguments, and returns a Tensor or a tuple of Tensors. `run_units`
always hands back a tuple, so stage boundaries carry tuple[Tensor, ...].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from zpipe._errors import ConfigError
from zpipe.models.spec import ModelSpec


@runtime_checkable
class LayerSequence(Protocol):
    """A model split into partitioning units that stages build separately."""

    spec: ModelSpec

    @property
    def num_units(self) -> int: ...

    def unit_names(self) -> list[str]:
        """Human-readable name of every unit, e.g. "block3.attn"."""
        ...

    def build_units(self, start: int, end: int) -> list[nn.Module]:
        """Units start..end-1 only, in eval mode, with the full build's weights."""
        ...

    def example_input(self, batch_size: int, *, seed: int = 0) -> tuple[torch.Tensor, ...]:
        """A deterministic input for the first unit."""
        ...

    def unit_param_keys(self, index: int) -> list[str]:
        """Keys of unit `index` in the full model's state dict ("units.<index>.<name>")."""
        ...


def as_tuple(value: object, *, unit: int | str = "?") -> tuple[torch.Tensor, ...]:
    """A unit's output as a tuple of Tensors."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(value)
    raise TypeError(
        f"unit {unit} returned {type(value).__name__}; a unit must return a Tensor "
        "or a tuple of Tensors"
    )


def run_units(
    units: Sequence[nn.Module], inputs: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """Run `units` in order; each gets the previous outputs as positional arguments."""
    values = tuple(inputs)
    for position, unit in enumerate(units):
        values = as_tuple(unit(*values), unit=position)
    return values


def check_unit_range(start: int, end: int, num_units: int) -> None:
    if not 0 <= start <= end <= num_units:
        raise ConfigError(
            f"unit range [{start}, {end}) is outside the model's {num_units} units; "
            f"use 0 <= start <= end <= {num_units}"
        )


class FullModel(nn.Module):
    """All units in one module: the single-process reference for a pipeline.

    Its state dict names are "units.<index>.<name>", the names weights files use.
    """

    def __init__(self, units: Sequence[nn.Module]) -> None:
        super().__init__()
        self.units = nn.ModuleList(units)

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return run_units(list(self.units), inputs)


def unit_param_bytes(units: Sequence[nn.Module]) -> list[int]:
    """Bytes of each unit's parameters and buffers (what it keeps in memory at rest).

    Works on units built on the meta device, so the planner can size big models
    without allocating them.
    """
    sizes = []
    for unit in units:
        seen: set[int] = set()
        total = 0
        for tensor in [*unit.parameters(), *unit.buffers()]:
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
        sizes.append(total)
    return sizes
