"""One lossy run's state on a stage, built from its ``lossy_setup``, and the shape
check of every partial it may receive (pure: no sockets).

A test pass's partials (:mod:`zpipe.lossy.evaluation`) travel as kinds ``"TF"`` and
``"TS"`` keyed by their test step, so they never meet a training pass's ``"F"`` and
``"S"`` partials of the same id in the inbox
(:class:`zpipe.lossy.pass_control.PassControl` files them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from zpipe._errors import ConfigError, ProtocolError
from zpipe.lossy.cnn import part_shapes
from zpipe.lossy.engine import Arrivals, LinkChannel, Propagation
from zpipe.lossy.evaluation import EvalStep, eval_steps
from zpipe.lossy.partial import FloatArray
from zpipe.lossy.partition import Allocation, NeuronSlice
from zpipe.lossy.shard import DeviceShard, PassRunner, ShardFactory, Topology
from zpipe.lossy.wire import RunSpec, peers_from_body, to_array
from zpipe.protocol.lossy import LossyRemap, LossySetup


@dataclass
class DeviceRun:
    """One run's state on this device."""

    run: int
    spec: RunSpec
    topo: Topology
    shard: PassRunner
    channel: LinkChannel
    peers: dict[int, str]
    inputs: FloatArray | None
    labels: np.ndarray | None
    propagation: Propagation = field(default_factory=Propagation)
    arrivals: Arrivals = field(default_factory=dict)
    losses: list[list[float]] = field(default_factory=list)
    waits: list[list[Any]] = field(default_factory=list)
    #: partials that came after their pass ran (null-filled instead)
    late: int = 0
    start_at: float = 0.0
    #: input owners: the rows of the test passes (``spec.test``)
    x_test: FloatArray | None = None
    #: the test passes by step, and what they did on this device
    tests: dict[int, EvalStep] = field(default_factory=dict)
    #: output owners: this view's predicted classes by test step
    predictions: dict[int, list[int]] = field(default_factory=dict)
    test_arrivals: Arrivals = field(default_factory=dict)
    #: test passes that ran with partials missing
    test_null_filled: int = 0
    #: send the coordinator a replica of the slices every this many mini-batches
    replica_every: int | None = None


#: the wire kind of a test pass's partial, by the training kind it mirrors
TEST_KINDS = {"F": "TF", "S": "TS"}


@dataclass(frozen=True)
class Switch:
    """A remap this device makes once its passes before ``first`` are done
    (:mod:`zpipe.lossy.remap`): the new allocation, the rows it takes over
    ``(layer, start, stop, W, b)``, and the inputs, test inputs or labels it now needs."""

    first: int
    alloc: Allocation
    topo: Topology
    pieces: tuple[tuple[int, int, int, FloatArray, FloatArray], ...]
    inputs: FloatArray | None = None
    x_test: FloatArray | None = None
    labels: np.ndarray | None = None

    def slices(self, device: int) -> dict[int, NeuronSlice]:
        return {
            layer: sl
            for layer in range(self.topo.n_layers)
            if (sl := self.topo.slice_of(layer, device)) is not None
        }


