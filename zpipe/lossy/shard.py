"""One device's part of a partitioned MLP: its slices, its stash and its passes.

A :class:`DeviceShard` computes what one device computes in one pass from
the partials that reached it, and says what it sends to whom
(:class:`Outgoing`); it never decides delivery and never touches a socket.
The in-process engine (:mod:`zpipe.lossy.engine`) runs one shard per device
and carries the messages in dictionaries; a stage runs its own shard (the torch
twin, :class:`zpipe.lossy.torch_partial.TorchDeviceShard`) and carries them over
ZeroMQ (:mod:`zpipe.stage.executors.lossy_passes`). Sharing these passes is what makes the
two compute the same numbers.

A lost forward partial is null-filled, so the receiver's output did not depend
on the sender's values for that mini-batch: the gradient partial the receiver
sends back to that sender is zero (:func:`gradient_partials`). Sending it the
gradient taken at the null-filled zeros instead credits the sender's weights
with an output nobody used; in vertical allocations, where one lost message
blanks a whole layer, that spurious gradient never shrinks as training
converges and drove lossy runs to divergence.

Message keys: a partial is filed at its receiver under ``(data, kind, layer)``
where ``kind`` is ``"F"`` (forward input of layer ``layer + 1``), ``"S"``
(output-layer sharing) or ``"B"`` (the gradient of layer ``layer``'s outputs);
its drop decision is keyed by the *sender's* layer (:mod:`zpipe.lossy.links`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from zpipe.lossy.links import Direction
from zpipe.lossy.partial import (
    FloatArray,
    assemble,
    cross_entropy,
    output_delta,
    relu_grad,
    slice_backward,
    slice_forward,
    sum_partials,
)
from zpipe.lossy.partition import Allocation, NeuronSlice

IntArray = npt.NDArray[np.int64]
#: senders' partials that reached a receiver for one key, by sender device
Partials = Mapping[int, FloatArray]


@dataclass(frozen=True)
class Outgoing:
    """One message a pass sends: to ``dst``, filed there under ``(data, kind,
    key_layer)``, its drop decision keyed by the sending ``layer`` and ``direction``."""

    dst: int
    kind: str
    key_layer: int
    layer: int
    direction: Direction
    values: FloatArray


@dataclass(frozen=True)
class Needed:
    """The partials a pass waits for: filed under ``(data, kind, key_layer)``, one
    from each ``senders`` device, whose drop keys use ``layer`` and ``direction``."""

    kind: str
    key_layer: int
    layer: int
    direction: Direction
    senders: tuple[tuple[int, NeuronSlice], ...]


class Topology:
    """Who owns and who receives each layer: derived once from an allocation."""

    def __init__(self, alloc: Allocation) -> None:
        self.alloc = alloc
        self.n_layers = alloc.n_layers
        self.last = alloc.n_layers - 1
        self.owners: list[list[tuple[int, NeuronSlice]]] = [
            alloc.owners(layer) for layer in range(self.n_layers)
        ]
        self.receivers: list[list[int]] = [
            sorted({d for d, _ in self.owners[min(layer + 1, self.last)]})
            for layer in range(self.n_layers)
        ]

    def slice_of(self, layer: int, device: int) -> NeuronSlice | None:
        for d, sl in self.owners[layer]:
            if d == device:
                return sl
        return None

    def needed(self, kind: str, layer: int, *, test: bool = False) -> Needed | None:
        """What pass ``kind`` (``"F"``/``"B"``) of ``layer`` waits for (``None``: nothing)."""
        if kind == "F":
            if layer == 0:
                return None
            direction = Direction.TEST_FORWARD if test else Direction.FORWARD
            return Needed("F", layer - 1, layer - 1, direction, tuple(self.owners[layer - 1]))
        if layer == self.last:
            direction = Direction.TEST_SHARE if test else Direction.SHARE
            return Needed("S", self.last, self.last, direction, tuple(self.owners[self.last]))
        return Needed("B", layer, layer + 1, Direction.BACKWARD, tuple(self.owners[layer + 1]))


class PassRunner(Protocol):
    """What the engine and a stage need of one device's shard: :class:`DeviceShard`
    (numpy) or :class:`zpipe.lossy.torch_partial.TorchDeviceShard` (torch modules)."""

    slices: dict[int, NeuronSlice]
    grads: dict[int, tuple[FloatArray, FloatArray]]
    #: the step size the next backward pass applies
    lr: float

    @property
    def stash(self) -> Mapping[tuple[int, int], Any]: ...

    @property
    def weights(self) -> Mapping[int, tuple[FloatArray, FloatArray]]: ...

    def forward(
        self,
        data: int,
        layer: int,
        batch: int,
        got: Partials,
        *,
        x: FloatArray | None = None,
        train: bool = True,
    ) -> list[Outgoing]: ...

    def backward(
        self, data: int, layer: int, labels: IntArray, got: Partials
    ) -> tuple[list[Outgoing], float | None]: ...

    def logits_view(self, batch: int, got: Partials) -> FloatArray: ...

    def forget(self, data: int) -> None: ...


#: builds one device's shard: ``(topology, device, weights, lr=, record_grads=)``
ShardFactory = Callable[..., PassRunner]


class DeviceShard:
    """The weight slices of one device and the passes it runs on them.

    Weights follow EdgePipe's equation 3: a forward pass uses the latest
    weights and stashes them with its input view; the matching backward pass
    computes its gradient with the stashed ones and applies it to the latest.
    """

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
        self.weights: dict[int, tuple[FloatArray, FloatArray]] = {
            layer: (w.copy(), b.copy()) for layer, (w, b) in weights.items()
        }
        self.stash: dict[tuple[int, int], tuple[FloatArray, FloatArray, FloatArray]] = {}
        #: senders whose forward partial arrived, by (data, layer): who gets a gradient
        self.arrived: dict[tuple[int, int], frozenset[int]] = {}
        self.record_grads = record_grads
        self.grads: dict[int, tuple[FloatArray, FloatArray]] = {}

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
        """Forward pass of ``layer`` for mini-batch ``data``.

        ``got`` holds the previous layer's slices that arrived; the input layer
        reads ``x`` (the whole input, or at least this device's columns of it).
        """
        topo = self.topology
        sl = self.slices[layer]
        if layer == 0:
            if x is None:
                raise ValueError("the input layer's forward pass needs x")
            out = x[:, sl.start : sl.stop]
        else:
            x_view, _ = assemble(
                topo.alloc.layer_sizes[layer - 1],
                batch,
                [(s.start, s.stop, got.get(src)) for src, s in topo.owners[layer - 1]],
            )
            w, b = self.weights[layer]
            z, out = slice_forward(x_view, w, b, relu=layer < topo.last)
            if train:
                self.stash[(data, layer)] = (x_view, w, z)
                self.arrived[(data, layer)] = arrived_senders(topo, layer, got)
        if layer < topo.last:
            kind = "F"
            direction = Direction.FORWARD if train else Direction.TEST_FORWARD
        else:
            kind = "S"
            direction = Direction.SHARE if train else Direction.TEST_SHARE
        return [Outgoing(dst, kind, layer, layer, direction, out) for dst in topo.receivers[layer]]

    def logits_view(self, batch: int, got: Partials) -> FloatArray:
        """This output owner's view of all logits from the shared slices."""
        topo = self.topology
        logits, _ = assemble(
            topo.alloc.layer_sizes[topo.last],
            batch,
            [(s.start, s.stop, got.get(src)) for src, s in topo.owners[topo.last]],
        )
        return logits

    def backward(
        self, data: int, layer: int, labels: IntArray, got: Partials
    ) -> tuple[list[Outgoing], float | None]:
        """Backward pass of ``layer`` for mini-batch ``data``; updates this slice.

        ``got`` holds the shared logits (output layer) or the next layer's
        partial gradients that arrived. Returns the messages and, at the output
        layer, this device's training loss.
        """
        topo = self.topology
        sl = self.slices[layer]
        batch = len(labels)
        x_view, w_used, z = self.stash.pop((data, layer))
        arrived = self.arrived.pop((data, layer), frozenset())
        loss: float | None = None
        if layer == topo.last:
            logits = self.logits_view(batch, got)
            loss = cross_entropy(logits, labels)
            delta = output_delta(logits, labels, sl.start, sl.stop)
        else:
            dh = sum_partials(
                (batch, sl.width), [got.get(src) for src, _ in topo.owners[layer + 1]]
            )
            delta = relu_grad(dh, z)
        dw, db, dx = slice_backward(delta, x_view, w_used)
        if self.record_grads:
            self.grads[layer] = (dw, db)
        out: list[Outgoing] = []
        if layer >= 2:  # the input layer needs no gradient
            out = gradient_partials(topo, layer, dx, arrived)
        w, b = self.weights[layer]
        self.weights[layer] = (w - self.lr * dw, b - self.lr * db)
        return out, loss

    def forget(self, data: int) -> None:
        for key in [k for k in self.stash if k[0] == data]:
            del self.stash[key]
            self.arrived.pop(key, None)


def arrived_senders(topology: Topology, layer: int, got: Partials) -> frozenset[int]:
    """The owners of ``layer - 1`` whose forward partial reached this pass."""
    return frozenset(src for src, _ in topology.owners[layer - 1] if src in got)


def gradient_partials(
    topology: Topology, layer: int, dx: FloatArray, arrived: frozenset[int]
) -> list[Outgoing]:
    """The backward messages of ``layer`` (``>= 2``): each owner of ``layer - 1``
    gets its columns of ``dL/dx``, or zeros when its forward partial was lost
    (the null-filled input did not depend on it)."""
    return [
        Outgoing(
            dst,
            "B",
            layer - 1,
            layer,
            Direction.BACKWARD,
            dx[:, dst_sl.start : dst_sl.stop]
            if dst in arrived
            else np.zeros((dx.shape[0], dst_sl.width)),
        )
        for dst, dst_sl in topology.owners[layer - 1]
    ]


def count_received(got: Partials, senders: Sequence[tuple[int, NeuronSlice]]) -> int:
    """Senders whose partial arrived (a device's own always has)."""
    return sum(1 for src, _ in senders if src in got)
