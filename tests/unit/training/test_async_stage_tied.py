"""A forward with an older weight version reads that version under every name of a
tied weight (AsyncStageCompute unties only units that share tensors)."""

from __future__ import annotations

import torch
from torch import nn

from zpipe.training.async_stage import AsyncStageCompute


class TiedPair(nn.Module):
    """Two linear maps that share one weight matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Linear(4, 4)
        self.decode = nn.Linear(4, 4)
        self.decode.weight = self.encode.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(torch.tanh(self.encode(x)))


def _run_with(unit: TiedPair, weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    hidden = torch.tanh(x @ weights["encode.weight"].T + weights["encode.bias"])
    return hidden @ weights["encode.weight"].T + weights["decode.bias"]


def test_a_tied_unit_forwards_with_the_stashed_version_under_both_names() -> None:
    torch.manual_seed(0)
    unit = TiedPair()
    version0 = {n: p.detach().clone() for n, p in unit.named_parameters()}
    compute = AsyncStageCompute(
        [unit], first=False, last=False, loss="mse", optimizer={"name": "adam", "lr": 0.1}
    )
    x = torch.randn(3, 4)
    compute.forward(0, 0, (x,))
    compute.backward(0, (torch.ones(3, 4),))
    compute.step(0)
    assert not torch.equal(unit.encode.weight, version0["encode.weight"])
    out, _ = compute.forward(1, 0, (x,))  # version 0 again: the live weights moved on
    assert torch.equal(out[0], _run_with(unit, version0, x))


def test_an_untied_unit_skips_untying_and_a_tied_one_does_not() -> None:
    compute = AsyncStageCompute(
        [nn.Linear(2, 2), TiedPair()],
        first=False,
        last=False,
        loss="mse",
        optimizer={"name": "sgd", "lr": 0.1},
    )
    assert [c.ties for c in compute._calls] == [False, True]
    assert [c.direct for c in compute._calls] == [True, False]
