"""A lossy run in which a device dies, simulated in process: "device ``d`` dies
during the run; its partials are null-filled, or from mini-batch ``k`` on its super
neurons run on the survivors" (:mod:`zpipe.lossy.remap`).

What a run on stages does when a stage is killed (:mod:`zpipe.coordinator.runs.lossy`,
``on_death``), played pass by pass so that the two compare as traces
(:func:`zpipe.lossy.trace.same_run`):

- before its death the device computes and sends as usual. Which of its partials
  reached each survivor before it died is the one thing no simulation can know (a
  kill cuts each outgoing stream at its own point), so it is a parameter:
  ``heard[r]``, the index (in the run's pass list) of the last of the dead device's
  passes whose partial survivor ``r`` used. Later ones never arrive; earlier ones
  arrive as the seeded loss decides. :func:`heard_from_arrivals` reads it off a
  run's arrivals;
- its own counts (traffic, receptions, losses) and weights die with it;
- ``switch_at = None``: the survivors null-fill its partials to the end, and its
  slices come back as zeros (what the survivors computed with in their place);
- ``switch_at = k``: the passes of mini-batches before ``k`` finish on the old
  allocation (null-filling the dead device), then mini-batches ``k..n`` run the
  pipeline of ``alloc_after`` from its first timeslot, the survivors with their
  trained slices and the taken-over neurons from the dead device's replica
  (``replica_step``: its slices right after its last pass of that mini-batch) or at
  their run-start values;
- the test passes after a null-filled death (:func:`evaluate_with_death`) run without
  the dead device: it sends nothing and predicts nothing (after a remap they run on
  the new allocation; :func:`evaluate_after` picks the one a death asks).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from zpipe._errors import ConfigError
from zpipe.lossy.data import Dataset
from zpipe.lossy.engine import LinkChannel, PartitionedMLP, Propagation
from zpipe.lossy.evaluation import EvalSpec
from zpipe.lossy.links import Direction, Transmit
from zpipe.lossy.partial import FloatArray
from zpipe.lossy.partition import Allocation
from zpipe.lossy.schedule import PassEvent, events
from zpipe.lossy.shard import DeviceShard, ShardFactory, Topology
from zpipe.lossy.simulate import PreparedRun
from zpipe.lossy.trace import (
    EvalTrace,
    TrainingTrace,
    evaluate_in_process,
    mean_loss,
    merge_propagation,
)


@dataclass(frozen=True)
class DeviceDeath:
    """One device's death during a run (see the module docstring)."""

    device: int
    #: survivor -> index in ``events(alloc, n_data)`` of the dead device's last pass
    #: whose partial it used (-1: none)
    heard: Mapping[int, int]
    #: the first mini-batch of the remapped allocation (None: null-filled to the end)
    switch_at: int | None = None
    alloc_after: Allocation | None = None
    #: the mini-batch of the dead device's replica its neurons resume from (None: the
    #: run's start): its slices right after its last pass of that mini-batch
    replica_step: int | None = None

    def __post_init__(self) -> None:
        if (self.switch_at is None) != (self.alloc_after is None):
            raise ConfigError("a remap needs both switch_at and alloc_after")
        if self.replica_step is not None and self.switch_at is None:
            raise ConfigError("a replica serves only a remap")


@dataclass
class _CutChannel(LinkChannel):
    """The run's links, with a dead device's sends cut per receiver after ``heard``.
    Its sends are not counted: its counters died with it."""

    dead: int = -1
    heard: Mapping[int, int] = field(default_factory=dict)
    event_index: int = 0

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
        if src != self.dead or dst == src:
            return super().send(src, dst, layer, step, direction, transmit=transmit)
        if self.event_index > self.heard.get(dst, -1):
            return False
        return self.would_deliver(src, dst, layer, step, direction)


def pass_index(alloc: Allocation, n_data: int) -> dict[tuple[str, int, int], int]:
    """``(kind, layer, data)`` -> the pass's index in ``events(alloc, n_data)``."""
    return {(ev.kind, ev.layer, ev.data): i for i, ev in enumerate(events(alloc, n_data))}


