"""What one training run did, message by message: the record two runs are compared on.

A :class:`TrainingTrace` holds each mini-batch's loss, the final weights, the
propagation counts, the traffic per pass category and which senders reached
each receiver for every pass. :func:`train_in_process` plays a
:class:`~zpipe.lossy.simulate.PreparedRun` on the in-process engine;
:func:`trace_from_results` builds the same record from the stages' results
(:mod:`zpipe.client.runs.lossy`), so "the multi-process run equals the
simulation" is a comparison of two traces.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from zpipe._errors import ConfigError, ProtocolError
from zpipe.lossy.cnn import CnnSpec, part_shapes
from zpipe.lossy.data import Dataset
from zpipe.lossy.engine import Arrivals, LinkChannel, PartitionedMLP, Propagation, stitch_params
from zpipe.lossy.evaluation import EvalSpec, Predictions, accuracy, eval_steps, simulate_predictions
from zpipe.lossy.links import Traffic
from zpipe.lossy.partial import FloatArray
from zpipe.lossy.schedule import events
from zpipe.lossy.shard import DeviceShard, ShardFactory, Topology
from zpipe.lossy.simulate import PreparedRun, cnn_spec, partitioned_model
from zpipe.lossy.wire import to_array
from zpipe.protocol.lossy import LossyResult, LossyTestSummary


@dataclass
class TrainingTrace:
    """One run's outcome; see the module docstring."""

    #: mean training loss over the output owners' views, by data id (1-based)
    losses: dict[int, float]
    params: list[tuple[FloatArray, FloatArray]]
    propagation: Propagation
    traffic: dict[str, Traffic]
    arrivals: Arrivals = field(default_factory=dict)

    def test_accuracy(self, data: Dataset, cnn: CnnSpec | None = None) -> float:
        """Accuracy of the final weights on the test set, nothing lost (``cnn``: the
        weights are that CNN's)."""
        if cnn is not None:
            from zpipe.lossy.torch_cnn import cnn_predict

            logits = cnn_predict(cnn, self.params, data.x_test)
            return float(np.mean(logits.argmax(axis=1) == data.y_test))
        h = data.x_test
        for k, (w, b) in enumerate(self.params):
            h = h @ w.T + b
            if k < len(self.params) - 1:
                h = np.maximum(h, 0.0)
        return float(np.mean(h.argmax(axis=1) == data.y_test))

    def summary(self) -> dict[str, Any]:
        """JSON-ready numbers (weights and arrivals left out)."""
        losses = [self.losses[k] for k in sorted(self.losses)]
        return {
            "n_data": len(losses),
            "final_train_loss": losses[-1] if losses else float("nan"),
            "losses": losses,
            **self.propagation.as_dict(),
            "traffic": {k: v.as_dict() for k, v in sorted(self.traffic.items())},
        }


def same_run(a: TrainingTrace, b: TrainingTrace, *, rtol: float = 1e-12) -> bool:
    """Whether two traces dropped the same messages and ended with the same
    losses and weights (to ``rtol``: processes may sum in another order)."""
    if a.arrivals != b.arrivals or a.losses.keys() != b.losses.keys():
        return False
    if {k: v.as_dict() for k, v in a.traffic.items()} != {
        k: v.as_dict() for k, v in b.traffic.items()
    }:
        return False
    if not np.allclose(list(a.losses.values()), list(b.losses.values()), rtol=rtol, atol=0.0):
        return False
    return all(
        np.allclose(wa, wb, rtol=rtol, atol=1e-14) and np.allclose(ba, bb, rtol=rtol, atol=1e-14)
        for (wa, ba), (wb, bb) in zip(a.params, b.params, strict=True)
    )


@dataclass
class EvalTrace:
    """What a run's test passes under loss did: each output owner's predictions by
    test step (owner order) and their traffic."""

    spec: EvalSpec
    predictions: Predictions
    traffic: Traffic
    #: passes (any device's) that ran with a partial missing; None if not counted
    null_filled: int | None = None

    def accuracy(self, y_test: np.ndarray) -> float:
        return accuracy(self.predictions, self.spec, y_test)

    def same_as(self, other: EvalTrace) -> bool:
        """The same test passes, drops and predictions."""
        return (
            self.spec == other.spec
            and self.traffic.as_dict() == other.traffic.as_dict()
            and self.predictions.keys() == other.predictions.keys()
            and all(
                len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
                for a, b in ((self.predictions[k], other.predictions[k]) for k in self.predictions)
            )
        )


