"""Partial layers as torch modules compute what the numpy partial layers compute:
on the same weights, seeds and drops (zpipe.lossy.torch_partial)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from zpipe._errors import ConfigError
from zpipe.lossy.data import Dataset
from zpipe.lossy.engine import LinkChannel, PartitionedMLP
from zpipe.lossy.partial import init_mlp, mlp_forward_backward, slice_backward, slice_forward
from zpipe.lossy.partition import NeuronSlice, partition
from zpipe.lossy.radio import uniform_topology
from zpipe.lossy.shard import DeviceShard, Topology
from zpipe.lossy.simulate import RunConfig, prepare_run
from zpipe.lossy.torch_partial import (
    PartialDense,
    TorchDeviceShard,
    assemble_view,
    split_dense,
    sum_partial_grads,
)
from zpipe.lossy.trace import train_in_process

SIZES = [12, 16, 16, 10]


def _dataset(seed: int = 0, n: int = 120) -> Dataset:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, SIZES[0]))
    y = rng.integers(0, SIZES[-1], size=n)
    y[0] = SIZES[-1] - 1  # every class appears: the data set's class count is the layer's
    return Dataset("random", x, y, x[:20], y[:20])


def test_split_dense_slices_compute_the_rows_of_the_whole_layer() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(6, 7).double()
    slices = [NeuronSlice(1, 0, 3), NeuronSlice(1, 3, 5), NeuronSlice(1, 5, 7)]
    parts = split_dense(linear, slices, relu=True)
    x = torch.randn(4, 6, dtype=torch.float64)
    whole = torch.relu(linear(x))
    got = torch.cat([p(x) for p in parts], dim=1)
    torch.testing.assert_close(got, whole, rtol=1e-12, atol=1e-14)
    assert [p.width for p in parts] == [3, 2, 2] and [p.start for p in parts] == [0, 3, 5]
    with pytest.raises(ConfigError, match="outside"):
        split_dense(linear, [NeuronSlice(1, 5, 9)], relu=True)


def test_partial_dense_equals_the_numpy_slice_forward_and_backward() -> None:
    rng = np.random.default_rng(1)
    w, b = rng.normal(size=(5, 8)), rng.normal(size=5)
    x = rng.normal(size=(3, 8))
    module = PartialDense(torch.from_numpy(w), torch.from_numpy(b), relu=False)
    xt = torch.from_numpy(x).requires_grad_(True)
    z = module(xt)
    z_np, _ = slice_forward(x, w, b, relu=False)
    np.testing.assert_allclose(z.detach().numpy(), z_np, rtol=1e-12)
    delta = rng.normal(size=(3, 5))
    z.backward(torch.from_numpy(delta))
    dw, db, dx = slice_backward(delta, x, w)
    assert module.weight.grad is not None and module.bias.grad is not None
    assert xt.grad is not None
    np.testing.assert_allclose(module.weight.grad.numpy(), dw, rtol=1e-12)
    np.testing.assert_allclose(module.bias.grad.numpy(), db, rtol=1e-12)
    np.testing.assert_allclose(xt.grad.numpy(), dx, rtol=1e-12)


def test_a_missing_partial_is_zeros_and_a_missing_gradient_adds_nothing() -> None:
    a = torch.ones(2, 3, dtype=torch.float64)
    view = assemble_view(5, 2, [(0, 3, a), (3, 5, None)])
    assert torch.equal(view[:, :3], a) and torch.equal(view[:, 3:], torch.zeros(2, 2).double())
    g = torch.full((2, 3), 2.0, dtype=torch.float64)
    assert torch.equal(sum_partial_grads((2, 3), [g, None, g]), 2 * g)
    assert torch.equal(sum_partial_grads((2, 3), [None]), torch.zeros(2, 3).double())


@pytest.mark.parametrize("kind", ["vertical", "hybrid", "horizontal"])
def test_torch_shards_equal_numpy_shards_on_one_lossless_step(kind: str) -> None:
    alloc = partition(kind, SIZES, 4).with_devices([2, 0, 3, 1])
    params = init_mlp(SIZES, seed=5)
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(6, SIZES[0])), rng.integers(0, SIZES[-1], size=6)
    model = PartitionedMLP(
        alloc,
        params,
        LinkChannel(prr=uniform_topology(4, 1.0), seed=0, lossless=True),
        lr=0.1,
        record_grads=True,
        shard_factory=TorchDeviceShard,
    )
    for layer in range(alloc.n_layers):
        model.forward(1, layer, x)
    losses = [model.backward(1, layer, y) for layer in range(alloc.n_layers - 1, 0, -1)]
    ref_loss, _, ref_grads = mlp_forward_backward(params, x, y)
    assert losses[0] == pytest.approx(ref_loss, rel=1e-12)
    for (w, b), (dw, db), (w_got, b_got) in zip(
        params, ref_grads, model.full_params(), strict=True
    ):
        np.testing.assert_allclose(w_got, w - 0.1 * dw, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(b_got, b - 0.1 * db, rtol=1e-12, atol=1e-14)
    assert not model.stash  # every backward took its forward's stash


def test_one_shard_null_fills_like_the_numpy_shard() -> None:
    alloc = partition("hybrid", SIZES, 4)
    topo = Topology(alloc)
    params = init_mlp(SIZES, seed=7)
    device = topo.owners[2][0][0]
    weights = {
        layer: (params[layer - 1][0][sl.start : sl.stop], params[layer - 1][1][sl.start : sl.stop])
        for layer in range(1, topo.n_layers)
        if (sl := topo.slice_of(layer, device)) is not None
    }
    np_shard = DeviceShard(topo, device, weights, lr=0.05)
    t_shard = TorchDeviceShard(topo, device, weights, lr=0.05)
    rng = np.random.default_rng(3)
    senders = topo.owners[1]
    # only the first sender's slice of layer 1 arrived
    first, sl = senders[0]
    got = {first: rng.normal(size=(4, sl.width))}
    out_np = np_shard.forward(1, 2, 4, got)
    out_t = t_shard.forward(1, 2, 4, got)
    assert [(o.dst, o.kind) for o in out_np] == [(o.dst, o.kind) for o in out_t]
    for a, b in zip(out_np, out_t, strict=True):
        np.testing.assert_allclose(b.values, a.values, rtol=1e-12, atol=1e-15)
    # no gradient partial arrived from layer 3's owners: the slice still steps (on zeros)
    back_np, _ = np_shard.backward(1, 2, np.zeros(4, dtype=np.int64), {})
    back_t, _ = t_shard.backward(1, 2, np.zeros(4, dtype=np.int64), {})
    for a, b in zip(back_np, back_t, strict=True):
        np.testing.assert_allclose(b.values, a.values, atol=1e-15)
    for layer in np_shard.weights:
        np.testing.assert_allclose(
            t_shard.weights[layer][0], np_shard.weights[layer][0], rtol=1e-12
        )


@pytest.mark.parametrize("kind", ["vertical", "hybrid"])
def test_a_lossy_run_with_torch_shards_equals_the_numpy_simulation(kind: str) -> None:
    data = _dataset()
    cfg = RunConfig(
        allocation=kind,
        n_devices=4,
        region_m=80.0,
        seed=3,
        hidden=(16, 16),
        lr=0.1,
        batch_size=10,
        n_data=6,
        mapping="exhaustive",
    )
    prepared = prepare_run(cfg, data)
    want = train_in_process(prepared, data)
    got = train_in_process(prepared, data, shard_factory=TorchDeviceShard)
    assert got.arrivals == want.arrivals
    assert want.propagation.rate("forward", "backward") < 1.0  # something was lost
    np.testing.assert_allclose(list(got.losses.values()), list(want.losses.values()), rtol=1e-12)
    for (w1, b1), (w2, b2) in zip(got.params, want.params, strict=True):
        np.testing.assert_allclose(w1, w2, rtol=1e-10, atol=1e-13)
        np.testing.assert_allclose(b1, b2, rtol=1e-10, atol=1e-13)