def build_switch(msg: LossyRemap, st: DeviceRun, index: int) -> Switch | None:
    """The switch a ``lossy_remap`` asks of device ``index`` (None: no remap);
    :class:`ProtocolError` if it does not fit the run."""
    if msg.switch_at is None:
        return None
    if msg.alloc is None or not 1 <= msg.switch_at <= st.spec.n_data:
        raise ProtocolError(f"lossy_remap: switch at {msg.switch_at} without an allocation")
    try:
        alloc = Allocation.from_dict(msg.alloc)
    except ConfigError as exc:
        raise ProtocolError(f"lossy_remap: {exc}") from None
    if alloc.layer_sizes != st.spec.alloc.layer_sizes or index not in alloc.device_of:
        raise ProtocolError("lossy_remap: the allocation does not fit this run or device")
    topo = Topology(alloc)
    sizes = alloc.layer_sizes
    tensors = list(msg.tensors)
    pieces = []
    for entry in msg.pieces or []:
        if not (isinstance(entry, list) and len(entry) == 3):
            raise ProtocolError("lossy_remap: pieces must be [layer, start, stop] with W and b")
        layer, start, stop = (int(v) for v in entry)
        if not (1 <= layer < len(sizes) and 0 <= start < stop <= sizes[layer]):
            raise ProtocolError(f"lossy_remap: bad piece {entry!r}")
        w = to_array(
            _next(tensors),
            shape=(stop - start, sizes[layer - 1]),
            dtype=torch.float64,
            what="taken-over weights",
        )
        b = to_array(_next(tensors), shape=(stop - start,), dtype=torch.float64, what="bias")
        pieces.append((layer, start, stop, w, b))
    inputs = x_test = labels = None
    if msg.inputs:
        inputs = to_array(
            _next(tensors),
            dtype=torch.float64,
            what="inputs",
            shape=(st.spec.n_data, st.spec.batch, sizes[0]),
        )
        if st.spec.test is not None:
            x_test = to_array(
                _next(tensors),
                dtype=torch.float64,
                shape=(st.spec.test.n_test, sizes[0]),
                what="test inputs",
            )
    if msg.labels:
        labels = to_array(
            _next(tensors), dtype=torch.int64, what="labels", shape=(st.spec.n_data, st.spec.batch)
        )
    if tensors:
        raise ProtocolError(f"lossy_remap: {len(tensors)} tensors too many")
    return Switch(msg.switch_at, alloc, topo, tuple(pieces), inputs, x_test, labels)


def build_run(
    msg: LossySetup, index: int, *, shard_factory: ShardFactory = DeviceShard
) -> DeviceRun:
    """One run's state on device ``index`` from its ``lossy_setup``: its slices' weights,
    the inputs and labels it owns, its peers; :class:`ProtocolError` if it does not fit.
    ``shard_factory``: torch shards (stages) or numpy ones."""
    if msg.device != index:
        raise ProtocolError(f"lossy_setup for device {msg.device} reached {index}")
    spec = RunSpec.from_body(msg.spec)
    topo = Topology(spec.alloc)
    sizes = spec.alloc.layer_sizes
    layers = msg.layers
    mine = {layer for layer in range(1, topo.n_layers) if topo.slice_of(layer, index) is not None}
    if sorted(layers) != sorted(mine):
        raise ProtocolError(f"lossy_setup: weights for layers {layers}, device owns {mine}")
    testing = spec.test is not None
    n_tensors = 2 * len(layers) + int(msg.inputs) * (1 + int(testing)) + int(msg.labels)
    if len(msg.tensors) != n_tensors:
        raise ProtocolError(f"lossy_setup: {len(msg.tensors)} tensors, expected {n_tensors}")
    weights = {}
    for k, layer in enumerate(layers):
        sl = topo.slice_of(layer, index)
        assert sl is not None
        w_shape, b_shape = _param_shapes(spec, layer, sl.width)
        w = to_array(
            msg.tensors[2 * k],
            shape=w_shape,
            dtype=torch.float64,
            what=f"weights of layer {layer}",
        )
        b = to_array(
            msg.tensors[2 * k + 1],
            shape=b_shape,
            dtype=torch.float64,
            what=f"bias of layer {layer}",
        )
        weights[layer] = (w, b)
    if spec.cnn is not None:  # whole convolution layers beside the dense slices
        from zpipe.lossy.torch_cnn import TorchCnnShard

        shard_factory = TorchCnnShard.factory(spec.cnn)
    rest = list(msg.tensors[2 * len(layers) :])
    inputs = labels = None
    if msg.inputs:
        inputs = to_array(
            rest.pop(0),
            shape=(spec.n_data, spec.batch, sizes[0]),
            dtype=torch.float64,
            what="inputs",
        )
    x_test = None
    if msg.inputs and spec.test is not None:
        x_test = to_array(
            rest.pop(0),
            shape=(spec.test.n_test, sizes[0]),
            dtype=torch.float64,
            what="test inputs",
        )
    if msg.labels:
        labels = to_array(
            rest.pop(0), shape=(spec.n_data, spec.batch), dtype=torch.int64, what="labels"
        )
    every = msg.replica_every
    if every is not None and (isinstance(every, bool) or every < 1):
        raise ProtocolError(f"lossy_setup: replica_every must be positive, got {every!r}")
    if (topo.slice_of(0, index) is not None) != (inputs is not None):
        raise ProtocolError("lossy_setup: inputs go to (and only to) input-layer owners")
    if (topo.slice_of(topo.last, index) is not None) != (labels is not None):
        raise ProtocolError("lossy_setup: labels go to (and only to) output-layer owners")
    return DeviceRun(
        run=msg.run,
        spec=spec,
        topo=topo,
        shard=shard_factory(topo, index, weights, lr=spec.lr),
        channel=LinkChannel(
            prr=spec.prr, seed=spec.seed, recovery=spec.recovery, lossless=spec.lossless
        ),
        peers=peers_from_body(msg.peers, "lossy_setup"),
        inputs=inputs,
        labels=labels,
        x_test=x_test,
        tests={t.step: t for t in eval_steps(spec.test)} if spec.test is not None else {},
        replica_every=every,
    )