def evaluate_in_process(
    prepared: PreparedRun,
    params: list[tuple[FloatArray, FloatArray]],
    x_test: FloatArray,
    spec: EvalSpec,
    *,
    channel: LinkChannel | None = None,
    absent: Collection[int] = (),
) -> EvalTrace:
    """The test passes of weights ``params`` (a run's final ones) on ``prepared``'s
    links, as the in-process simulation runs them (``channel``: those links, if not
    the run's own; ``absent``: devices whose predictions are left out)."""
    if channel is None:
        channel = LinkChannel(
            prr=prepared.topology.prr,
            seed=prepared.config.seed,
            recovery=prepared.config.recovery,
            lossless=prepared.lossless,
        )
    cnn = None
    if prepared.config.model == "cnn":
        cnn = cnn_spec(prepared.config, prepared.layer_sizes)
    predictions = simulate_predictions(
        prepared.alloc, params, channel, x_test, spec, cnn=cnn, absent=absent
    )
    return EvalTrace(spec, predictions, channel.traffic.get("test", Traffic()))


def evaluation_from_results(topo: Topology, spec: EvalSpec, bodies: Mapping[int, Any]) -> EvalTrace:
    """The test passes of a run on stages from each device's ``lossy_result`` ``test``
    map; :class:`ProtocolError` if one does not fit."""
    by_owner: dict[int, dict[int, np.ndarray]] = {}
    traffic: list[dict[str, dict[str, int]]] = []
    null_filled = 0
    steps = {t.step: t.rows for t in eval_steps(spec)}
    for d, value in bodies.items():
        try:
            summary = LossyTestSummary.from_map(value)
        except ProtocolError as exc:
            raise ProtocolError(f"lossy_result: malformed test of device {d}: {exc}") from None
        try:
            for step, classes in summary.predictions:
                if steps.get(step) != len(classes):
                    raise ProtocolError(f"lossy_result: device {d} predicted step {step} badly")
                by_owner.setdefault(d, {})[int(step)] = np.asarray(classes, dtype=np.int64)
            if summary.traffic:
                traffic.append({"test": summary.traffic})
            null_filled += summary.null_filled
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"lossy_result: malformed test of device {d}: {exc!r}") from None
    out_owners = [d for d, _ in topo.owners[topo.last] if d in by_owner]
    predictions = {
        step: [by_owner[d][step] for d in out_owners if step in by_owner[d]] for step in steps
    }
    merged = merge_traffic(traffic).get("test") if traffic else None
    return EvalTrace(spec, predictions, merged or Traffic(), null_filled)


def train_in_process(
    prepared: PreparedRun,
    data: Dataset,
    *,
    shard_factory: ShardFactory = DeviceShard,
    channel: LinkChannel | None = None,
) -> TrainingTrace:
    """Train ``prepared`` on the in-process engine, keeping the arrivals
    (``shard_factory``: numpy shards, or torch ones; ``channel``: the run's links, if
    not the plain ones, e.g. one that also counts each copy's fate)."""
    cfg = prepared.config
    if cfg.gpipe:
        raise ConfigError("GPipe runs are simulated only (zpipe.lossy.simulate.run_training)")
    if channel is None:
        channel = LinkChannel(
            prr=prepared.topology.prr,
            seed=cfg.seed,
            recovery=cfg.recovery,
            lossless=prepared.lossless,
        )
    if cfg.model == "cnn":  # torch layers, whole convolutions (its only shards)
        model = partitioned_model(prepared, data, channel, record_arrivals=True)
    else:
        model = PartitionedMLP(
            prepared.alloc,
            prepared.params,
            channel,
            lr=cfg.lr,
            record_arrivals=True,
            shard_factory=shard_factory,
        )
    losses: dict[int, float] = {}
    last = prepared.alloc.n_layers - 1
    for ev in events(prepared.alloc, prepared.n_data, period=prepared.period):
        x, y = prepared.batch(data, ev.data)
        if ev.kind == "F":
            model.forward(ev.data, ev.layer, x)
        else:
            loss = model.backward(ev.data, ev.layer, y)
            if ev.layer == last and loss is not None:
                losses[ev.data] = loss
    assert model.arrivals is not None
    return TrainingTrace(
        losses=losses,
        params=model.full_params(),
        propagation=model.propagation,
        traffic=dict(channel.traffic),
        arrivals=dict(model.arrivals),
    )


