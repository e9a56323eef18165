"""VersionedCall: a unit run with a version's tensors computes what functional_call
computes, bit for bit, and leaves the live parameters in place."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from zpipe.models import ModelSpec, load_layer_sequence
from zpipe.training.versioned_call import VersionedCall


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3)
        self.norm = nn.BatchNorm1d(3)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(12, 4), nn.GELU(), nn.LayerNorm(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.conv(x)))


def _version_of(unit: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: (p.detach() + torch.randn(p.shape, generator=generator)).requires_grad_(True)
        for name, p in unit.named_parameters()
    }


def _mlp_unit() -> nn.Module:
    spec = ModelSpec("mlp", {"dims": [8, 16, 16, 4], "activation": "gelu", "residual": True})
    return load_layer_sequence(spec).make_unit(1)


@pytest.mark.parametrize("make", [_mlp_unit, Mixed], ids=["residual-mlp", "conv-bn-linear"])
def test_direct_call_equals_functional_call_values_and_gradients(make: type[nn.Module]) -> None:
    torch.manual_seed(0)
    unit = make().train()
    call = VersionedCall(unit)
    assert call.direct
    x = torch.randn(5, 2, 6) if isinstance(unit, Mixed) else torch.randn(5, 16)
    live = {n: p.detach().clone() for n, p in unit.named_parameters()}
    ours_params, theirs_params = _version_of(unit, 1), _version_of(unit, 1)
    ours = call(ours_params, (x,))
    theirs = functional_call(unit, theirs_params, (x,))
    assert isinstance(ours, torch.Tensor) and isinstance(theirs, torch.Tensor)
    assert torch.equal(ours, theirs)
    ours.square().sum().backward()
    theirs.square().sum().backward()
    for name in ours_params:
        assert torch.equal(ours_params[name].grad, theirs_params[name].grad), name
    for name, p in unit.named_parameters():  # the live weights are back, untouched
        assert isinstance(p, nn.Parameter)
        assert torch.equal(p, live[name]) and p.grad is None


def test_the_live_parameters_come_back_when_the_unit_raises() -> None:
    unit = nn.Linear(3, 2)
    call = VersionedCall(unit)
    weight = unit.weight
    with pytest.raises(RuntimeError):
        call(_version_of(unit, 2), (torch.randn(4, 5),))  # wrong width
    assert unit.weight is weight


class OwnWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def test_layers_it_cannot_vouch_for_take_functional_call() -> None:
    assert not VersionedCall(OwnWeight()).direct
    assert not VersionedCall(nn.GRU(2, 2)).direct  # keeps flat references to its weights
    unit = OwnWeight()
    out = VersionedCall(unit)({"scale": torch.full((3,), 2.0)}, (torch.ones(3),))
    assert isinstance(out, torch.Tensor) and torch.equal(out, torch.full((3,), 2.0))
