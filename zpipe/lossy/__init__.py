"""Lossy links: EdgePipe's super-neuron partitioning, mapping, radio model,
timeslot pipeline and a fast in-process simulation of lossy training.

Modules, one job each (all pure, no I/O except :mod:`.experiment`):

- :mod:`.partition`  Algorithm 1: who owns which (layer, neuron range)
- :mod:`.mapping`    Algorithm 2: super neurons onto devices by link quality
- :mod:`.radio`      device placement, path loss, packet reception ratios
- :mod:`.links`      the per-message drop decision and recovery schemes
- :mod:`.schedule`   equation 2's timeslot pipeline, Theorem 1, timeslot length
- :mod:`.partial`    neuron-sliced dense layers and the reference MLP
- :mod:`.cnn`        Fig. 10(c)'s CNN: convolution layers whole, the dense head partitioned
- :mod:`.engine`     devices exchanging partials, null-filling what is lost
- :mod:`.simulate`   one seeded training run
- :mod:`.data`       local data sets (digits, IDX files)
- :mod:`.experiment` the command line: runs, sweeps, JSON and plots
- :mod:`.plots`      Fig. 5 and Fig. 9 style PNGs (matplotlib, optional)

Across real processes (none re-exported here: the wire pulls in torch for the codec):

- :mod:`.shard`        one device's slices and passes (the engine runs one per device)
- :mod:`.torch_partial` the same passes on partial layers as torch modules (what stages run)
- :mod:`.torch_cnn`    the CNN's whole convolution layers beside torch dense slices
- :mod:`.trace`        what a run did, message by message; the in-process reference
- :mod:`.linkmodes`    how receivers wait for partials (emulated, deadline)
- :mod:`.wire`         run specs and array conversion for the stages (the message
                       kinds are in :mod:`zpipe.protocol.lossy`)
- :mod:`.device_run`   one run's state on a stage, built from its ``lossy_setup``
- :mod:`.pass_control` a stage's pass schedule as a controller: waiting, null-filling,
                       dead peers and remap holds, decided on events (sans-IO)
- :mod:`.remap`        a dead device's super neurons onto the survivors (``on_death="remap"``)
- :mod:`.death_sim`    a run in which a device dies, simulated (null-filled or remapped)
- :mod:`.on_stages`    ``python -m zpipe lossy --coordinator EP`` (or ``--multiprocess``,
                       a local cluster): runs on ordinary stages
                       (:mod:`zpipe.coordinator.runs.lossy`, :mod:`zpipe.stage.executors.lossy`,
                       :mod:`zpipe.client.runs.lossy`)
"""

from __future__ import annotations

from zpipe.lossy.engine import LinkChannel, PartitionedMLP, Propagation
from zpipe.lossy.links import Delivery, Direction, Recovery, Traffic, deliver, drop_uniform
from zpipe.lossy.mapping import (
    connectivity,
    map_devices,
    map_exhaustive,
    map_genetic,
    map_random,
    mapping_score,
    pass_counts,
)
from zpipe.lossy.partition import (
    ALLOCATION_KINDS,
    Allocation,
    NeuronSlice,
    SuperNeuron,
    hybrid_max_layers,
    partition,
    partition_horizontal,
    partition_hybrid,
    partition_layers,
    partition_naive,
    partition_vertical,
)
from zpipe.lossy.radio import LinkTopology, RadioModel, make_topology
from zpipe.lossy.schedule import (
    device_schedule,
    pipeline_period,
    theorem1_timeslots,
    timeslot_ms,
    total_timeslots,
)
from zpipe.lossy.simulate import RunConfig, run_training

__all__ = [
    "ALLOCATION_KINDS",
    "Allocation",
    "Delivery",
    "Direction",
    "LinkChannel",
    "LinkTopology",
    "NeuronSlice",
    "PartitionedMLP",
    "Propagation",
    "RadioModel",
    "Recovery",
    "RunConfig",
    "SuperNeuron",
    "Traffic",
    "connectivity",
    "deliver",
    "device_schedule",
    "drop_uniform",
    "hybrid_max_layers",
    "make_topology",
    "map_devices",
    "map_exhaustive",
    "map_genetic",
    "map_random",
    "mapping_score",
    "partition",
    "partition_horizontal",
    "partition_hybrid",
    "partition_layers",
    "partition_naive",
    "partition_vertical",
    "pass_counts",
    "pipeline_period",
    "run_training",
    "theorem1_timeslots",
    "timeslot_ms",
    "total_timeslots",
]