def trace_from_results(
    topo: Topology,
    results: Mapping[int, LossyResult],
    *,
    dead: Collection[int] = (),
    cnn: CnnSpec | None = None,
) -> TrainingTrace:
    """The trace of a run on stages, from each device's ``lossy_result``;
    :class:`ProtocolError` if a result does not fit the allocation.

    ``dead``: devices that died during the run and sent no result. Their slices come
    back as zeros, what the survivors computed with in their place (a null-filled
    hidden slice is ``relu(0) = 0``, a null-filled logit 0); a mini-batch's loss is
    the mean over the output owners that reported it. ``cnn``: the layers are that
    CNN's (whole convolution layers come back as their kernels)."""
    if set(dead) & results.keys():
        raise ProtocolError(f"lossy results from devices declared dead: {sorted(dead)}")
    weights: dict[tuple[int, int], tuple[FloatArray, FloatArray]] = {}
    sizes = topo.alloc.layer_sizes
    for d in dead:
        for layer in range(1, topo.n_layers):
            sl = topo.slice_of(layer, d)
            if sl is not None:
                w_shape, b_shape = part_shapes(cnn, sizes, layer, sl.width)
                weights[(layer, d)] = (np.zeros(w_shape), np.zeros(b_shape))
    loss_by: dict[int, dict[int, float]] = {}
    arrivals: Arrivals = {}
    for d, msg in results.items():
        layers = msg.layers
        if len(msg.tensors) != 2 * len(layers):
            raise ProtocolError(f"lossy_result from device {d}: tensors do not match layers")
        for k, layer in enumerate(layers):
            sl = topo.slice_of(layer, d)
            if sl is None:
                raise ProtocolError(f"lossy_result: device {d} owns no part of layer {layer}")
            try:
                w_shape, b_shape = part_shapes(cnn, sizes, layer, sl.width)
            except ConfigError as exc:
                raise ProtocolError(f"lossy_result from device {d}: {exc}") from None
            w = to_array(
                msg.tensors[2 * k], shape=w_shape, dtype=torch.float64, what=f"device {d} weights"
            )
            b = to_array(msg.tensors[2 * k + 1], shape=b_shape, dtype=torch.float64, what="bias")
            weights[(layer, d)] = (w.copy(), b.copy())
        for data_id, loss in msg.losses:
            loss_by.setdefault(int(data_id), {})[d] = float(loss)
        for data_id, kind, layer, senders in msg.arrivals:
            arrivals[(int(data_id), str(kind), int(layer), d)] = tuple(int(s) for s in senders)
    out_owners = [d for d, _ in topo.owners[topo.last]]
    try:
        losses = {data_id: mean_loss(by, out_owners) for data_id, by in sorted(loss_by.items())}
        params = stitch_params(topo, weights)
    except KeyError as exc:
        raise ProtocolError(f"lossy results lack {exc}") from None
    return TrainingTrace(
        losses=losses,
        params=params,
        propagation=merge_propagation([m.propagation for m in results.values()]),
        traffic=merge_traffic([m.traffic for m in results.values()]),
        arrivals=arrivals,
    )


def mean_loss(by_device: Mapping[int, float], order: Sequence[int]) -> float:
    """A mini-batch's loss: the mean of the views that reported it, in ``order`` (the
    output owners' neuron order, as the engine averages), any others after by index
    (a remapped run's earlier output owners)."""
    keys = [d for d in order if d in by_device]
    keys += sorted(d for d in by_device if d not in keys)
    return float(np.mean([by_device[d] for d in keys]))


def merge_propagation(parts: list[dict[str, dict[str, int]]]) -> Propagation:
    """Sum per-device propagation counts (``{"expected": {kind: n}, ...}``)."""
    out = Propagation()
    for part in parts:
        for name in ("expected", "received", "assemblies", "complete"):
            target: defaultdict[str, int] = getattr(out, name)
            for kind, n in part.get(name, {}).items():
                target[kind] += int(n)
    return out


def merge_traffic(parts: list[dict[str, dict[str, int]]]) -> dict[str, Traffic]:
    """Sum per-device traffic counters by pass category."""
    out: dict[str, Traffic] = defaultdict(Traffic)
    for part in parts:
        for category, counts in part.items():
            t = out[category]
            t.messages += int(counts["messages"])
            t.delivered += int(counts["delivered"])
            t.data_tx += int(counts["data_tx"])
            t.ack_tx += int(counts["ack_tx"])
    return dict(out)
