"""The small model every simulated client trains: a one-hidden-layer MLP in numpy.

Weights travel as one flat float64 vector (what the aggregation rules mix);
:class:`MLPShape` says how to cut it into layers. Local training is plain
mini-batch SGD on softmax cross-entropy plus FedProx's proximal term
mu/2 ||w - w_received||^2 (Eco-FL's h_c^g of section 5.1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from zpipe.federated.aggregation import proximal_gradient

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class MLPShape:
    n_in: int
    n_hidden: int
    n_out: int

    @property
    def size(self) -> int:
        return self.n_in * self.n_hidden + self.n_hidden + self.n_hidden * self.n_out + self.n_out

    def unpack(self, flat: FloatArray) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray]:
        i, h, o = self.n_in, self.n_hidden, self.n_out
        a = i * h
        b = a + h
        c = b + h * o
        return flat[:a].reshape(i, h), flat[a:b], flat[b:c].reshape(h, o), flat[c:]


def init_weights(shape: MLPShape, rng: np.random.Generator) -> FloatArray:
    """He-initialised first layer, Glorot-scaled second layer, zero biases."""
    w1 = rng.normal(0.0, np.sqrt(2.0 / shape.n_in), (shape.n_in, shape.n_hidden))
    w2 = rng.normal(0.0, np.sqrt(1.0 / shape.n_hidden), (shape.n_hidden, shape.n_out))
    return np.concatenate([w1.ravel(), np.zeros(shape.n_hidden), w2.ravel(), np.zeros(shape.n_out)])


def _logits(flat: FloatArray, shape: MLPShape, x: FloatArray) -> tuple[FloatArray, FloatArray]:
    w1, b1, w2, b2 = shape.unpack(flat)
    hidden = np.maximum(x @ w1 + b1, 0.0)
    return hidden, hidden @ w2 + b2


def loss_and_gradient(
    flat: FloatArray, shape: MLPShape, x: FloatArray, y: IntArray
) -> tuple[float, FloatArray]:
    """Mean softmax cross-entropy over the batch and its gradient (flat)."""
    probs, grad = _probs_and_gradient(flat, shape, x, y)
    loss = float(-np.mean(np.log(probs[np.arange(len(y)), y] + 1e-12)))
    return loss, grad


def _probs_and_gradient(
    flat: FloatArray, shape: MLPShape, x: FloatArray, y: IntArray
) -> tuple[FloatArray, FloatArray]:
    _, _, w2, _ = shape.unpack(flat)
    hidden, logits = _logits(flat, shape, x)
    logits = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    n = len(y)
    d_logits = probs.copy()
    d_logits[np.arange(n), y] -= 1.0
    d_logits /= n
    g_w2 = hidden.T @ d_logits
    g_b2 = d_logits.sum(axis=0)
    d_hidden = (d_logits @ w2.T) * (hidden > 0)
    g_w1 = x.T @ d_hidden
    g_b1 = d_hidden.sum(axis=0)
    return probs, np.concatenate([g_w1.ravel(), g_b1, g_w2.ravel(), g_b2])


def local_train(
    flat: FloatArray,
    shape: MLPShape,
    x: FloatArray,
    y: IntArray,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    mu: float,
    rng: np.random.Generator,
) -> FloatArray:
    """``steps`` SGD steps from ``flat`` on (x, y), with FedProx's pull towards ``flat``."""
    anchor = flat
    weights = flat.copy()
    for _ in range(steps):
        idx = rng.choice(len(y), size=min(batch_size, len(y)), replace=False)
        _, grad = _probs_and_gradient(weights, shape, x[idx], y[idx])
        if mu > 0:
            grad += proximal_gradient(weights, anchor, mu)
        weights -= lr * grad
    return weights


def accuracy(flat: FloatArray, shape: MLPShape, x: FloatArray, y: IntArray) -> float:
    _, logits = _logits(flat, shape, x)
    return float(np.mean(np.argmax(logits, axis=1) == y))
