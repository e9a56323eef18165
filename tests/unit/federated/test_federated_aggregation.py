"""Aggregation rules and the clients' local objective, each against a direct computation."""

from __future__ import annotations

import numpy as np
import pytest

from zpipe._errors import ConfigError
from zpipe.federated.aggregation import (
    fedasync_mix,
    fedat_tier_weights,
    proximal_gradient,
    staleness_factor,
    weighted_average,
)
from zpipe.federated.model import MLPShape, init_weights, local_train, loss_and_gradient


def test_weighted_average_is_fedavg_by_sample_counts() -> None:
    rng = np.random.default_rng(0)
    models = [rng.normal(size=7) for _ in range(3)]
    counts = [10, 30, 60]
    expected = (10 * models[0] + 30 * models[1] + 60 * models[2]) / 100
    assert weighted_average(models, counts) == pytest.approx(expected)
    with pytest.raises(ConfigError):
        weighted_average(models, [0, 0, 0])
    with pytest.raises(ConfigError):
        weighted_average(models, [1, 2])


def test_staleness_functions_follow_fedasync() -> None:
    assert staleness_factor(0) == 1.0
    assert staleness_factor(3, a=0.5) == pytest.approx(0.5)  # (1 + 3)^-0.5
    assert staleness_factor(8, a=1.0) == pytest.approx(1 / 9)
    assert staleness_factor(4, function="hinge", a=10, b=4) == 1.0
    assert staleness_factor(6, function="hinge", a=10, b=4) == pytest.approx(1 / 21)
    assert staleness_factor(50, function="constant") == 1.0
    with pytest.raises(ConfigError):
        staleness_factor(-1)
    with pytest.raises(ConfigError):
        staleness_factor(1, function="exponential")


def test_fedasync_mix_with_staleness() -> None:
    old, new = np.array([1.0, 2.0, 3.0]), np.array([3.0, 2.0, -1.0])
    alpha_t = 0.6 * staleness_factor(3)
    mixed = fedasync_mix(old, new, 0.6, staleness_factor(3))
    assert mixed == pytest.approx((1 - alpha_t) * old + alpha_t * new)
    assert fedasync_mix(old, new, 1.0) == pytest.approx(new)
    with pytest.raises(ConfigError):
        fedasync_mix(old, new, 0.0)


def test_fedat_weights_mirror_the_update_counts() -> None:
    # fastest tier (10 updates) weighs the slowest's count and vice versa
    assert fedat_tier_weights([10, 5, 1]) == pytest.approx(np.array([1, 5, 10]) / 16)
    assert fedat_tier_weights([1, 10, 5]) == pytest.approx(np.array([10, 1, 5]) / 16)
    assert fedat_tier_weights([0, 0]) == pytest.approx([0.5, 0.5])


def test_model_gradient_matches_finite_differences() -> None:
    rng = np.random.default_rng(1)
    shape = MLPShape(5, 4, 3)
    w = init_weights(shape, rng)
    x, y = rng.random((6, 5)), rng.integers(0, 3, 6)
    _, grad = loss_and_gradient(w, shape, x, y)
    eps = 1e-6
    for i in rng.choice(shape.size, size=15, replace=False):
        step = np.zeros_like(w)
        step[i] = eps
        numeric = (
            loss_and_gradient(w + step, shape, x, y)[0]
            - loss_and_gradient(w - step, shape, x, y)[0]
        ) / (2 * eps)
        assert grad[i] == pytest.approx(numeric, abs=1e-6)


def test_proximal_term_gradient_and_its_pull_towards_the_received_model() -> None:
    w, anchor = np.array([1.0, -2.0]), np.array([0.5, 0.5])
    # d/dw mu/2 ||w - anchor||^2 = mu (w - anchor)
    assert proximal_gradient(w, anchor, 0.1) == pytest.approx([0.05, -0.25])
    rng = np.random.default_rng(2)
    shape = MLPShape(4, 3, 2)
    start = init_weights(shape, rng)
    x, y = rng.random((20, 4)), rng.integers(0, 2, 20)

    # two full-batch steps: the second one feels the pull mu (w1 - start)
    mu, lr = 0.3, 0.2
    w1 = start - lr * loss_and_gradient(start, shape, x, y)[1]
    w2 = w1 - lr * (loss_and_gradient(w1, shape, x, y)[1] + mu * (w1 - start))
    trained = local_train(
        start, shape, x, y, steps=2, batch_size=20, lr=lr, mu=mu, rng=np.random.default_rng(3)
    )
    assert trained == pytest.approx(w2)

    def drift(mu: float) -> float:
        trained = local_train(
            start,
            shape,
            x,
            y,
            steps=50,
            batch_size=5,
            lr=0.5,
            mu=mu,
            rng=np.random.default_rng(3),
        )
        return float(np.linalg.norm(trained - start))

    assert drift(1.0) < 0.5 * drift(0.0)