def heard_from_arrivals(
    alloc: Allocation,
    n_data: int,
    dead: int,
    arrivals: Mapping[tuple[int, str, int, int], tuple[int, ...]],
) -> dict[int, int]:
    """Per survivor, the index of the dead device's last pass whose partial it used, by
    a run's arrivals (``(data, kind, key_layer, receiver) -> senders``)."""
    index = pass_index(alloc, n_data)
    last = alloc.n_layers - 1
    heard: dict[int, int] = {}
    for (data, kind, key_layer, receiver), senders in arrivals.items():
        if dead not in senders or receiver == dead:
            continue
        sent_by = {"F": ("F", key_layer), "S": ("F", last), "B": ("B", key_layer + 1)}.get(kind)
        i = None if sent_by is None else index.get((*sent_by, data))
        if i is not None:
            heard[receiver] = max(heard.get(receiver, -1), i)
    return heard


def train_with_death(
    prepared: PreparedRun,
    data: Dataset,
    death: DeviceDeath,
    *,
    shard_factory: ShardFactory = DeviceShard,
) -> TrainingTrace:
    """Train ``prepared`` with ``death`` (see the module docstring)."""
    cfg = prepared.config
    if cfg.gpipe:
        raise ConfigError("GPipe runs are simulated only (zpipe.lossy.simulate.run_training)")
    alloc, n = prepared.alloc, prepared.n_data
    d = death.device
    if d not in alloc.device_of:
        raise ConfigError(f"device {d} runs no part of this allocation")
    channel = _CutChannel(
        prr=prepared.topology.prr,
        seed=cfg.seed,
        recovery=cfg.recovery,
        lossless=prepared.lossless,
        dead=d,
        heard=dict(death.heard),
    )
    model = PartitionedMLP(
        alloc,
        prepared.params,
        channel,
        lr=cfg.lr,
        record_arrivals=True,
        shard_factory=shard_factory,
    )
    model.unrecorded = {d}
    end = n if death.switch_at is None else death.switch_at - 1
    # each mini-batch's loss by output owner: averaged at the end as a run on stages
    # averages its survivors' views (zpipe.lossy.trace.trace_from_results)
    losses: dict[int, dict[int, float]] = {}
    topo = Topology(alloc)
    dense = [layer for layer in range(1, alloc.n_layers) if topo.slice_of(layer, d) is not None]
    replica_at = (
        None if death.replica_step is None or not dense else ("B", min(dense), death.replica_step)
    )
    replica: dict[int, tuple[np.ndarray, np.ndarray]] | None = None
    for i, ev in enumerate(events(alloc, n, period=prepared.period)):
        channel.event_index = i
        if ev.data <= end:
            _play(model, prepared, data, ev, ev.data, losses, dead={d})
            if (ev.kind, ev.layer, ev.data) == replica_at:
                replica = {k: (w.copy(), b.copy()) for k, (w, b) in model.shards[d].weights.items()}
    assert model.arrivals is not None
    arrivals = dict(model.arrivals)
    propagation = [model.propagation]
    if death.switch_at is None or death.alloc_after is None:
        weights = dict(model.weights)
        for layer in range(1, alloc.n_layers):
            sl = topo.slice_of(layer, d)
            if sl is not None:
                w, b = weights[(layer, d)]
                weights[(layer, d)] = (np.zeros_like(w), np.zeros_like(b))
        final_topo = topo
        params = [
            (
                np.vstack([weights[(layer, o)][0] for o, _ in topo.owners[layer]]),
                np.concatenate([weights[(layer, o)][1] for o, _ in topo.owners[layer]]),
            )
            for layer in range(1, alloc.n_layers)
        ]
    else:
        after = death.alloc_after
        if death.replica_step is not None and replica is None:
            raise ConfigError(f"device {d} ran no last pass of mini-batch {death.replica_step}")
        params = _params_after_switch(model, topo, prepared, d, replica)
        later = PartitionedMLP(
            after, params, channel, lr=cfg.lr, record_arrivals=True, shard_factory=shard_factory
        )
        first = death.switch_at
        for ev in events(after, n - first + 1):
            _play(later, prepared, data, ev, ev.data + first - 1, losses, dead=set())
        assert later.arrivals is not None
        arrivals.update(later.arrivals)
        propagation.append(later.propagation)
        final_topo = Topology(after)
        params = later.full_params()
    order = [o for o, _ in final_topo.owners[final_topo.last]]
    return TrainingTrace(
        losses={k: mean_loss(v, order) for k, v in sorted(losses.items())},
        params=params,
        propagation=_merge(propagation),
        traffic=dict(channel.traffic),
        arrivals=arrivals,
    )


