"""The CNN's layers as torch modules: a device's whole convolution layers beside its
dense slices (:mod:`zpipe.lossy.cnn`), and the unpartitioned network they must
reproduce.

- :class:`ConvLayer` is one convolution layer owned whole: it reads the previous
  layer as a flat vector (what the partition calls its neurons), reshapes it to
  an image, convolves (3 x 3, padding 1), applies ReLU and, where the network
  pools, 2 x 2 max-pooling, and flattens again; so its output crosses a link,
  is null-filled when lost and takes gradient partials as a dense slice does;
- :class:`TorchCnnShard` is :class:`~zpipe.lossy.torch_partial.TorchDeviceShard`
  with convolution layers: dense layers run the closed-form slice passes, a
  convolution layer's backward is in closed form too (:func:`conv_backward`) on
  what its forward kept (equation 3: the kernels and input view of that forward),
  and its gradient
  partial to the previous layer's owner follows the same rule (zero when that
  owner's forward partial was lost, :func:`~zpipe.lossy.shard.gradient_partials`);
- :class:`CnnReference` is the whole network as one ``nn.Module``, for lossless
  equivalence (sequential SGD) and for a run's lossless test accuracy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial

import numpy as np
import torch
from torch import nn
from torch.nn import functional
from torch.nn import grad as conv_grad

from zpipe._errors import ConfigError
from zpipe.lossy.cnn import PADDING, POOL, CnnSpec, ConvShape
from zpipe.lossy.links import Direction
from zpipe.lossy.partial import FloatArray
from zpipe.lossy.shard import (
    IntArray,
    Outgoing,
    Partials,
    ShardFactory,
    Topology,
    arrived_senders,
)
from zpipe.lossy.shard import gradient_partials as dense_gradient_partials
from zpipe.lossy.torch_partial import (
    DTYPE,
    TorchDeviceShard,
    _tensor,
    assemble_view,
    sum_partial_grads,
)


def conv_forward(
    x_flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, conv: ConvShape
) -> torch.Tensor:
    """One convolution layer on flat inputs ``(batch, in_size)`` -> ``(batch, out_size)``."""
    x = x_flat.reshape(-1, conv.in_channels, conv.height, conv.width)
    h = torch.relu(functional.conv2d(x, weight, bias, padding=PADDING))
    if conv.pool:
        h = functional.max_pool2d(h, POOL)
    return h.reshape(h.shape[0], -1)


class ConvLayer(nn.Module):
    """One whole convolution layer (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, conv: ConvShape) -> None:
        super().__init__()
        if tuple(weight.shape) != conv.weight_shape or tuple(bias.shape) != (conv.out_channels,):
            raise ConfigError(
                f"a convolution layer needs W {conv.weight_shape} and b ({conv.out_channels},), "
                f"got {tuple(weight.shape)} and {tuple(bias.shape)}"
            )
        self.weight = nn.Parameter(weight.detach().to(DTYPE).clone())
        self.bias = nn.Parameter(bias.detach().to(DTYPE).clone())
        self.conv = conv

    def forward(self, x_flat: torch.Tensor) -> torch.Tensor:
        return conv_forward(x_flat, self.weight, self.bias, self.conv)


class _ConvStashed:
    """What a convolution forward keeps for its backward (equation 3): its input
    image, the kernels of that moment, the pre-activation and the pooling's argmax."""

    __slots__ = ("indices", "weight", "x_image", "z")

    def __init__(
        self,
        x_image: torch.Tensor,
        weight: torch.Tensor,
        z: torch.Tensor,
        indices: torch.Tensor | None,
    ) -> None:
        self.x_image = x_image
        self.weight = weight
        self.z = z
        self.indices = indices


def conv_forward_stashed(
    x_flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, conv: ConvShape
) -> tuple[torch.Tensor, _ConvStashed]:
    """:func:`conv_forward`, keeping what :func:`conv_backward` needs."""
    x = x_flat.reshape(-1, conv.in_channels, conv.height, conv.width)
    z = functional.conv2d(x, weight, bias, padding=PADDING)
    h = torch.relu(z)
    indices = None
    if conv.pool:
        h, indices = functional.max_pool2d(h, POOL, return_indices=True)
    return h.reshape(h.shape[0], -1), _ConvStashed(x, weight, z, indices)


