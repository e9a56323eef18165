"""The federated MLP with more hidden layers (pipeline clients need units to spread)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from zpipe._errors import ConfigError
from zpipe.federated.model import MLPShape, init_weights, local_train, loss_and_gradient
from zpipe.federated.pipeline_trainer import fixed_partition, flat_weights, mlp_state
from zpipe.models import ModelSpec, load_layer_sequence

DEEP = MLPShape(12, 10, 4, (9, 7))


def test_a_deep_shape_lays_out_every_layer_in_order() -> None:
    assert DEEP.dims == (12, 10, 9, 7, 4)
    assert MLPShape.from_dims([12, 10, 9, 7, 4]) == DEEP
    assert DEEP.size == 12 * 10 + 10 + 10 * 9 + 9 + 9 * 7 + 7 + 7 * 4 + 4
    flat = np.arange(DEEP.size, dtype=np.float64)
    layers = DEEP.layers(flat)
    assert [w.shape for w, _ in layers] == [(12, 10), (10, 9), (9, 7), (7, 4)]
    assert layers[1][0][0, 0] == 12 * 10 + 10  # after the first layer's weights and bias
    assert layers[-1][1][-1] == DEEP.size - 1
    with pytest.raises(ConfigError, match="layers"):
        DEEP.unpack(flat)
    with pytest.raises(ConfigError, match="expected"):
        DEEP.layers(flat[:-1])
    with pytest.raises(ConfigError, match=">= 1"):
        MLPShape(12, 0, 4)


def test_the_default_shape_keeps_its_layout_and_initial_weights() -> None:
    shape = MLPShape(64, 32, 10)
    assert shape.dims == (64, 32, 10) and shape.size == 64 * 32 + 32 + 32 * 10 + 10
    w = init_weights(shape, np.random.default_rng(3))
    # what the one-hidden-layer initialisation drew before deeper shapes existed
    rng = np.random.default_rng(3)
    w1 = rng.normal(0.0, np.sqrt(2.0 / 64), (64, 32))
    w2 = rng.normal(0.0, np.sqrt(1.0 / 32), (32, 10))
    want = np.concatenate([w1.ravel(), np.zeros(32), w2.ravel(), np.zeros(10)])
    assert np.array_equal(w, want)
    unpacked = shape.unpack(w)
    assert np.array_equal(unpacked[0], w1) and np.array_equal(unpacked[2], w2)


def test_the_deep_gradient_is_torchs() -> None:
    rng = np.random.default_rng(0)
    flat = init_weights(DEEP, rng)
    x, y = rng.normal(size=(6, 12)), rng.integers(0, 4, size=6)
    loss, grad = loss_and_gradient(flat, DEEP, x, y)
    model = load_layer_sequence(ModelSpec("mlp", {"dims": list(DEEP.dims)}))
    units = torch.nn.Sequential(*[model.make_unit(i) for i in range(DEEP.num_layers)]).double()
    with torch.no_grad():  # the float64 weights themselves (mlp_state rounds to float32)
        for i, (w, b) in enumerate(DEEP.layers(flat)):
            units[i].linear.weight.copy_(torch.from_numpy(w.T.copy()))
            units[i].linear.bias.copy_(torch.from_numpy(b.copy()))
    out = F.cross_entropy(units(torch.from_numpy(x)), torch.from_numpy(y))
    out.backward()
    want = np.concatenate(
        [
            p
            for u in units
            for p in (u.linear.weight.grad.numpy().T.ravel(), u.linear.bias.grad.numpy())
        ]
    )
    assert loss == pytest.approx(float(out.detach()), rel=1e-9)
    np.testing.assert_allclose(grad, want, rtol=1e-9, atol=1e-12)


def test_deep_weights_round_trip_through_the_pipelines_state() -> None:
    flat = init_weights(DEEP, np.random.default_rng(1)).astype(np.float32).astype(np.float64)
    state = mlp_state(flat, DEEP)
    assert sorted(state) == sorted(
        f"units.{i}.linear.{p}" for i in range(4) for p in ("weight", "bias")
    )
    assert tuple(state["units.1.linear.weight"].shape) == (9, 10)  # nn.Linear keeps [out, in]
    assert np.array_equal(flat_weights(state, DEEP), flat)


def test_deep_local_training_lowers_the_loss() -> None:
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(40, 12)), rng.integers(0, 4, size=40)
    start = init_weights(DEEP, rng)
    trained = local_train(
        start, DEEP, x, y, steps=60, batch_size=10, lr=0.1, mu=0.0, rng=np.random.default_rng(4)
    )
    assert loss_and_gradient(trained, DEEP, x, y)[0] < 0.8 * loss_and_gradient(start, DEEP, x, y)[0]


def test_the_unplanned_partition_keeps_its_old_split() -> None:
    assert fixed_partition(1, 2) == [[0, 2]]
    assert fixed_partition(2, 2) == [[0, 1], [1, 2]]
    assert fixed_partition(2, 4) == [[0, 3], [3, 4]]
