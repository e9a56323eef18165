"""The mlp family's residual blocks (``"residual": true``): split equals whole,
forward and backward, and the config-only counts match the built units."""

from __future__ import annotations

import pytest
import torch

from zpipe._errors import ModelSpecError
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence, run_units
from zpipe.models.mlp import Dense, ResidualBlock

# units: 8->16 dense, a 16 block, 16->12 dense, a 12 block, 12->4 (the last, linear)
DIMS = [8, 16, 16, 12, 12, 4]


def spec(**extra: object) -> ModelSpec:
    return ModelSpec("mlp", {"dims": DIMS, "activation": "gelu", "residual": True, **extra}, seed=3)


def test_blocks_where_the_width_is_kept_and_counts_from_the_config() -> None:
    sequence = load_layer_sequence(spec())
    units = sequence.build_units(0, sequence.num_units)
    kinds = [type(u) for u in units]
    assert kinds == [Dense, ResidualBlock, Dense, ResidualBlock, Dense]
    assert sequence.unit_names() == ["fc0", "block1", "fc2", "block3", "fc4"]
    assert units[-1].activation is None  # type: ignore[union-attr]
    for i, unit in enumerate(units):
        assert sequence.parameter_elements(i, i + 1) == sum(p.numel() for p in unit.parameters())
    # the last unit stays a Linear even where its width is kept
    same = load_layer_sequence(
        ModelSpec("mlp", {"dims": [4, 6, 6, 6], "residual": True})
    ).build_units(0, 3)
    assert [type(u) for u in same] == [Dense, ResidualBlock, Dense]
    plain = load_layer_sequence(ModelSpec("mlp", {"dims": DIMS})).build_units(0, 5)
    assert all(isinstance(u, Dense) for u in plain)
    with pytest.raises(ModelSpecError, match="residual"):
        load_layer_sequence(ModelSpec("mlp", {"dims": DIMS, "residual": 1}))


def test_a_block_is_its_input_plus_two_linears_of_its_normed_input() -> None:
    block = load_layer_sequence(spec()).build_units(1, 2)[0]
    assert isinstance(block, ResidualBlock)
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    normed = torch.nn.functional.layer_norm(x, (16,), block.norm.weight, block.norm.bias)
    inner = torch.nn.functional.gelu(normed @ block.inner.weight.T + block.inner.bias)
    want = x + inner @ block.outer.weight.T + block.outer.bias
    torch.testing.assert_close(block(x), want)


def test_split_at_every_cut_equals_the_whole_model_forward_and_backward() -> None:
    model_spec = spec()
    sequence = load_layer_sequence(model_spec)
    inputs = sequence.example_input(4, seed=1)
    labels = torch.tensor([0, 1, 2, 3])
    whole = build_full_model(model_spec)
    loss = torch.nn.functional.cross_entropy(whole(*inputs)[0], labels)
    loss.backward()
    want = {name: p.grad for name, p in whole.named_parameters()}
    for cut in range(1, sequence.num_units):
        head = sequence.build_units(0, cut)
        tail = sequence.build_units(cut, sequence.num_units)
        middle = run_units(head, inputs)
        sent = tuple(t.detach().requires_grad_() for t in middle)
        out = run_units(tail, sent)
        split_loss = torch.nn.functional.cross_entropy(out[0], labels)
        torch.testing.assert_close(split_loss, loss)
        split_loss.backward()
        # the gradient crosses the cut as a stage would send it
        torch.autograd.backward(middle, tuple(t.grad for t in sent))
        for offset, units in ((0, head), (cut, tail)):
            for i, unit in enumerate(units):
                for name, p in unit.named_parameters():
                    torch.testing.assert_close(p.grad, want[f"units.{offset + i}.{name}"])