def conv_backward(
    grad_out: torch.Tensor, stashed: _ConvStashed, conv: ConvShape, *, need_input: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dW, db, dx_flat)`` of one convolution layer from ``dL/d(output)``, in closed
    form (the pooling's gradient to its argmax, ReLU's mask, the convolution's two
    transposes): in float64 on a CPU, autograd's convolution backward is about ten
    times slower than ``conv2d_weight`` and ``conv2d_input``."""
    z = stashed.z
    oh, ow = conv.out_hw
    grad = grad_out.reshape(-1, conv.out_channels, oh, ow)
    if stashed.indices is not None:
        grad = functional.max_unpool2d(
            grad, stashed.indices, (POOL, POOL), output_size=z.shape[-2:]
        )
    grad = grad * (z > 0.0)
    dw = conv_grad.conv2d_weight(stashed.x_image, conv.weight_shape, grad, padding=PADDING)
    db = grad.sum(dim=(0, 2, 3))
    dx = None
    if need_input:
        dx = conv_grad.conv2d_input(
            stashed.x_image.shape, stashed.weight, grad, padding=PADDING
        ).reshape(grad.shape[0], -1)
    return dw, db, dx


class TorchCnnShard(TorchDeviceShard):
    """One device's layers of a partitioned CNN (see the module docstring)."""

    def __init__(
        self,
        topology: Topology,
        device: int,
        weights: Mapping[int, tuple[FloatArray, FloatArray]],
        *,
        cnn: CnnSpec,
        lr: float,
        record_grads: bool = False,
    ) -> None:
        if list(topology.alloc.layer_sizes) != cnn.layer_sizes:
            raise ConfigError(
                f"allocation of layers {list(topology.alloc.layer_sizes)} is not the CNN's "
                f"{cnn.layer_sizes}"
            )
        dense = {layer: wb for layer, wb in weights.items() if not cnn.is_conv(layer)}
        super().__init__(topology, device, dense, lr=lr, record_grads=record_grads)
        self.cnn = cnn
        convs = cnn.convs
        for layer, (w, b) in weights.items():
            if not cnn.is_conv(layer):
                continue
            sl = self.slices[layer]
            if sl.width != topology.alloc.layer_sizes[layer]:
                raise ConfigError(f"convolution layer {layer} must be owned whole, got {sl}")
            self.layers[str(layer)] = ConvLayer(
                torch.from_numpy(np.asarray(w, dtype=np.float64)),
                torch.from_numpy(np.asarray(b, dtype=np.float64)),
                convs[layer - 1],
            )
        self.conv_stash: dict[tuple[int, int], _ConvStashed] = {}

    @classmethod
    def factory(cls, cnn: CnnSpec) -> ShardFactory:
        """A :data:`~zpipe.lossy.shard.ShardFactory` for this network."""
        return partial(cls, cnn=cnn)

    def conv_module(self, layer: int) -> ConvLayer:
        module = self.layers[str(layer)]
        assert isinstance(module, ConvLayer)
        return module

    @property
    def weights(self) -> dict[int, tuple[FloatArray, FloatArray]]:
        """The latest weights (copies), convolution kernels included, by layer."""
        out = super().weights
        for layer, module in self.layers.items():
            if isinstance(module, ConvLayer):
                out[int(layer)] = (
                    module.weight.detach().numpy().copy(),
                    module.bias.detach().numpy().copy(),
                )
        return out

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
        if not self.cnn.is_conv(layer):
            return super().forward(data, layer, batch, got, x=x, train=train)
        topo = self.topology
        x_view = assemble_view(
            topo.alloc.layer_sizes[layer - 1],
            batch,
            [(s.start, s.stop, _tensor(got.get(src))) for src, s in topo.owners[layer - 1]],
        )
        module = self.conv_module(layer)
        # references, not copies: an update rebinds the parameters' data (out of place),
        # so the stash keeps the kernels this forward used (equation 3)
        weight, bias = module.weight.detach(), module.bias.detach()
        if train:
            h, stashed = conv_forward_stashed(x_view, weight, bias, module.conv)
            self.conv_stash[(data, layer)] = stashed
            self.arrived[(data, layer)] = arrived_senders(topo, layer, got)
        else:
            h = conv_forward(x_view, weight, bias, module.conv)
        out = h.numpy()
        # a convolution layer is never the output layer (the CNN ends in dense layers)
        direction = Direction.FORWARD if train else Direction.TEST_FORWARD
        return [Outgoing(dst, "F", layer, layer, direction, out) for dst in topo.receivers[layer]]

    def backward(
        self, data: int, layer: int, labels: IntArray, got: Partials
    ) -> tuple[list[Outgoing], float | None]:
        if not self.cnn.is_conv(layer):
            return super().backward(data, layer, labels, got)
        topo = self.topology
        sl = self.slices[layer]
        stashed = self.conv_stash.pop((data, layer))
        arrived = self.arrived.pop((data, layer), frozenset())
        grad_h = sum_partial_grads(
            (len(labels), sl.width),
            [_tensor(got.get(src)) for src, _ in topo.owners[layer + 1]],
        )
        module = self.conv_module(layer)
        # the input layer needs no gradient
        dw, db, dx = conv_backward(grad_h, stashed, module.conv, need_input=layer >= 2)
        if self.record_grads:
            self.grads[layer] = (dw.numpy().copy(), db.numpy().copy())
        out: list[Outgoing] = []
        if dx is not None:
            out = dense_gradient_partials(topo, layer, dx.numpy(), arrived)
        module.weight.data = module.weight.data - self.lr * dw
        module.bias.data = module.bias.data - self.lr * db
        return out, None

    def forget(self, data: int) -> None:
        super().forget(data)
        for key in [k for k in self.conv_stash if k[0] == data]:
            del self.conv_stash[key]
            self.arrived.pop(key, None)


