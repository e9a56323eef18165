"""Neuron-sliced dense layers as torch modules: what a stage computes for its super neuron.

The same arithmetic as :mod:`zpipe.lossy.partial` (numpy), in float64 torch
(a slice's backward in closed form, ``dW = delta^T x``, ``db = sum delta``,
``dx = delta W``: on these small matrices autograd's graph costs more than the
products):

- :class:`PartialDense` is rows ``a:b`` of a dense layer ``W`` (``out x in``)
  and its bias, an ``nn.Module``; :func:`split_dense` cuts an ``nn.Linear``
  (or a ``(W, b)`` pair) into the slices the partition gives a layer;
- :func:`assemble_view` builds a device's view of the previous layer from the
  slices that reached it, a missing one null-filled with zeros;
- :func:`sum_partial_grads` adds the gradient partials that arrived, a missing
  one adding nothing;
- :class:`TorchDeviceShard` is :class:`zpipe.lossy.shard.DeviceShard` with
  these modules: the same passes, messages and equation 3 weight stashing, so
  the in-process engine and a stage can run either one
  (``tests/unit/lossy/test_lossy_torch_partial.py`` checks they agree on the same weights,
  seeds and drops).

Messages keep carrying numpy arrays (:class:`~zpipe.lossy.shard.Outgoing`), so
the wire format and the drop decisions do not depend on which shard computed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional

from zpipe._errors import ConfigError
from zpipe.lossy.links import Direction
from zpipe.lossy.partial import FloatArray
from zpipe.lossy.partition import NeuronSlice
from zpipe.lossy.shard import (
    IntArray,
    Outgoing,
    Partials,
    Topology,
    arrived_senders,
    gradient_partials,
)

DTYPE = torch.float64


class PartialDense(nn.Module):
    """Neurons ``[start, stop)`` of one dense layer: ``h = relu(x W[a:b]^T + b[a:b])``
    (identity at the output layer)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor, *, relu: bool, start: int = 0
    ) -> None:
        super().__init__()
        if weight.dim() != 2 or bias.shape != (weight.shape[0],):
            raise ConfigError(
                f"a partial layer needs W (width, in) and b (width,), got "
                f"{tuple(weight.shape)} and {tuple(bias.shape)}"
            )
        self.weight = nn.Parameter(weight.detach().to(DTYPE).clone())
        self.bias = nn.Parameter(bias.detach().to(DTYPE).clone())
        self.relu = relu
        self.start = start

    @property
    def width(self) -> int:
        return int(self.weight.shape[0])

    def forward(self, x_view: torch.Tensor) -> torch.Tensor:
        z = functional.linear(x_view, self.weight, self.bias)
        return torch.relu(z) if self.relu else z


def split_dense(
    layer: nn.Linear | tuple[torch.Tensor, torch.Tensor],
    slices: Sequence[NeuronSlice],
    *,
    relu: bool,
) -> list[PartialDense]:
    """One :class:`PartialDense` per neuron slice of ``layer`` (its output neurons)."""
    if isinstance(layer, nn.Linear):
        if layer.bias is None:
            raise ConfigError("a partial layer needs a dense layer with a bias")
        weight, bias = layer.weight.data, layer.bias.data
    else:
        weight, bias = layer
    out = []
    for sl in slices:
        if not 0 <= sl.start < sl.stop <= weight.shape[0]:
            raise ConfigError(f"slice {sl} lies outside a layer of {weight.shape[0]} neurons")
        out.append(
            PartialDense(
                weight[sl.start : sl.stop], bias[sl.start : sl.stop], relu=relu, start=sl.start
            )
        )
    return out


def assemble_view(
    width: int, batch: int, parts: Sequence[tuple[int, int, torch.Tensor | None]]
) -> torch.Tensor:
    """The full ``(batch, width)`` input from ``(start, stop, values)`` slices; a
    ``None`` (lost) slice is null-filled with zeros."""
    out = torch.zeros((batch, width), dtype=DTYPE)
    for start, stop, values in parts:
        if values is not None:
            out[:, start:stop] = values
    return out


def sum_partial_grads(
    shape: tuple[int, int], partials: Sequence[torch.Tensor | None]
) -> torch.Tensor:
    """The sum of the gradient partials that arrived; a lost one adds nothing."""
    out = torch.zeros(shape, dtype=DTYPE)
    for p in partials:
        if p is not None:
            out += p
    return out


def output_grad(
    logits_view: torch.Tensor, labels: torch.Tensor, start: int, stop: int
) -> torch.Tensor:
    """``dL/dz`` of output neurons ``[start, stop)`` for mean cross-entropy."""
    p = torch.softmax(logits_view, dim=1)
    p[torch.arange(len(labels)), labels] -= 1.0
    return p[:, start:stop] / len(labels)


def cross_entropy_loss(logits_view: torch.Tensor, labels: torch.Tensor) -> float:
    return float(functional.cross_entropy(logits_view, labels))


def _tensor(values: FloatArray | None) -> torch.Tensor | None:
    return None if values is None else torch.from_numpy(np.asarray(values, dtype=np.float64))


class _Stashed:
    """What a forward pass keeps for its backward (equation 3): the input view,
    the weights it used and its pre-activation."""

    __slots__ = ("weight", "x_view", "z")

    def __init__(self, x_view: torch.Tensor, weight: torch.Tensor, z: torch.Tensor) -> None:
        self.x_view = x_view
        self.weight = weight
        self.z = z