def evaluate_with_death(
    prepared: PreparedRun,
    params: list[tuple[FloatArray, FloatArray]],
    x_test: FloatArray,
    spec: EvalSpec,
    device: int,
) -> EvalTrace:
    """The test passes after training of a run whose ``device`` died and was null-filled
    to the end (``switch_at = None``), on its final weights ``params``: the device
    sends nothing (its partials are null-filled, its sends not counted) and predicts
    nothing; the survivors still count what they send it, as on stages."""
    if device not in prepared.alloc.device_of:
        raise ConfigError(f"device {device} runs no part of this allocation")
    cfg = prepared.config
    cut = _CutChannel(
        prr=prepared.topology.prr,
        seed=cfg.seed,
        recovery=cfg.recovery,
        lossless=prepared.lossless,
        dead=device,
    )  # heard nothing: every send of the dead device is cut
    return evaluate_in_process(prepared, params, x_test, spec, channel=cut, absent={device})


def evaluate_after(
    prepared: PreparedRun,
    params: list[tuple[FloatArray, FloatArray]],
    x_test: FloatArray,
    spec: EvalSpec,
    death: DeviceDeath | None,
) -> EvalTrace:
    """The test passes after training on the final weights ``params`` of a run with
    ``death`` (None: nobody died): on the run's allocation, without a null-filled dead
    device (:func:`evaluate_with_death`), or on the allocation a remap switched to."""
    if death is None:
        return evaluate_in_process(prepared, params, x_test, spec)
    if death.alloc_after is None:
        return evaluate_with_death(prepared, params, x_test, spec, death.device)
    return evaluate_in_process(
        replace(prepared, alloc=death.alloc_after, period=0), params, x_test, spec
    )


def _play(
    model: PartitionedMLP,
    prepared: PreparedRun,
    data: Dataset,
    ev: PassEvent,
    data_id: int,
    losses: dict[int, dict[int, float]],
    *,
    dead: set[int],
) -> None:
    x, y = prepared.batch(data, data_id)
    if ev.kind == "F":
        model.forward(data_id, ev.layer, x)
        return
    model.backward(data_id, ev.layer, y)
    if ev.layer == model.n_layers - 1:
        views = {o: loss for o, loss in model.last_losses.items() if o not in dead}
        if views:
            losses[data_id] = views


def _params_after_switch(
    model: PartitionedMLP,
    topo: Topology,
    prepared: PreparedRun,
    dead: int,
    replica: dict[int, tuple[np.ndarray, np.ndarray]] | None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The whole network at the switch: the survivors' trained slices, the dead
    device's rows from its replica, or at their run-start values (:mod:`zpipe.lossy.remap`)."""
    out = []
    for (w, b), (w0, b0), layer in zip(
        model.full_params(), prepared.params, range(1, topo.n_layers), strict=True
    ):
        w, b = w.copy(), b.copy()
        sl = topo.slice_of(layer, dead)
        if sl is not None and replica is not None:
            w[sl.start : sl.stop], b[sl.start : sl.stop] = replica[layer]
        elif sl is not None:
            w[sl.start : sl.stop] = w0[sl.start : sl.stop]
            b[sl.start : sl.stop] = b0[sl.start : sl.stop]
        out.append((w, b))
    return out


def _merge(parts: list[Propagation]) -> Propagation:
    return merge_propagation(
        [
            {
                "expected": dict(p.expected),
                "received": dict(p.received),
                "assemblies": dict(p.assemblies),
                "complete": dict(p.complete),
            }
            for p in parts
        ]
    )
