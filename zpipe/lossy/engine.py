"""A neuron-partitioned MLP whose devices exchange partials over lossy links.

:class:`PartitionedMLP` runs the passes of :mod:`zpipe.lossy.schedule` in
process: each pass runs on every device owning part of its layer, reads what
reached that device (an *inbox* keyed by mini-batch, pass, layer and
receiver), null-fills what did not, computes with one
:class:`~zpipe.lossy.shard.DeviceShard` per device (the passes a stage runs,
:mod:`zpipe.stage.executors.lossy_passes`) and posts its own results through a
:class:`LinkChannel`, which asks :func:`zpipe.lossy.links.deliver` whether
each message arrives.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from zpipe._errors import ConfigError
from zpipe.lossy.links import (
    Direction,
    Recovery,
    Traffic,
    Transmit,
    deliver,
    deliver_over,
    seeded_link_loss,
)
from zpipe.lossy.partial import FloatArray
from zpipe.lossy.partition import Allocation
from zpipe.lossy.shard import (
    DeviceShard,
    Needed,
    Outgoing,
    Partials,
    PassRunner,
    ShardFactory,
    Topology,
    count_received,
)
from zpipe.transport.emulation import KeyedLoss

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
    The simulation asks the seeded decision itself; a stage passes its emulated
    links' ``transmit`` (given :meth:`keyed_loss`), and the links decide.
    """

    prr: FloatArray
    seed: int
    recovery: Recovery = field(default_factory=Recovery)
    lossless: bool = False
    traffic: dict[str, Traffic] = field(default_factory=lambda: defaultdict(Traffic))

    def send(
        self,
        src: int,
        dst: int,
        layer: int,
        step: int,
        direction: Direction,
        *,
        transmit: Transmit | None = None,
    ) -> bool:
        """Whether the message arrives, counting what it cost; ``transmit``: the
        emulated links that carry (and drop) each copy, instead of the seeded
        decision asked here."""
        if src == dst:
            return True
        counter = self.traffic[_CATEGORY[direction]]
        if self.lossless:
            counter.messages += 1
            counter.delivered += 1
            counter.data_tx += 1
            return True
        if transmit is None:
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
        else:
            d = deliver_over(transmit, src, dst, layer, step, direction, recovery=self.recovery)
        counter.add(d)
        return d.delivered

    def keyed_loss(self) -> KeyedLoss:
        """The keyed loss decision this channel's links are emulated with."""
        return seeded_link_loss(self.seed, self.prr)

    def would_deliver(
        self, src: int, dst: int, layer: int, step: int, direction: Direction
    ) -> bool:
        """The decision :meth:`send` makes, without counting it: what a receiver
        that shares the seed computes to know which partials will never come."""
        if src == dst or self.lossless:
            return True
        return deliver(
            self.seed,
            src,
            dst,
            layer,
            step,
            direction,
            prr=float(self.prr[src, dst]),
            prr_back=float(self.prr[dst, src]),
            recovery=self.recovery,
        ).delivered


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
#: senders whose partial reached a receiver, by (data, kind, key layer, receiver)
Arrivals = dict[tuple[int, str, int, int], tuple[int, ...]]

PASS_KINDS = {"F": "forward", "S": "share", "B": "backward"}


