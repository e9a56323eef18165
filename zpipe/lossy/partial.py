"""Neuron-sliced dense layers and the unpartitioned MLP they must reproduce.

A device owning neurons ``[a, b)`` of dense layer ``l`` holds rows ``a:b`` of
that layer's weight matrix ``W_l`` (shape ``out x in``) and bias. It computes

    z = x W_l[a:b]^T + b_l[a:b],   h = relu(z)     (identity at the output)

from its own *view* ``x`` of the previous layer's outputs, assembled from the
slices that reached it, with zeros where a slice was lost. In backward it
turns its slice of ``dL/dh`` into ``delta = dL/dh * relu'(z)``, its weight
gradient ``delta^T x`` and a *partial sum* ``delta W_l[a:b]`` of ``dL/dx``:
the previous layer's owners add the partials from every owner of layer ``l``,
a lost partial adding nothing. With every slice delivered this is exactly the
unpartitioned layer (``tests/unit/lossy/test_lossy_partial.py``).

Everything here is pure numpy on float64 arrays, no I/O: the stage runtime
can call the same functions on what its sockets received.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from zpipe._errors import ConfigError

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


def init_mlp(layer_sizes: Sequence[int], *, seed: int) -> list[tuple[FloatArray, FloatArray]]:
    """He-initialised ``(W, b)`` per dense layer, ``W`` of shape ``(out, in)``.

    Seeded, so a partitioned network and the whole one start identical.
    """
    if len(layer_sizes) < 2:
        raise ConfigError(f"an MLP needs at least 2 layers, got {list(layer_sizes)}")
    rng = np.random.default_rng(seed)
    params = []
    for n_in, n_out in itertools.pairwise(layer_sizes):
        w = rng.normal(0.0, np.sqrt(2.0 / n_in), size=(n_out, n_in))
        params.append((w, np.zeros(n_out)))
    return params


def assemble(
    width: int, batch: int, parts: Sequence[tuple[int, int, FloatArray | None]]
) -> tuple[FloatArray, BoolArray]:
    """The full ``(batch, width)`` vector from ``(start, stop, values)`` slices;
    a ``None`` slice is null-filled with zeros and marked ``False`` in the mask."""
    out = np.zeros((batch, width))
    mask = np.zeros(width, dtype=bool)
    for start, stop, values in parts:
        if values is not None:
            out[:, start:stop] = values
            mask[start:stop] = True
    return out, mask


def sum_partials(shape: tuple[int, int], partials: Sequence[FloatArray | None]) -> FloatArray:
    """Sum of the partial gradients that arrived; a lost one adds nothing."""
    out = np.zeros(shape)
    for p in partials:
        if p is not None:
            out += p
    return out


def slice_forward(
    x_view: FloatArray, w: FloatArray, b: FloatArray, *, relu: bool
) -> tuple[FloatArray, FloatArray]:
    """``(z, h)`` for one neuron slice."""
    z = x_view @ w.T + b
    return z, (np.maximum(z, 0.0) if relu else z)


def softmax(logits: FloatArray) -> FloatArray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(shifted)
    return np.asarray(e / e.sum(axis=1, keepdims=True), dtype=np.float64)


def cross_entropy(logits: FloatArray, labels: npt.NDArray[np.int64]) -> float:
    """Mean softmax cross-entropy."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(shifted).sum(axis=1))
    return float(np.mean(log_z - shifted[np.arange(len(labels)), labels]))


def output_delta(
    logits_view: FloatArray, labels: npt.NDArray[np.int64], start: int, stop: int
) -> FloatArray:
    """``dL/dz`` of output neurons ``[start, stop)`` for mean cross-entropy, from
    this device's view of all logits."""
    p = softmax(logits_view)
    p[np.arange(len(labels)), labels] -= 1.0
    return np.asarray(p[:, start:stop] / len(labels), dtype=np.float64)


def slice_backward(
    delta: FloatArray, x_view: FloatArray, w: FloatArray
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """``(dW, db, dx_partial)`` for one slice given its ``delta = dL/dz``."""
    return delta.T @ x_view, delta.sum(axis=0), delta @ w


def relu_grad(dh: FloatArray, z: FloatArray) -> FloatArray:
    return np.asarray(dh * (z > 0.0), dtype=np.float64)


def mlp_forward_backward(
    params: Sequence[tuple[FloatArray, FloatArray]],
    x: FloatArray,
    labels: npt.NDArray[np.int64],
) -> tuple[float, FloatArray, list[tuple[FloatArray, FloatArray]]]:
    """Reference, unpartitioned: ``(loss, logits, [(dW, db)] per layer)``."""
    acts = [x]
    zs = []
    last = len(params) - 1
    for k, (w, b) in enumerate(params):
        z, h = slice_forward(acts[-1], w, b, relu=k < last)
        zs.append(z)
        acts.append(h)
    logits = acts[-1]
    loss = cross_entropy(logits, labels)
    delta = output_delta(logits, labels, 0, logits.shape[1])
    grads: list[tuple[FloatArray, FloatArray]] = [(np.empty(0), np.empty(0))] * len(params)
    for k in range(last, -1, -1):
        dw, db, dx = slice_backward(delta, acts[k], params[k][0])
        grads[k] = (dw, db)
        if k > 0:
            delta = relu_grad(dx, zs[k - 1])
    return loss, logits, grads


def mlp_predict(params: Sequence[tuple[FloatArray, FloatArray]], x: FloatArray) -> FloatArray:
    """Reference logits."""
    h = x
    last = len(params) - 1
    for k, (w, b) in enumerate(params):
        _, h = slice_forward(h, w, b, relu=k < last)
    return h
