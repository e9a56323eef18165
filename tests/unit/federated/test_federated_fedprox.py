"""FedProx on a pipeline client: the stages' optimizer against the numpy trainer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from zpipe.federated.fedprox import FACTORY, ProximalSGD, optimizer_config, proximal_sgd
from zpipe.federated.model import MLPShape, init_weights, local_train
from zpipe.federated.pipeline_trainer import flat_weights, mlp_state
from zpipe.training.objectives import check_optimizer

SHAPE = MLPShape(16, 8, 4)


def _data(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    return rng.normal(size=(30, SHAPE.n_in)), rng.integers(0, SHAPE.n_out, size=30)


def _torch_train(
    weights: np.ndarray, x: np.ndarray, y: np.ndarray, *, mu: float, seed: int, steps: int
) -> np.ndarray:
    """What a one-stage pipeline does: units built from the weights, then SGD steps,
    each mini-batch split into two micro-batches whose losses add up to its mean."""
    state = mlp_state(weights, SHAPE)
    first = torch.nn.Linear(SHAPE.n_in, SHAPE.n_hidden)
    second = torch.nn.Linear(SHAPE.n_hidden, SHAPE.n_out)
    with torch.no_grad():
        first.weight.copy_(state["units.0.linear.weight"])
        first.bias.copy_(state["units.0.linear.bias"])
        second.weight.copy_(state["units.1.linear.weight"])
        second.bias.copy_(state["units.1.linear.bias"])
    params = [*first.parameters(), *second.parameters()]
    optimizer = proximal_sgd(params, lr=0.1, mu=mu)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = rng.choice(len(y), size=10, replace=False)
        optimizer.zero_grad()
        for half in (idx[:5], idx[5:]):
            out = second(torch.relu(first(torch.tensor(x[half], dtype=torch.float32))))
            loss = F.cross_entropy(out, torch.tensor(y[half]), reduction="sum") / 10
            loss.backward()
        optimizer.step()
    return flat_weights(
        {
            "units.0.linear.weight": first.weight,
            "units.0.linear.bias": first.bias,
            "units.1.linear.weight": second.weight,
            "units.1.linear.bias": second.bias,
        },
        SHAPE,
    )


@pytest.mark.parametrize("mu", [0.0, 0.5])
def test_the_stage_optimizer_trains_what_the_numpy_trainer_does(mu: float) -> None:
    rng = np.random.default_rng(1)
    weights = init_weights(SHAPE, rng)
    x, y = _data(rng)
    want = local_train(
        weights, SHAPE, x, y, steps=20, batch_size=10, lr=0.1, mu=mu, rng=np.random.default_rng(7)
    )
    got = _torch_train(weights, x, y, mu=mu, seed=7, steps=20)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_mu_pulls_the_update_towards_the_received_weights() -> None:
    rng = np.random.default_rng(2)
    weights = init_weights(SHAPE, rng)
    x, y = _data(rng)
    free = _torch_train(weights, x, y, mu=0.0, seed=3, steps=20)
    pulled = _torch_train(weights, x, y, mu=0.5, seed=3, steps=20)
    assert np.abs(pulled - free).max() > 1e-3  # far beyond float32 noise
    assert np.linalg.norm(pulled - weights) < np.linalg.norm(free - weights)


def test_the_optimizer_description_crosses_as_plain_data() -> None:
    assert optimizer_config(0.1, 0.0) == {"name": "sgd", "lr": 0.1}
    prox = optimizer_config(0.1, 0.05)
    assert prox == {"name": FACTORY, "lr": 0.1, "mu": 0.05}
    assert check_optimizer(prox) == prox
    param = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="unknown fields"):
        proximal_sgd([param], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="mu"):
        ProximalSGD([param], lr=0.1, mu=-1.0)
