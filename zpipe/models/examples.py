"""Tiny factories for the 'sequential' and 'traced' families (tests, demos).

They live in the package so that any process can import them by path, e.g.
{"factory": "zpipe.models.examples:tiny_sequential"}.
"""

from __future__ import annotations

import torch
from torch import nn


def tiny_sequential(
    *, in_features: int = 8, hidden: int = 16, out_features: int = 4
) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(in_features, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.GELU(),
        nn.Linear(hidden, out_features),
    )


class TinyResidual(nn.Module):
    """Four children with skips across children: stem's output is added after block2,
    block1's output is added again before the head."""

    def __init__(self, in_features: int, hidden: int, out_features: int) -> None:
        super().__init__()
        self.stem = nn.Linear(in_features, hidden)
        norm = nn.BatchNorm1d(hidden)
        # Running statistics that make eval-mode BatchNorm more than an identity.
        norm.running_mean = torch.randn(hidden) * 0.1
        norm.running_var = torch.rand(hidden) + 0.5
        self.block1 = nn.Sequential(nn.Linear(hidden, hidden), norm, nn.ReLU())
        self.block2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        a = self.block1(h)
        b = torch.relu(self.block2(a)) + h
        return self.head(b + a)


def tiny_residual(*, in_features: int = 8, hidden: int = 16, out_features: int = 4) -> nn.Module:
    return TinyResidual(in_features, hidden, out_features)
