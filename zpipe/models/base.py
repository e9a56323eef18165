"""Shared machinery of the built-in families: per-unit seeding, weights, eval mode."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from zpipe.models._seeding import seeded, unit_seed
from zpipe.models.sequence import check_unit_range
from zpipe.models.size import check_peer_build
from zpipe.models.spec import ModelSpec
from zpipe.models.weights import (
    PlainKey,
    load_unit_weights,
    sequential_of_units_key,
    unit_key,
)


def finish_units(
    units: list[nn.Module],
    *,
    start: int,
    spec: ModelSpec,
    plain_key: PlainKey = sequential_of_units_key,
) -> list[nn.Module]:
    """Load the spec's weights file (if any) into units start.., and switch to eval mode.

    `plain_key`: where a file without zpipe's "units.<i>." keys keeps each weight.
    """
    if spec.weights is not None:
        load_unit_weights(units, start=start, path=spec.weights, plain_key=plain_key)
    for unit in units:
        unit.eval()
    return units


def check_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")


class UnitwiseSequence(ABC):
    """A family whose units can be constructed one by one, each from its own seed."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec

    @property
    @abstractmethod
    def num_units(self) -> int: ...

    @abstractmethod
    def unit_names(self) -> list[str]: ...

    @abstractmethod
    def make_unit(self, index: int) -> nn.Module:
        """Construct unit `index` with fresh (RNG-driven) initial weights."""

    @abstractmethod
    def example_input(self, batch_size: int, *, seed: int = 0) -> tuple[torch.Tensor, ...]: ...

    def build_units(self, start: int, end: int) -> list[nn.Module]:
        return finish_units(self.fresh_units(start, end), start=start, spec=self.spec)

    def fresh_units(self, start: int, end: int) -> list[nn.Module]:
        """Units ``[start, end)`` with their seeded initial weights (nothing loaded)."""
        check_unit_range(start, end, self.num_units)
        if self.spec.from_peer:
            # A peer's config can name any size: count before allocating anything.
            check_peer_build(self, start, end)
        units = []
        for index in range(start, end):
            with seeded(unit_seed(self.spec.seed, index)):
                units.append(self.make_unit(index))
        return units

    def unit_param_keys(self, index: int) -> list[str]:
        check_unit_range(index, index + 1, self.num_units)
        # The meta device allocates nothing: cheap even for a ViT-Huge block.
        with torch.device("meta"):
            unit = self.make_unit(index)
        return [unit_key(index, name) for name in unit.state_dict()]
