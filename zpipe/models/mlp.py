"""A multi-layer perceptron: one unit per Linear (+ activation, except the last).

With ``"residual": true`` every hidden unit whose width is kept (``dims[i] ==
dims[i + 1]``, not the last unit) is a pre-norm residual block instead,
``x + W2 act(W1 LayerNorm(x))``: plain MLPs of 16 or more layers do not learn
under the staleness of asynchronous 1F1B, a residual stack of the same depth does
(the identity path carries the signal and the gradient through every unit).
"""

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


class ResidualBlock(nn.Module):
    """``x + W2 act(W1 LayerNorm(x))`` at width ``features``."""

    def __init__(self, features: int, *, activation: str) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(features)
        self.inner = nn.Linear(features, features)
        self.outer = nn.Linear(features, features)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(ACTIVATIONS[self.activation](self.inner(self.norm(x))))

    def extra_repr(self) -> str:
        return f"activation={self.activation}"


class MlpSequence(UnitwiseSequence):
    """config: {"dims": [in, h1, ..., out], "activation": "relu" | "gelu",
    "residual": false | true}."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec)
        reader = ConfigReader(spec.config, family="mlp")
        self.dims = reader.get_int_list("dims", min_len=2, minimum=1)
        self.activation = reader.get_str("activation", default="relu", choices=ACTIVATIONS)
        self.residual = reader.get_bool("residual", default=False)
        reader.finish()

    @property
    def num_units(self) -> int:
        return len(self.dims) - 1

    def is_block(self, index: int) -> bool:
        """Whether unit ``index`` is a residual block (else a Dense layer)."""
        return (
            self.residual
            and index < self.num_units - 1
            and self.dims[index] == self.dims[index + 1]
        )

    def unit_names(self) -> list[str]:
        return [f"block{i}" if self.is_block(i) else f"fc{i}" for i in range(self.num_units)]

    def parameter_elements(self, start: int, end: int) -> int:
        """Weights and biases of units ``[start, end)``, from the config alone."""
        total = 0
        for i in range(start, end):
            width = self.dims[i + 1]
            if self.is_block(i):
                total += 2 * (width * width + width) + 2 * width  # two Linears, a LayerNorm
            else:
                total += self.dims[i] * width + width
        return total

    def largest_boundary_bytes(self) -> int:
        """The widest layer's float32 activation, per sample."""
        return 4 * max(self.dims)

    def make_unit(self, index: int) -> nn.Module:
        if self.is_block(index):
            return ResidualBlock(self.dims[index], activation=self.activation)
        last = index == self.num_units - 1
        return Dense(
            self.dims[index], self.dims[index + 1], activation=None if last else self.activation
        )

    def example_input(self, batch_size: int, *, seed: int = 0) -> tuple[torch.Tensor, ...]:
        check_batch_size(batch_size)
        generator = torch.Generator().manual_seed(seed)
        return (torch.randn(batch_size, self.dims[0], generator=generator),)
