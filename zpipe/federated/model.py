"""The small model every simulated client trains: an MLP in numpy (one hidden layer
by default; more with :attr:`MLPShape.more_hidden`, so that a pipeline client has
units to spread over three or four stages).

Weights travel as one flat float64 vector (what the aggregation rules mix):
every layer's ``[in, out]`` weight matrix, then its bias, layer after layer;
:class:`MLPShape` says how to cut it into layers. Local training is plain
mini-batch SGD on softmax cross-entropy plus FedProx's proximal term
mu/2 ||w - w_received||^2 (Eco-FL's h_c^g of section 5.1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import numpy.typing as npt

from zpipe._errors import ConfigError
from zpipe.federated.aggregation import proximal_gradient

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class MLPShape:
    """``n_in`` -> ``n_hidden`` -> ``more_hidden``... -> ``n_out``, ReLU after every
    hidden layer. ``MLPShape(64, 32, 10)`` is the federated default."""

    n_in: int
    n_hidden: int
    n_out: int
    # hidden layers after the first (a deeper model for pipeline clients); () keeps
    # the one-hidden-layer MLP, whose flat layout and arithmetic are unchanged
    more_hidden: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        widths = self.dims
        if any(isinstance(w, bool) or not isinstance(w, int | np.integer) for w in widths):
            raise ConfigError(f"MLP widths must be integers, got {list(widths)}")
        if min(widths) < 1:
            raise ConfigError(f"MLP widths must be >= 1, got {list(widths)}")
        object.__setattr__(self, "more_hidden", tuple(int(w) for w in self.more_hidden))

    @classmethod
    def from_dims(cls, dims: Sequence[int]) -> MLPShape:
        """The shape of ``[in, hidden..., out]`` (at least one hidden layer)."""
        if len(dims) < 3:
            raise ConfigError(f"an MLP needs inputs, a hidden layer and outputs, got {list(dims)}")
        return cls(int(dims[0]), int(dims[1]), int(dims[-1]), tuple(int(d) for d in dims[2:-1]))

    @property
    def dims(self) -> tuple[int, ...]:
        """Every layer's width, inputs first: what the ``mlp`` model family's ``dims`` are."""
        return (self.n_in, self.n_hidden, *self.more_hidden, self.n_out)

    @property
    def num_layers(self) -> int:
        return len(self.dims) - 1

    @property
    def size(self) -> int:
        return sum(a * b + b for a, b in pairwise(self.dims))

    def layers(self, flat: FloatArray) -> list[tuple[FloatArray, FloatArray]]:
        """Every layer's (weights [in, out], bias) as views of ``flat``."""
        if flat.shape != (self.size,):
            raise ConfigError(
                f"expected {self.size} weights for {list(self.dims)}, got {flat.shape}"
            )
        out, at = [], 0
        for a, b in pairwise(self.dims):
            w = flat[at : at + a * b].reshape(a, b)
            at += a * b
            out.append((w, flat[at : at + b]))
            at += b
        return out

    def unpack(self, flat: FloatArray) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray]:
        """(w1, b1, w2, b2) of a one-hidden-layer shape (see :meth:`layers` for any)."""
        if self.more_hidden:
            raise ConfigError("unpack() is for one hidden layer; use layers()")
        (w1, b1), (w2, b2) = self.layers(flat)
        return w1, b1, w2, b2


def init_weights(shape: MLPShape, rng: np.random.Generator) -> FloatArray:
    """He-initialised hidden layers, a Glorot-scaled output layer, zero biases
    (the weight matrices drawn in layer order, from one generator)."""
    dims = shape.dims
    weights = [
        rng.normal(0.0, np.sqrt((2.0 if i < shape.num_layers - 1 else 1.0) / a), (a, b))
        for i, (a, b) in enumerate(pairwise(dims))
    ]
    return np.concatenate(
        [part for w, b in zip(weights, dims[1:], strict=True) for part in (w.ravel(), np.zeros(b))]
    )


def _forward(flat: FloatArray, shape: MLPShape, x: FloatArray) -> list[FloatArray]:
    """The input, every hidden layer's activations, and the logits."""
    layers = shape.layers(flat)
    outs = [x]
    for w, b in layers[:-1]:
        outs.append(np.maximum(outs[-1] @ w + b, 0.0))
    w, b = layers[-1]
    outs.append(outs[-1] @ w + b)
    return outs


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
    layers = shape.layers(flat)
    outs = _forward(flat, shape, x)
    logits = outs[-1] - outs[-1].max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    n = len(y)
    delta = probs.copy()
    delta[np.arange(n), y] -= 1.0
    delta /= n
    grads: list[FloatArray] = []
    for i in range(len(layers) - 1, -1, -1):
        inputs = outs[i]
        grads += [delta.sum(axis=0), (inputs.T @ delta).ravel()]
        if i > 0:  # back through layer i's weights and layer i-1's ReLU
            delta = (delta @ layers[i][0].T) * (inputs > 0)
    return probs, np.concatenate(grads[::-1])


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
    logits = _forward(flat, shape, x)[-1]
    return float(np.mean(np.argmax(logits, axis=1) == y))
