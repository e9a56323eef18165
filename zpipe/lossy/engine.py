"""A neuron-partitioned MLP whose devices exchange partials over lossy links.

:class:`PartitionedMLP` runs the passes of :mod:`zpipe.lossy.schedule` in
process: each pass runs on every device owning part of its layer, reads what
reached that device (an *inbox* keyed by mini-batch, pass, layer and
receiver), null-fills what did not, computes with :mod:`zpipe.lossy.partial`
and posts its own results through a :class:`LinkChannel`, which asks
:func:`zpipe.lossy.links.deliver` whether each message arrives.

Messages, one per (sender, receiver) pair and pass (a device sends its slice
once to each device that needs it; a device never sends to itself):

- forward of layer ``l``: the sender's slice of ``h_l`` to each owner of
  layer ``l + 1`` (layer 0's slice is the raw input the device holds);
- forward of the output layer: the sender's logits slice to the other output
  owners (*sharing*; softmax needs all logits);
- backward of layer ``l >= 2``: the sender's partial ``dL/dh_{l-1}``,
  restricted to the receiver's neurons, to each owner of layer ``l - 1``.

Weights follow equation 3: a forward pass uses the device's latest weights;
the matching backward pass uses the weights and input view stashed at that
forward pass (so its gradient is that of ``W[i - (P - w + 1)]``) and applies
the step to the latest weights.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from zpipe._errors import ConfigError
from zpipe.lossy.links import Direction, Recovery, Traffic, deliver
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

_CATEGORY = {
    Direction.FORWARD: "forward",
    Direction.BACKWARD: "backward",
    Direction.SHARE: "share",
    Direction.TEST_FORWARD: "test",
    Direction.TEST_SHARE: "test",
}


@dataclass
class LinkChannel:
    """Decides delivery per message and counts the traffic, by pass category.

    ``prr[a, b]`` is the reception ratio from physical device ``a`` to ``b``;
    ``lossless`` delivers everything (still counting one transmission each).
    """

    prr: FloatArray
    seed: int
    recovery: Recovery = field(default_factory=Recovery)
    lossless: bool = False
    traffic: dict[str, Traffic] = field(default_factory=lambda: defaultdict(Traffic))

    def send(self, src: int, dst: int, layer: int, step: int, direction: Direction) -> bool:
        if src == dst:
            return True
        counter = self.traffic[_CATEGORY[direction]]
        if self.lossless:
            counter.messages += 1
            counter.delivered += 1
            counter.data_tx += 1
            return True
        d = deliver(
            self.seed,
            src,
            dst,
            layer,
            step,
            direction,
            prr=float(self.prr[src, dst]),
            prr_back=float(self.prr[dst, src]),
            recovery=self.recovery,
        )
        counter.add(d)
        return d.delivered


@dataclass
class Propagation:
    """Partials a receiver needed and got (its own count as got), per pass kind."""

    expected: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    received: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    assemblies: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    complete: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def record(self, kind: str, expected: int, received: int) -> None:
        self.expected[kind] += expected
        self.received[kind] += received
        self.assemblies[kind] += 1
        self.complete[kind] += int(received == expected)

    def rate(self, *kinds: str) -> float:
        exp = sum(self.expected[k] for k in kinds)
        return sum(self.received[k] for k in kinds) / exp if exp else 1.0

    def complete_rate(self, *kinds: str) -> float:
        n = sum(self.assemblies[k] for k in kinds)
        return sum(self.complete[k] for k in kinds) / n if n else 1.0

    def as_dict(self) -> dict[str, float]:
        return {
            "propagation_rate": self.rate("forward", "backward"),
            "forward_rate": self.rate("forward"),
            "backward_rate": self.rate("backward"),
            "share_rate": self.rate("share"),
            "complete_rate": self.complete_rate("forward", "backward"),
        }


Inbox = dict[tuple[int, str, int, int], dict[int, FloatArray]]


class PartitionedMLP:
    """The devices of one allocation, their weight slices and their inboxes."""

    def __init__(
        self,
        alloc: Allocation,
        params: Sequence[tuple[FloatArray, FloatArray]],
        channel: LinkChannel,
        *,
        lr: float,
        record_grads: bool = False,
    ) -> None:
        if len(params) != alloc.n_layers - 1:
            raise ConfigError(
                f"{len(params)} dense layers for an allocation of {alloc.n_layers} layers"
            )
        for k, (w, _) in enumerate(params):
            want = (alloc.layer_sizes[k + 1], alloc.layer_sizes[k])
            if w.shape != want:
                raise ConfigError(f"layer {k + 2} weights have shape {w.shape}, expected {want}")
        if channel.prr.shape[0] <= max(alloc.device_of):
            raise ConfigError(
                f"link matrix covers {channel.prr.shape[0]} devices; the allocation uses "
                f"device {max(alloc.device_of)}"
            )
        self.alloc = alloc
        self.channel = channel
        self.lr = lr
        self.n_layers = alloc.n_layers
        self.owners: list[list[tuple[int, NeuronSlice]]] = [
            alloc.owners(layer) for layer in range(self.n_layers)
        ]
        last = self.n_layers - 1
        self.receivers: list[list[int]] = [
            sorted({d for d, _ in self.owners[min(layer + 1, last)]})
            for layer in range(self.n_layers)
        ]
        self.weights: dict[tuple[int, int], tuple[FloatArray, FloatArray]] = {}
        for layer in range(1, self.n_layers):
            w, b = params[layer - 1]
            for device, sl in self.owners[layer]:
                self.weights[(layer, device)] = (
                    w[sl.start : sl.stop].copy(),
                    b[sl.start : sl.stop].copy(),
                )
        self.inbox: Inbox = defaultdict(dict)
        self.stash: dict[tuple[int, int, int], tuple[FloatArray, FloatArray, FloatArray]] = {}
        self.propagation = Propagation()
        # The latest (dW, db) per (layer, device), kept only when asked (tests).
        self.record_grads = record_grads
        self.grads: dict[tuple[int, int], tuple[FloatArray, FloatArray]] = {}

    # -- passes ---------------------------------------------------------------

    def forward(self, data: int, layer: int, x: FloatArray) -> None:
        """Forward pass of ``layer`` for mini-batch ``data`` whose inputs are ``x``
        (only the input layer reads them; later layers only need the batch size)."""
        self._forward(self.inbox, data, layer, x, Direction.FORWARD, Direction.SHARE, train=True)

    def backward(self, data: int, layer: int, labels: IntArray) -> float | None:
        """Backward pass of ``layer`` for mini-batch ``data``; updates the slices.

        Returns the mean training loss over the output owners' views when
        ``layer`` is the output layer.
        """
        last = self.n_layers - 1
        batch = len(labels)
        losses: list[float] = []
        for device, sl in self.owners[layer]:
            x_view, w_used, z = self.stash.pop((data, layer, device))
            if layer == last:
                got = self.inbox.get((data, "S", layer, device), {})
                logits, _ = assemble(
                    self.alloc.layer_sizes[last],
                    batch,
                    [(s.start, s.stop, got.get(src)) for src, s in self.owners[last]],
                )
                self.propagation.record(
                    "share", len(self.owners[last]), _count(got, self.owners[last])
                )
                losses.append(cross_entropy(logits, labels))
                delta = output_delta(logits, labels, sl.start, sl.stop)
            else:
                got = self.inbox.get((data, "B", layer, device), {})
                senders = self.owners[layer + 1]
                dh = sum_partials((batch, sl.width), [got.get(src) for src, _ in senders])
                self.propagation.record("backward", len(senders), _count(got, senders))
                delta = relu_grad(dh, z)
            dw, db, dx = slice_backward(delta, x_view, w_used)
            if self.record_grads:
                self.grads[(layer, device)] = (dw, db)
            if layer >= 2:  # the input layer needs no gradient
                for dst, dst_sl in self.owners[layer - 1]:
                    if self.channel.send(device, dst, layer, data, Direction.BACKWARD):
                        self.inbox[(data, "B", layer - 1, dst)][device] = dx[
                            :, dst_sl.start : dst_sl.stop
                        ]
            w, b = self.weights[(layer, device)]
            self.weights[(layer, device)] = (w - self.lr * dw, b - self.lr * db)
        for device in {d for d, _ in self.owners[layer]}:
            self.inbox.pop((data, "S" if layer == last else "B", layer, device), None)
        return float(np.mean(losses)) if losses else None

    def predict_views(self, x: FloatArray, step: int) -> list[FloatArray]:
        """A lossy inference pass: each output owner's view of the logits."""
        inbox: Inbox = defaultdict(dict)
        for layer in range(self.n_layers):
            self._forward(
                inbox,
                step,
                layer,
                x,
                Direction.TEST_FORWARD,
                Direction.TEST_SHARE,
                train=False,
            )
        last = self.n_layers - 1
        views = []
        for device, _ in self.owners[last]:
            got = inbox.get((step, "S", last, device), {})
            logits, _ = assemble(
                self.alloc.layer_sizes[last],
                len(x),
                [(s.start, s.stop, got.get(src)) for src, s in self.owners[last]],
            )
            views.append(logits)
        return views

    def full_params(self) -> list[tuple[FloatArray, FloatArray]]:
        """The slices stitched back into whole ``(W, b)`` per layer."""
        out = []
        for layer in range(1, self.n_layers):
            parts = [self.weights[(layer, d)] for d, _ in self.owners[layer]]
            out.append((np.vstack([p[0] for p in parts]), np.concatenate([p[1] for p in parts])))
        return out

    def clear(self, data: int) -> None:
        """Forget whatever is still held for mini-batch ``data``."""
        for key in [k for k in self.inbox if k[0] == data]:
            del self.inbox[key]
        for skey in [k for k in self.stash if k[0] == data]:
            del self.stash[skey]

    # -- internals --------------------------------------------------------------

    def _forward(
        self,
        inbox: Inbox,
        data: int,
        layer: int,
        x: FloatArray,
        direction: Direction,
        share_direction: Direction,
        *,
        train: bool,
    ) -> None:
        last = self.n_layers - 1
        for device, sl in self.owners[layer]:
            if layer == 0:
                out = x[:, sl.start : sl.stop]
            else:
                got = inbox.get((data, "F", layer - 1, device), {})
                senders = self.owners[layer - 1]
                x_view, _ = assemble(
                    self.alloc.layer_sizes[layer - 1],
                    len(x),
                    [(s.start, s.stop, got.get(src)) for src, s in senders],
                )
                if train:
                    self.propagation.record("forward", len(senders), _count(got, senders))
                w, b = self.weights[(layer, device)]
                z, out = slice_forward(x_view, w, b, relu=layer < last)
                if train:
                    self.stash[(data, layer, device)] = (x_view, w, z)
            if layer < last:
                for dst in self.receivers[layer]:
                    if self.channel.send(device, dst, layer, data, direction):
                        inbox[(data, "F", layer, dst)][device] = out
            else:
                for dst in self.receivers[layer]:
                    if self.channel.send(device, dst, layer, data, share_direction):
                        inbox[(data, "S", layer, dst)][device] = out
        if layer >= 1:
            for device in self.receivers[layer - 1]:
                inbox.pop((data, "F", layer - 1, device), None)


def _count(got: dict[int, FloatArray], senders: Sequence[tuple[int, NeuronSlice]]) -> int:
    return sum(1 for src, _ in senders if src in got)
