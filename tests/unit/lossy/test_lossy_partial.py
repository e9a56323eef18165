"""Neuron-partitioned layers compute exactly what the whole MLP does when
nothing is lost, and null-fill exactly what is lost."""

from __future__ import annotations

import numpy as np
import pytest

from zpipe._errors import ConfigError
from zpipe.lossy.engine import LinkChannel, PartitionedMLP
from zpipe.lossy.partial import assemble, init_mlp, mlp_forward_backward, mlp_predict, sum_partials
from zpipe.lossy.partition import Allocation, partition
from zpipe.lossy.radio import uniform_topology

SIZES = [12, 16, 16, 16, 16, 10]
ALLOCATIONS = ["naive", "vertical", "hybrid", "horizontal"]


def _batch(seed: int = 0, n: int = 8) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, SIZES[0])), rng.integers(0, SIZES[-1], size=n)


def _model(kind: str, prr: float = 1.0, lr: float = 0.1) -> PartitionedMLP:
    alloc = partition(kind, SIZES, 1 if kind == "naive" else 6)
    if kind != "naive":  # a scrambled placement must not change the arithmetic
        alloc = alloc.with_devices([4, 2, 0, 5, 1, 3])
    channel = LinkChannel(prr=uniform_topology(6, prr), seed=0)
    return PartitionedMLP(alloc, init_mlp(SIZES, seed=3), channel, lr=lr, record_grads=True)


def _one_step(model: PartitionedMLP, x: np.ndarray, y: np.ndarray, data: int = 1) -> float:
    for layer in range(model.n_layers):
        model.forward(data, layer, x)
    loss = None
    for layer in range(model.n_layers - 1, 0, -1):
        out = model.backward(data, layer, y)
        loss = out if out is not None else loss
    assert loss is not None
    return loss


@pytest.mark.parametrize("kind", ALLOCATIONS)
def test_lossless_forward_equals_the_whole_network(kind: str) -> None:
    model = _model(kind)
    x, _ = _batch()
    reference = mlp_predict(init_mlp(SIZES, seed=3), x)
    views = model.predict_views(x, step=0)
    assert len(views) == len(model.owners[-1])
    for view in views:
        np.testing.assert_allclose(view, reference, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ALLOCATIONS)
def test_lossless_backward_equals_the_whole_network(kind: str) -> None:
    model = _model(kind)
    x, y = _batch(1)
    params = init_mlp(SIZES, seed=3)
    ref_loss, _, ref_grads = mlp_forward_backward(params, x, y)
    loss = _one_step(model, x, y)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    for layer in range(1, len(SIZES)):
        for device, sl in model.owners[layer]:
            dw, db = model.grads[(layer, device)]
            np.testing.assert_allclose(dw, ref_grads[layer - 1][0][sl.start : sl.stop], atol=1e-12)
            np.testing.assert_allclose(db, ref_grads[layer - 1][1][sl.start : sl.stop], atol=1e-12)
    # and the update is plain SGD on the stitched weights
    for (w, b), (w0, b0), (gw, gb) in zip(model.full_params(), params, ref_grads, strict=True):
        np.testing.assert_allclose(w, w0 - 0.1 * gw, atol=1e-12)
        np.testing.assert_allclose(b, b0 - 0.1 * gb, atol=1e-12)
    assert not model.inbox and not model.stash  # nothing left behind


def test_lost_forward_partials_are_null_filled() -> None:
    # Horizontal over 2 devices with dead links: each device sees only its own slices.
    sizes = [4, 6, 2]
    alloc = partition("horizontal", sizes, 2)
    params = init_mlp(sizes, seed=0)
    model = PartitionedMLP(alloc, params, LinkChannel(prr=uniform_topology(2, 0.0), seed=0), lr=0.1)
    x, _ = np.arange(8.0).reshape(2, 4) / 8, None
    views = model.predict_views(x, step=0)
    for device, view in enumerate(views):
        (w1, b1), (w2, b2) = params
        x_seen = np.zeros_like(x)
        own0 = alloc.owners(0)[device][1]
        x_seen[:, own0.start : own0.stop] = x[:, own0.start : own0.stop]
        h = np.maximum(x_seen @ w1.T + b1, 0)
        own1 = alloc.owners(1)[device][1]
        h_seen = np.zeros_like(h)
        h_seen[:, own1.start : own1.stop] = h[:, own1.start : own1.stop]
        logits = h_seen @ w2.T + b2
        own2 = alloc.owners(2)[device][1]
        expected = np.zeros_like(logits)
        expected[:, own2.start : own2.stop] = logits[:, own2.start : own2.stop]
        np.testing.assert_allclose(view, expected, atol=1e-12)


def test_lost_backward_partials_add_nothing() -> None:
    # Vertical 3 devices on [4, 5, 5, 3]: with dead links the output device's loss
    # gradient never reaches layer 2, so layer 2 and 1 learn nothing; the output
    # layer still learns from its (null-filled) input.
    sizes = [4, 5, 5, 3]
    alloc = partition("vertical", sizes, 4)
    model = PartitionedMLP(
        alloc,
        init_mlp(sizes, seed=0),
        LinkChannel(prr=uniform_topology(4, 0.0), seed=0),
        lr=0.1,
        record_grads=True,
    )
    x, y = np.ones((3, 4)), np.array([0, 1, 2])
    _one_step(model, x, y)
    for layer in (1, 2):
        ((device, _),) = model.owners[layer]
        dw, db = model.grads[(layer, device)]
        assert not dw.any() and not db.any()
    ((device, _),) = model.owners[3]
    dw, db = model.grads[(3, device)]
    assert not dw.any() and db.any()  # zero input, but the bias still learns
    assert model.propagation.rate("forward") == 0.0 and model.propagation.rate("backward") == 0.0


def test_assemble_and_sum_partials() -> None:
    out, mask = assemble(5, 2, [(0, 2, np.ones((2, 2))), (2, 5, None)])
    assert out.tolist() == [[1, 1, 0, 0, 0]] * 2
    assert mask.tolist() == [True, True, False, False, False]
    total = sum_partials((1, 2), [np.ones((1, 2)), None, 2 * np.ones((1, 2))])
    assert total.tolist() == [[3, 3]]


def test_mismatched_parameters_are_rejected() -> None:
    alloc = partition("hybrid", SIZES, 6)
    channel = LinkChannel(prr=uniform_topology(6, 1.0), seed=0)
    with pytest.raises(ConfigError, match="dense layers"):
        PartitionedMLP(alloc, init_mlp(SIZES[:-1], seed=0), channel, lr=0.1)
    with pytest.raises(ConfigError, match="shape"):
        PartitionedMLP(alloc, init_mlp([12, 16, 16, 16, 17, 10], seed=0), channel, lr=0.1)
    small = LinkChannel(prr=uniform_topology(3, 1.0), seed=0)
    with pytest.raises(ConfigError, match="link matrix"):
        PartitionedMLP(alloc, init_mlp(SIZES, seed=0), small, lr=0.1)
    assert isinstance(Allocation.from_json(alloc.to_json()), Allocation)
