"""A multi-layer perceptron: one unit per Linear (+ activation, except the last)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from zpipe.models._config import ConfigReader
from zpipe.models.base import UnitwiseSequence, check_batch_size
from zpipe.models.spec import ModelSpec

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"relu": F.relu, "gelu": F.gelu}


class Dense(nn.Module):
    def __init__(self, in_features: int, out_features: int, *, activation: str | None) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        return ACTIVATIONS[self.activation](out) if self.activation else out

    def extra_repr(self) -> str:
        return f"activation={self.activation}"


class MlpSequence(UnitwiseSequence):
    """config: {"dims": [in, h1, ..., out], "activation": "relu" | "gelu"}."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec)
        reader = ConfigReader(spec.config, family="mlp")
        self.dims = reader.get_int_list("dims", min_len=2, minimum=1)
        self.activation = reader.get_str("activation", default="relu", choices=ACTIVATIONS)
        reader.finish()

    @property
    def num_units(self) -> int:
        return len(self.dims) - 1

    def unit_names(self) -> list[str]:
        return [f"fc{i}" for i in range(self.num_units)]

    def parameter_elements(self, start: int, end: int) -> int:
        """Weights and biases of units ``[start, end)``, from the config alone."""
        return sum(self.dims[i] * self.dims[i + 1] + self.dims[i + 1] for i in range(start, end))

    def largest_boundary_bytes(self) -> int:
        """The widest layer's float32 activation, per sample."""
        return 4 * max(self.dims)

    def make_unit(self, index: int) -> nn.Module:
        last = index == self.num_units - 1
        return Dense(
            self.dims[index], self.dims[index + 1], activation=None if last else self.activation
        )

    def example_input(self, batch_size: int, *, seed: int = 0) -> tuple[torch.Tensor, ...]:
        check_batch_size(batch_size)
        generator = torch.Generator().manual_seed(seed)
        return (torch.randn(batch_size, self.dims[0], generator=generator),)