class TorchDeviceShard:
    """One device's partial layers and passes: :class:`~zpipe.lossy.shard.DeviceShard`
    with :class:`PartialDense` modules (see the module docstring)."""

    def __init__(
        self,
        topology: Topology,
        device: int,
        weights: Mapping[int, tuple[FloatArray, FloatArray]],
        *,
        lr: float,
        record_grads: bool = False,
    ) -> None:
        self.topology = topology
        self.device = device
        self.lr = lr
        self.slices: dict[int, NeuronSlice] = {}
        for layer in range(topology.n_layers):
            sl = topology.slice_of(layer, device)
            if sl is not None:
                self.slices[layer] = sl
        self.layers = nn.ModuleDict()
        for layer, (w, b) in weights.items():
            self.layers[str(layer)] = PartialDense(
                torch.from_numpy(np.asarray(w, dtype=np.float64)),
                torch.from_numpy(np.asarray(b, dtype=np.float64)),
                relu=layer < topology.last,
                start=self.slices[layer].start,
            )
        self.stash: dict[tuple[int, int], _Stashed] = {}
        #: senders whose forward partial arrived (as ``DeviceShard.arrived``)
        self.arrived: dict[tuple[int, int], frozenset[int]] = {}
        self.record_grads = record_grads
        self.grads: dict[int, tuple[FloatArray, FloatArray]] = {}

    def module(self, layer: int) -> PartialDense:
        module = self.layers[str(layer)]
        assert isinstance(module, PartialDense)
        return module

    @property
    def weights(self) -> dict[int, tuple[FloatArray, FloatArray]]:
        """The latest slices as numpy arrays (copies), by layer."""
        return {
            int(layer): (
                module.weight.detach().numpy().copy(),
                module.bias.detach().numpy().copy(),
            )
            for layer, module in self.layers.items()
            if isinstance(module, PartialDense)
        }

    def forward(
        self,
        data: int,
        layer: int,
        batch: int,
        got: Partials,
        *,
        x: FloatArray | None = None,
        train: bool = True,
    ) -> list[Outgoing]:
        """Forward pass of ``layer`` for mini-batch ``data`` (as ``DeviceShard.forward``)."""
        topo = self.topology
        sl = self.slices[layer]
        if layer == 0:
            if x is None:
                raise ValueError("the input layer's forward pass needs x")
            out = np.asarray(x)[:, sl.start : sl.stop]
        else:
            x_view = assemble_view(
                topo.alloc.layer_sizes[layer - 1],
                batch,
                [(s.start, s.stop, _tensor(got.get(src))) for src, s in topo.owners[layer - 1]],
            )
            module = self.module(layer)
            # References, not copies: an update rebinds the parameters' data (out of
            # place), so a stashed tensor keeps the weights of this moment (equation 3).
            weight, bias = module.weight.detach(), module.bias.detach()
            z = functional.linear(x_view, weight, bias)
            h = torch.relu(z) if module.relu else z
            if train:
                self.stash[(data, layer)] = _Stashed(x_view, weight, z)
                self.arrived[(data, layer)] = arrived_senders(topo, layer, got)
            out = h.numpy()
        if layer < topo.last:
            kind = "F"
            direction = Direction.FORWARD if train else Direction.TEST_FORWARD
        else:
            kind = "S"
            direction = Direction.SHARE if train else Direction.TEST_SHARE
        return [Outgoing(dst, kind, layer, layer, direction, out) for dst in topo.receivers[layer]]

    def logits_view(self, batch: int, got: Partials) -> FloatArray:
        """This output owner's view of all logits from the shared slices."""
        return self._logits(batch, got).numpy()

    def _logits(self, batch: int, got: Partials) -> torch.Tensor:
        topo = self.topology
        return assemble_view(
            topo.alloc.layer_sizes[topo.last],
            batch,
            [(s.start, s.stop, _tensor(got.get(src))) for src, s in topo.owners[topo.last]],
        )

    def backward(
        self, data: int, layer: int, labels: IntArray, got: Partials
    ) -> tuple[list[Outgoing], float | None]:
        """Backward pass of ``layer`` for mini-batch ``data``; updates this slice
        (as ``DeviceShard.backward``)."""
        topo = self.topology
        sl = self.slices[layer]
        batch = len(labels)
        stashed = self.stash.pop((data, layer))
        arrived = self.arrived.pop((data, layer), frozenset())
        loss: float | None = None
        if layer == topo.last:
            logits = self._logits(batch, got)
            y = torch.from_numpy(np.asarray(labels, dtype=np.int64))
            loss = cross_entropy_loss(logits, y)
            grad_h = output_grad(logits, y, sl.start, sl.stop)
        else:
            grad_h = sum_partial_grads(
                (batch, sl.width),
                [_tensor(got.get(src)) for src, _ in topo.owners[layer + 1]],
            )
        # The closed form of a dense slice's backward: on these small matrices it
        # costs a fraction of autograd's graph walk, and needs no copy of the weights.
        delta = grad_h if layer == topo.last else grad_h * (stashed.z > 0.0)
        dw, db = delta.T @ stashed.x_view, delta.sum(dim=0)
        if self.record_grads:
            self.grads[layer] = (dw.numpy().copy(), db.numpy().copy())
        out: list[Outgoing] = []
        if layer >= 2:  # the input layer needs no gradient
            out = gradient_partials(topo, layer, (delta @ stashed.weight).numpy(), arrived)
        module = self.module(layer)
        # out of place, as the numpy shard does: a stashed tensor never aliases these
        module.weight.data = module.weight.data - self.lr * dw
        module.bias.data = module.bias.data - self.lr * db
        return out, loss

    def forget(self, data: int) -> None:
        for key in [k for k in self.stash if k[0] == data]:
            del self.stash[key]
            self.arrived.pop(key, None)