def _param_shapes(spec: RunSpec, layer: int, width: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    try:
        return part_shapes(spec.cnn, spec.alloc.layer_sizes, layer, width)
    except ConfigError as exc:
        raise ProtocolError(f"lossy_setup: {exc}") from None


def _next(tensors: list[torch.Tensor]) -> torch.Tensor:
    if not tensors:
        raise ProtocolError("lossy_remap: fewer tensors than its fields announce")
    return tensors.pop(0)


def partial_shape(
    st: DeviceRun,
    index: int,
    data: int,
    kind: str,
    layer: int,
    src: int,
    *,
    switch: Switch | None = None,
) -> tuple[int, int]:
    """The shape a partial must have; :class:`ProtocolError` if this device
    could never need it (``switch``: under the allocation a remap switches to)."""
    topo, mine = st.topo, st.shard.slices
    if switch is not None:
        topo, mine = switch.topo, switch.slices(index)
    rows = st.spec.batch
    if kind in ("TF", "TS"):
        test = st.tests.get(data)
        if test is None:
            raise ProtocolError(f"lossy_partial: {data} is not a test step of this run")
        kind, rows = kind[1], test.rows
    elif not 1 <= data <= st.spec.n_data:
        raise ProtocolError(f"lossy_partial: data id {data} outside 1..{st.spec.n_data}")
    if not 0 <= layer < topo.n_layers:
        raise ProtocolError(f"lossy_partial: no layer {layer}")
    receiving = {"F": layer + 1, "S": layer, "B": layer}.get(kind)
    sending = {"F": layer, "S": layer, "B": layer + 1}.get(kind)
    if receiving is None or sending is None:
        raise ProtocolError(f"lossy_partial: unknown pass kind {kind!r}")
    if kind == "S" and layer != topo.last:
        raise ProtocolError("lossy_partial: sharing is of the output layer only")
    if kind == "B" and layer < 1:
        raise ProtocolError("lossy_partial: the input layer takes no gradient")
    if receiving not in mine or sending >= topo.n_layers:
        raise ProtocolError(f"lossy_partial: device {index} owns no part of layer {receiving}")
    src_slice = topo.slice_of(sending, src)
    if src_slice is None:
        raise ProtocolError(f"lossy_partial: device {src} owns no part of layer {sending}")
    width = mine[layer].width if kind == "B" else src_slice.width
    return (rows, width)
