"""Running a unit with a weight version's tensors in place of its parameters.

:class:`~zpipe.training.async_stage.AsyncStageCompute` forwards each batch with the
weight version it names, so the batch's graph holds that version's tensors
(weight stashing). ``torch.func.functional_call`` does this for any module, at a
price paid on every forward: it unties shared tensors (a walk over the unit's
modules) and swaps each parameter out and back in through ``delattr`` and
``setattr`` (about 0.1 ms of a 0.4 ms forward of one residual unit of hidden 256).
On an emulated slow device that Python is multiplied by the slowdown.

:class:`VersionedCall` keeps ``functional_call`` for any unit it cannot vouch for
and, for a unit built only of torch layers that read their parameters by attribute
(:data:`DIRECT_OWNERS`, exact types: a parametrized or user subclass is not one)
with no tensor under two names, puts the version's tensors straight into those
layers' parameter slots for the call and puts the live ones back after, so the
call reads the same tensors ``functional_call`` would give it and computes the
same values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import torch
from torch import nn
from torch.func import functional_call

# torch layers whose forward reads each parameter as ``self.<name>`` and keeps no
# other reference to it (an RNN keeps its flat weights, so it is not one)
DIRECT_OWNERS: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.LayerNorm,
    nn.Embedding,
    nn.Conv1d,
    nn.Conv2d,
    nn.GroupNorm,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
)

Slot = tuple[nn.Module, str]


class VersionedCall:
    """``unit(*inputs)`` with ``params`` (name -> tensor, a subset of the unit's
    parameters) in place of those parameters."""

    def __init__(self, unit: nn.Module) -> None:
        self.unit = unit
        self.ties = shares_tensors(unit)
        self._slots = None if self.ties else _direct_slots(unit)

    @property
    def direct(self) -> bool:
        """Whether the call swaps slots itself (False: ``functional_call``)."""
        return self._slots is not None

    def __call__(
        self, params: Mapping[str, torch.Tensor], inputs: Sequence[torch.Tensor]
    ) -> object:
        slots = self._slots
        if slots is None:
            return functional_call(self.unit, dict(params), tuple(inputs), tie_weights=self.ties)
        placed: list[tuple[dict[str, torch.Tensor | None], str, torch.Tensor | None]] = []
        try:
            for name, tensor in params.items():
                owner, attr = slots[name]
                # the slot holds a plain tensor for the call: a Parameter's type is
                # for registration, which this neither needs nor changes
                table = cast("dict[str, torch.Tensor | None]", owner._parameters)
                placed.append((table, attr, table[attr]))
                table[attr] = tensor
            return self.unit(*inputs)
        finally:
            for table, attr, live in placed:
                table[attr] = live


def _direct_slots(unit: nn.Module) -> dict[str, Slot] | None:
    """Each parameter's (owning layer, attribute), or None when a layer that owns
    parameters is not one of :data:`DIRECT_OWNERS`."""
    slots: dict[str, Slot] = {}
    for prefix, module in unit.named_modules():
        owned = [(attr, p) for attr, p in module._parameters.items() if p is not None]
        if not owned:
            continue
        if type(module) not in DIRECT_OWNERS:
            return None
        for attr, _ in owned:
            slots[f"{prefix}.{attr}" if prefix else attr] = (module, attr)
    return slots


def shares_tensors(module: nn.Module) -> bool:
    """Whether one parameter or buffer of ``module`` has two names (tied weights)."""
    named = [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]
    return len({id(t) for _, t in named}) != len(named)
