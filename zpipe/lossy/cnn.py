"""A CNN for lossy runs: convolution layers allocated layer-wise, a dense head of
super neurons (EdgePipe section IV, Fig. 10(c)).

The paper partitions the dense layers, which carry most of the compute of its
networks, into super neurons, and leaves convolution and pooling layers to "a
layerwise allocation": each convolution layer runs whole on one device. Fig.
10(c)'s network has three convolution layers (32, 64 and 64 filters of 3 x 3,
2 x 2 max-pooling with stride 2 after the second and third) and four dense
layers. Here a convolution layer keeps padding 1 so scikit-learn's 8 x 8
digits stay 8 x 8 until the pools (8 -> 4 -> 2)::

    layer   0        1          2            3            4    5    6    7
            input    conv 32    conv 64      conv 64      128  128  128  10
            1x8x8    32x8x8     64x8x8 ->    64x4x4 ->    dense head
                                pool 64x4x4  pool 64x2x2

Every layer is a vector of "neurons" to the partition: a convolution layer's
are its (pooled) output values, flattened channel-first, so a layer's output
travels, is null-filled when lost and carries gradients exactly as a dense
layer's (:mod:`zpipe.lossy.shard`). :func:`partition_cnn` gives the input layer
and the convolution layers whole to ``conv_devices`` devices in contiguous
groups (a layer-wise pipeline, as :func:`~zpipe.lossy.partition.partition_vertical`
does when devices are short), and the dense layers to the other devices by
the named allocation (Algorithm 1). The allocation's ``layer_macs`` carries the
convolutions' real cost, which sizes the timeslot (:mod:`zpipe.lossy.schedule`).

Pure numpy here; the torch layers are in :mod:`zpipe.lossy.torch_cnn`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from zpipe._errors import ConfigError
from zpipe.lossy.partial import FloatArray
from zpipe.lossy.partition import (
    Allocation,
    NeuronSlice,
    SuperNeuron,
    partition,
)

#: Fig. 10(c): filters of the three convolution layers
PAPER_CHANNELS: tuple[int, ...] = (32, 64, 64)
KERNEL = 3
PADDING = 1
POOL = 2
#: the CNN's kinds of dense-head allocation (naive: the whole network on one device)
CNN_ALLOCATIONS = ("naive", "vertical", "hybrid", "horizontal")


@dataclass(frozen=True)
class ConvShape:
    """One convolution layer: ``in_channels`` -> ``out_channels`` on ``height x width``
    inputs (3 x 3, padding 1, stride 1), then ReLU and, if ``pool``, 2 x 2 max-pooling."""

    in_channels: int
    out_channels: int
    height: int
    width: int
    pool: bool

    @property
    def in_size(self) -> int:
        return self.in_channels * self.height * self.width

    @property
    def out_hw(self) -> tuple[int, int]:
        if self.pool:
            return self.height // POOL, self.width // POOL
        return self.height, self.width

    @property
    def out_size(self) -> int:
        h, w = self.out_hw
        return self.out_channels * h * w

    @property
    def macs(self) -> int:
        """Multiply-accumulates per example (the pooling's comparisons not counted)."""
        return self.out_channels * self.height * self.width * self.in_channels * KERNEL * KERNEL

    @property
    def weight_shape(self) -> tuple[int, int, int, int]:
        return (self.out_channels, self.in_channels, KERNEL, KERNEL)


@dataclass(frozen=True)
class CnnSpec:
    """The network: an image ``(channels, height, width)``, the convolution layers'
    filters (pooling after all but the first, as Fig. 10(c)), the hidden dense widths
    and the classes."""

    image: tuple[int, int, int]
    channels: tuple[int, ...] = PAPER_CHANNELS
    hidden: tuple[int, ...] = (128, 128, 128)
    n_classes: int = 10

    def __post_init__(self) -> None:
        if len(self.image) != 3 or any(n < 1 for n in self.image):
            raise ConfigError(f"an image is (channels, height, width) > 0, got {self.image}")
        if not self.channels or any(c < 1 for c in self.channels):
            raise ConfigError(f"a CNN needs at least one convolution layer, got {self.channels}")
        if any(h < 1 for h in self.hidden) or self.n_classes < 2:
            raise ConfigError(
                f"dense widths must be positive and classes >= 2, got {self.hidden}, "
                f"{self.n_classes}"
            )
        last = self.convs[-1]
        if min(last.out_hw) < 1:
            raise ConfigError(
                f"a {self.image[1]}x{self.image[2]} image is pooled away by "
                f"{len(self.channels)} convolution layers; use fewer"
            )

    @classmethod
    def for_features(
        cls,
        n_features: int,
        n_classes: int,
        *,
        channels: Sequence[int] = PAPER_CHANNELS,
        hidden: Sequence[int] = (128, 128, 128),
    ) -> CnnSpec:
        """A one-channel square image of ``n_features`` pixels (digits: 8 x 8);
        :class:`ConfigError` if the features are not a square image."""
        side = math.isqrt(n_features)
        if side * side != n_features:
            raise ConfigError(
                f"a CNN needs square one-channel images; {n_features} features are not "
                "(the generated data set is a feature vector, not an image)"
            )
        return cls((1, side, side), tuple(channels), tuple(hidden), n_classes)

    @property
    def convs(self) -> list[ConvShape]:
        out = []
        c, h, w = self.image
        for k, n in enumerate(self.channels):
            conv = ConvShape(c, n, h, w, pool=k >= 1)
            out.append(conv)
            c, (h, w) = n, conv.out_hw
        return out

    @property
    def n_conv(self) -> int:
        return len(self.channels)

    @property
    def layer_sizes(self) -> list[int]:
        """Neurons per layer: the input pixels, each convolution layer's output
        values, the dense widths."""
        c, h, w = self.image
        return [c * h * w, *(conv.out_size for conv in self.convs), *self.hidden, self.n_classes]

    @property
    def layer_macs(self) -> list[int]:
        sizes = self.layer_sizes
        convs = [conv.macs for conv in self.convs]
        dense = [sizes[k - 1] * sizes[k] for k in range(self.n_conv + 1, len(sizes))]
        return [0, *convs, *dense]

    def is_conv(self, layer: int) -> bool:
        return 1 <= layer <= self.n_conv

    def param_shapes(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """``(W shape, b shape)`` of layers 1..L-1: ``(out, in, 3, 3)`` for a
        convolution layer, ``(out, in)`` for a dense one."""
        sizes = self.layer_sizes
        out: list[tuple[tuple[int, ...], tuple[int, ...]]] = [
            (conv.weight_shape, (conv.out_channels,)) for conv in self.convs
        ]
        out += [((sizes[k], sizes[k - 1]), (sizes[k],)) for k in range(self.n_conv + 1, len(sizes))]
        return out

    @property
    def n_parameters(self) -> int:
        return sum(math.prod(w) + math.prod(b) for w, b in self.param_shapes())

    def init_params(self, *, seed: int) -> list[tuple[FloatArray, FloatArray]]:
        """He-initialised ``(W, b)`` of every layer after the input, seeded (as
        :func:`zpipe.lossy.partial.init_mlp`)."""
        rng = np.random.default_rng(seed)
        params = []
        for w_shape, b_shape in self.param_shapes():
            fan_in = math.prod(w_shape[1:])
            params.append((rng.normal(0.0, np.sqrt(2.0 / fan_in), size=w_shape), np.zeros(b_shape)))
        return params

    def to_dict(self) -> dict[str, list[int] | int]:
        return {
            "image": list(self.image),
            "channels": list(self.channels),
            "hidden": list(self.hidden),
            "n_classes": self.n_classes,
        }


def part_shapes(
    cnn: CnnSpec | None, layer_sizes: Sequence[int], layer: int, width: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ``(W, b)`` shapes of a device's ``width`` neurons of ``layer`` (>= 1): rows of
    a dense layer, or a whole convolution layer's kernels (``cnn``: None for an MLP);
    :class:`ConfigError` for a convolution layer cut into slices."""
    if cnn is None or not cnn.is_conv(layer):
        return (width, layer_sizes[layer - 1]), (width,)
    if width != layer_sizes[layer]:
        raise ConfigError(f"convolution layer {layer} must be owned whole, got {width} neurons")
    conv = cnn.convs[layer - 1]
    return conv.weight_shape, (conv.out_channels,)


def default_conv_devices(n_conv: int, n_devices: int) -> int:
    """One device per convolution layer while the dense head keeps four devices (the
    fewest with which its hybrid allocation is not horizontal's): 6 devices give
    the convolutions 2, 8 give 3; with fewer than 6, one."""
    return max(1, min(n_conv, n_devices - 4))


def _contiguous_groups(n_conv: int, n_groups: int) -> list[tuple[int, ...]]:
    """Convolution layers 1..n_conv in ``n_groups`` contiguous runs, sizes differing by at
    most one, the longer ones at the output end."""
    base, extra = divmod(n_conv, n_groups)
    lengths = [base + (1 if w >= n_groups - extra else 0) for w in range(n_groups)]
    out, start = [], 1
    for n in lengths:
        out.append(tuple(range(start, start + n)))
        start += n
    return out


def partition_cnn(kind: str, spec: CnnSpec, n_devices: int, *, conv_devices: int = 0) -> Allocation:
    """The input and convolution layers whole on ``conv_devices`` devices (0: as
    :func:`default_conv_devices`), in contiguous groups from the output end; the
    dense layers on the other devices by allocation ``kind`` (Algorithm 1).

    ``naive`` puts the whole network on one device.
    """
    if kind not in CNN_ALLOCATIONS:
        raise ConfigError(
            f"unknown allocation {kind!r}; choose one of {', '.join(CNN_ALLOCATIONS)}"
        )
    sizes = spec.layer_sizes
    macs = tuple(spec.layer_macs)
    if kind == "naive":
        alloc = partition("naive", sizes, 1)
        return Allocation(
            alloc.kind, alloc.layer_sizes, alloc.groups, alloc.super_neurons, (), macs
        )
    n_conv = spec.n_conv
    conv_devices = conv_devices or default_conv_devices(n_conv, n_devices)
    if not 1 <= conv_devices <= n_conv or n_devices - conv_devices < 1:
        raise ConfigError(
            f"conv_devices must be in [1, {n_conv}] and leave the dense layers a device "
            f"of {n_devices}, got {conv_devices}"
        )
    # layer-wise: whole layers, contiguous; the input stays with the first convolution
    # (the image never crosses a link) and spare layers go to the output end
    front_groups = _contiguous_groups(n_conv, conv_devices)
    front_groups[0] = (0, *front_groups[0])
    super_neurons = [
        SuperNeuron(
            group=w, slot=0, slices=tuple(NeuronSlice(layer, 0, sizes[layer]) for layer in g)
        )
        for w, g in enumerate(front_groups)
    ]
    head = partition(kind, sizes[n_conv + 1 :], n_devices - conv_devices)
    shift = n_conv + 1
    groups = [*front_groups, *(tuple(layer + shift for layer in g) for g in head.groups)]
    n_front_groups = len(front_groups)
    for sn in head.super_neurons:
        super_neurons.append(
            SuperNeuron(
                group=sn.group + n_front_groups,
                slot=sn.slot,
                slices=tuple(NeuronSlice(s.layer + shift, s.start, s.stop) for s in sn.slices),
            )
        )
    return Allocation(
        kind=f"cnn_{kind}",
        layer_sizes=tuple(sizes),
        groups=tuple(groups),
        super_neurons=tuple(super_neurons),
        layer_macs=macs,
    )