def record_arrival(
    propagation: Propagation,
    arrivals: Arrivals | None,
    data: int,
    device: int,
    needed: Needed,
    got: Partials,
) -> None:
    """Count what one receiver needed and got (and, if kept, which senders)."""
    propagation.record(
        PASS_KINDS[needed.kind], len(needed.senders), count_received(got, needed.senders)
    )
    if arrivals is not None:
        arrivals[(data, needed.kind, needed.key_layer, device)] = tuple(
            sorted(src for src, _ in needed.senders if src in got)
        )


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
        record_arrivals: bool = False,
        shard_factory: ShardFactory = DeviceShard,
        weight_shapes: Sequence[tuple[int, ...]] | None = None,
    ) -> None:
        if len(params) != alloc.n_layers - 1:
            raise ConfigError(
                f"{len(params)} dense layers for an allocation of {alloc.n_layers} layers"
            )
        for k, (w, _) in enumerate(params):
            # a CNN's convolution kernels are not (out, in): the caller names their shapes
            want = (
                (alloc.layer_sizes[k + 1], alloc.layer_sizes[k])
                if weight_shapes is None
                else tuple(weight_shapes[k])
            )
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
        self.topology = Topology(alloc)
        self.owners = self.topology.owners
        self.receivers = self.topology.receivers
        self.shards: dict[int, PassRunner] = {
            device: shard_factory(
                self.topology,
                device,
                shard_params(self.topology, params, device),
                lr=lr,
                record_grads=record_grads,
            )
            for device in sorted(set(alloc.device_of))
        }
        self.inbox: Inbox = defaultdict(dict)
        self.propagation = Propagation()
        self.record_grads = record_grads
        # Which senders reached each receiver, kept only when asked (to compare runs).
        self.arrivals: Arrivals | None = {} if record_arrivals else None
        #: devices whose receptions are not counted: a device that died during a run
        #: took its counts with it (zpipe.lossy.death_sim)
        self.unrecorded: set[int] = set()
        #: each output owner's loss in the latest output-layer backward pass
        self.last_losses: dict[int, float] = {}

    @property
    def weights(self) -> dict[tuple[int, int], tuple[FloatArray, FloatArray]]:
        """The latest slices by ``(layer, device)``."""
        return {
            (layer, device): wb
            for device, shard in self.shards.items()
            for layer, wb in shard.weights.items()
        }

    @property
    def stash(self) -> dict[tuple[int, int, int], Any]:
        """What forward passes kept for their backward, by ``(data, layer, device)``."""
        return {
            (data, layer, device): entry
            for device, shard in self.shards.items()
            for (data, layer), entry in shard.stash.items()
        }

    @property
    def grads(self) -> dict[tuple[int, int], tuple[FloatArray, FloatArray]]:
        """The latest ``(dW, db)`` per ``(layer, device)`` (with ``record_grads``)."""
        return {
            (layer, device): g
            for device, shard in self.shards.items()
            for layer, g in shard.grads.items()
        }

    # -- passes ---------------------------------------------------------------

    def forward(self, data: int, layer: int, x: FloatArray) -> None:
        """Forward pass of ``layer`` for mini-batch ``data`` whose inputs are ``x``
        (only the input layer reads them; later layers only need the batch size)."""
        self._forward(self.inbox, data, layer, x, train=True)

    def backward(
        self, data: int, layer: int, labels: IntArray, *, lr_scale: float = 1.0
    ) -> float | None:
        """Backward pass of ``layer`` for mini-batch ``data``; updates the slices.

        Returns the mean training loss over the output owners' views when
        ``layer`` is the output layer. ``lr_scale`` scales this pass's step
        (GPipe: a micro-batch's share of its mini-batch's rows).
        """
        needed = self.topology.needed("B", layer)
        assert needed is not None
        losses: list[float] = []
        self.last_losses = {}
        for device, _ in self.owners[layer]:
            got = self.inbox.get((data, needed.kind, needed.key_layer, device), {})
            if device not in self.unrecorded:
                record_arrival(self.propagation, self.arrivals, data, device, needed, got)
            shard = self.shards[device]
            shard.lr = self.lr * lr_scale
            try:
                outgoing, loss = shard.backward(data, layer, labels, got)
            finally:
                shard.lr = self.lr
            if loss is not None:
                losses.append(loss)
                self.last_losses[device] = loss
            self._post(self.inbox, data, device, outgoing)
        for device in {d for d, _ in self.owners[layer]}:
            self.inbox.pop((data, needed.kind, needed.key_layer, device), None)
        return float(np.mean(losses)) if losses else None

    def predict_views(self, x: FloatArray, step: int) -> list[FloatArray]:
        """A lossy inference pass: each output owner's view of the logits."""
        inbox: Inbox = defaultdict(dict)
        for layer in range(self.n_layers):
            self._forward(inbox, step, layer, x, train=False)
        last = self.n_layers - 1
        return [
            self.shards[device].logits_view(len(x), inbox.get((step, "S", last, device), {}))
            for device, _ in self.owners[last]
        ]

    def full_params(self) -> list[tuple[FloatArray, FloatArray]]:
        """The slices stitched back into whole ``(W, b)`` per layer."""
        return stitch_params(self.topology, self.weights)

    def clear(self, data: int) -> None:
        """Forget whatever is still held for mini-batch ``data``."""
        for key in [k for k in self.inbox if k[0] == data]:
            del self.inbox[key]
        for shard in self.shards.values():
            shard.forget(data)

    # -- internals --------------------------------------------------------------

    def _forward(self, inbox: Inbox, data: int, layer: int, x: FloatArray, *, train: bool) -> None:
        needed = self.topology.needed("F", layer, test=not train)
        for device, _ in self.owners[layer]:
            got: Partials = {}
            if needed is not None:
                got = inbox.get((data, needed.kind, needed.key_layer, device), {})
                if train and device not in self.unrecorded:
                    record_arrival(self.propagation, self.arrivals, data, device, needed, got)
            outgoing = self.shards[device].forward(data, layer, len(x), got, x=x, train=train)
            self._post(inbox, data, device, outgoing)
        if layer >= 1:
            for device in self.receivers[layer - 1]:
                inbox.pop((data, "F", layer - 1, device), None)

    def _post(self, inbox: Inbox, data: int, device: int, outgoing: Sequence[Outgoing]) -> None:
        for msg in outgoing:
            if self.channel.send(device, msg.dst, msg.layer, data, msg.direction):
                inbox[(data, msg.kind, msg.key_layer, msg.dst)][device] = msg.values


def shard_params(
    topology: Topology, params: Sequence[tuple[FloatArray, FloatArray]], device: int
) -> dict[int, tuple[FloatArray, FloatArray]]:
    """``device``'s rows of each dense layer it owns part of, by layer."""
    out = {}
    for layer in range(1, topology.n_layers):
        sl = topology.slice_of(layer, device)
        if sl is not None:
            w, b = params[layer - 1]
            if sl.width == topology.alloc.layer_sizes[layer]:  # whole (a CNN's kernels too)
                out[layer] = (w.copy(), b.copy())
            else:
                out[layer] = (w[sl.start : sl.stop].copy(), b[sl.start : sl.stop].copy())
    return out


def stitch_params(
    topology: Topology, weights: Mapping[tuple[int, int], tuple[FloatArray, FloatArray]]
) -> list[tuple[FloatArray, FloatArray]]:
    """Slices by ``(layer, device)`` stitched back into whole ``(W, b)`` per layer."""
    out = []
    for layer in range(1, topology.n_layers):
        parts = [weights[(layer, d)] for d, _ in topology.owners[layer]]
        out.append((np.vstack([p[0] for p in parts]), np.concatenate([p[1] for p in parts])))
    return out