class CnnReference(nn.Module):
    """The unpartitioned CNN: convolution layers, then dense layers (ReLU between,
    none at the output)."""

    def __init__(self, cnn: CnnSpec, params: Sequence[tuple[FloatArray, FloatArray]]) -> None:
        super().__init__()
        shapes = cnn.param_shapes()
        if len(params) != len(shapes):
            raise ConfigError(f"{len(params)} layers of weights for a CNN of {len(shapes)}")
        self.cnn = cnn
        self.convs = nn.ModuleList(
            ConvLayer(torch.from_numpy(np.asarray(w)), torch.from_numpy(np.asarray(b)), conv)
            for conv, (w, b) in zip(cnn.convs, params[: cnn.n_conv], strict=True)
        )
        self.dense = nn.ModuleList()
        for (w, b), (w_shape, _) in zip(params[cnn.n_conv :], shapes[cnn.n_conv :], strict=True):
            if tuple(np.shape(w)) != w_shape:
                raise ConfigError(f"dense weights of shape {np.shape(w)}, expected {w_shape}")
            linear = nn.Linear(w_shape[1], w_shape[0], dtype=DTYPE)
            linear.weight.data = torch.from_numpy(np.array(w, dtype=np.float64))
            linear.bias.data = torch.from_numpy(np.array(b, dtype=np.float64))
            self.dense.append(linear)

    def forward(self, x_flat: torch.Tensor) -> torch.Tensor:
        h = x_flat
        for conv in self.convs:
            h = conv(h)
        for k, linear in enumerate(self.dense):
            h = linear(h)
            if k < len(self.dense) - 1:
                h = torch.relu(h)
        return h

    def params(self) -> list[tuple[FloatArray, FloatArray]]:
        layers = [*self.convs, *self.dense]
        return [(m.weight.detach().numpy().copy(), m.bias.detach().numpy().copy()) for m in layers]


def cnn_predict(
    cnn: CnnSpec, params: Sequence[tuple[FloatArray, FloatArray]], x: FloatArray
) -> FloatArray:
    """Logits of the whole network with nothing lost."""
    model = CnnReference(cnn, params)
    with torch.no_grad():
        return model(torch.from_numpy(np.asarray(x, dtype=np.float64))).numpy()
