"""Helpers shared by tests (moved from test_async_training.py)."""

from __future__ import annotations

import torch

from zpipe.models import ModelSpec

SPEC = ModelSpec("mlp", {"dims": [12, 24, 24, 24, 4], "activation": "gelu"}, seed=11)
SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9}
ADAM = {"name": "adam", "lr": 0.01, "betas": [0.8, 0.99]}


def make_batches(
    count: int, size: int, *, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(size, 12, generator=generator),
            torch.randint(0, 4, (size,), generator=generator),
        )
        for _ in range(count)
    ]
