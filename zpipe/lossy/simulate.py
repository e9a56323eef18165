"""One lossy training run, simulated in process: the experiment's unit of work.

A run places devices (:mod:`zpipe.lossy.radio`), partitions the MLP
(:mod:`zpipe.lossy.partition`), maps super neurons to devices on the measured
reception ratios (:mod:`zpipe.lossy.mapping`), then plays the timeslot
pipeline (:mod:`zpipe.lossy.schedule`) pass by pass on a
:class:`~zpipe.lossy.engine.PartitionedMLP`, evaluating test accuracy (a
lossy inference pass, as the paper tests over the same links) at evenly
spaced times.

Everything a run draws comes from its ``seed``: placement and shadowing,
mapping search, weight initialisation, mini-batch order and message drops.
Runs of different allocations with the same seed therefore share devices,
links, initial weights and data order, so their differences are the
allocation's.

Training time is simulated: the sum of the timeslots' durations, each the
timeslot of :func:`zpipe.lossy.schedule.timeslot_ms` plus the airtime of the
extra copies and acknowledgements a recovery scheme sent in it
(:mod:`zpipe.lossy.airtime`). A run gets either a number of mini-batches or a
time budget, from which the number of mini-batches its pipeline finishes
follows (Table III's comparison at equal time): at equal time a scheme that
retransmits trains on fewer mini-batches. ``pipelined=False`` runs the same
allocation without pipelining (Fig. 7's *Model*: one mini-batch at a time);
``gpipe=True`` runs GPipe's micro-batch schedule with a flush per mini-batch
(Fig. 7's *GPipe*, :mod:`zpipe.lossy.gpipe`); ``max_layers`` partitions into
groups of exactly that many layers (Fig. 6's ``M_layers`` sweep).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from zpipe._errors import ConfigError
from zpipe.lossy.airtime import LinkCosts, SlotClock, data_within_budget, plan_clock
from zpipe.lossy.cnn import PAPER_CHANNELS, CnnSpec, partition_cnn
from zpipe.lossy.data import Dataset
from zpipe.lossy.engine import LinkChannel, PartitionedMLP
from zpipe.lossy.evaluation import EvalSpec, accuracy, lossy_predictions
from zpipe.lossy.gpipe import (
    gpipe_clock,
    gpipe_data_within,
    gpipe_period,
    gpipe_steps,
    gpipe_timeslot_ms,
    split_micro,
)
from zpipe.lossy.links import Recovery
from zpipe.lossy.mapping import connectivity, map_devices, mapping_score
from zpipe.lossy.partial import init_mlp
from zpipe.lossy.partition import ALLOCATION_KINDS, Allocation, partition, partition_layers
from zpipe.lossy.radio import LinkTopology, RadioModel, make_topology, mean_offdiagonal
from zpipe.lossy.schedule import events, pipeline_period, sequential_period, timeslot_ms

#: The most mini-batches a run may train (each keeps its rows until it starts, so
#: a typo'd budget or step count would otherwise allocate gigabytes).
MAX_DATA = 200_000
#: The most evaluation points along a run (each one is a full test pass).
MAX_EVAL_POINTS = 10_000
#: The most devices (the paper uses 2-10; the link model holds an n x n x 60 array).
MAX_DEVICES = 64
#: The most weights of the whole network (80 MB of float64).
MAX_PARAMETERS = 10_000_000
#: the networks a run can train
MODELS = ("mlp", "cnn")


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines one run (defaults: EdgePipe Table I)."""

    allocation: str = "hybrid"
    n_devices: int = 6
    region_m: float = 50.0
    seed: int = 0
    hidden: tuple[int, ...] = (128, 128, 128, 128)
    lr: float = 0.01
    batch_size: int = 100
    n_data: int | None = None
    budget_s: float | None = None
    lossless: bool = False
    recovery: Recovery = field(default_factory=Recovery)
    mapping: str = "genetic"
    radio: RadioModel = field(default_factory=RadioModel)
    eval_points: int = 20
    test_repeats: int = 5
    pipelined: bool = True
    #: lossy test passes averaged at each point of the curve (the final point
    #: takes ``test_repeats``)
    curve_test_repeats: int = 1
    #: GPipe's schedule: micro-batches pipelined, one synchronous update per mini-batch
    gpipe: bool = False
    #: GPipe's micro-batches per mini-batch (0: as many as devices, as the paper)
    microbatches: int = 0
    #: groups of exactly this many layers instead of the allocation's own (0: off;
    #: only with ``allocation="hybrid"``)
    max_layers: int = 0
    #: ``"mlp"``, or ``"cnn"``: convolution layers of ``conv_channels`` filters allocated
    #: layer-wise, then ``hidden`` and the output as the dense head (:mod:`zpipe.lossy.cnn`)
    model: str = "mlp"
    conv_channels: tuple[int, ...] = PAPER_CHANNELS
    #: devices the CNN's convolution layers get (0: one per layer, as many as leave the
    #: dense head four devices; see :func:`zpipe.lossy.cnn.default_conv_devices`)
    conv_devices: int = 0

    def __post_init__(self) -> None:
        if self.allocation not in ALLOCATION_KINDS:
            choices = ", ".join(ALLOCATION_KINDS)
            raise ConfigError(f"unknown allocation {self.allocation!r}; choose one of {choices}")
        if (self.n_data is None) == (self.budget_s is None):
            raise ConfigError("give exactly one of n_data (mini-batches) and budget_s (seconds)")
        if self.n_data is not None and not 1 <= self.n_data <= MAX_DATA:
            raise ConfigError(f"n_data must be in [1, {MAX_DATA}], got {self.n_data}")
        if self.budget_s is not None and not (self.budget_s > 0 and math.isfinite(self.budget_s)):
            raise ConfigError(f"budget_s must be a positive finite number, got {self.budget_s}")
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0, got {self.seed}")
        if not (self.region_m > 0 and math.isfinite(self.region_m)):
            raise ConfigError(f"region must be a positive finite side in m, got {self.region_m}")
        if not 1 <= self.n_devices <= MAX_DEVICES:
            raise ConfigError(f"n_devices must be in [1, {MAX_DEVICES}], got {self.n_devices}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"learning rate must be positive, got {self.lr}")
        if self.batch_size < 1:
            raise ConfigError(f"batch size must be >= 1, got {self.batch_size}")
        if any(h < 1 for h in self.hidden):
            raise ConfigError(f"hidden layer widths must be positive, got {self.hidden}")
        if (
            not 1 <= self.eval_points <= MAX_EVAL_POINTS
            or self.test_repeats < 1
            or self.curve_test_repeats < 1
        ):
            raise ConfigError(f"eval_points must be in [1, {MAX_EVAL_POINTS}], test repeats >= 1")
        if self.gpipe and not self.pipelined:
            raise ConfigError("gpipe is a pipelined schedule; drop pipelined=False")
        if self.gpipe and self.recovery.scheme != "none":
            raise ConfigError("GPipe runs send once; recovery schemes are not modelled for it")
        if self.microbatches < 0 or (self.microbatches and not self.gpipe):
            raise ConfigError(f"microbatches needs gpipe and must be >= 1, got {self.microbatches}")
        if not 1 <= self.micro_count <= self.batch_size:
            raise ConfigError(
                f"GPipe needs 1 to batch_size ({self.batch_size}) micro-batches, "
                f"got {self.micro_count}"
            )
        if self.max_layers < 0 or (self.max_layers and self.allocation != "hybrid"):
            raise ConfigError(
                f"max_layers applies to allocation 'hybrid' and must be >= 1, got {self.max_layers}"
            )
        self._check_model()

    def _check_model(self) -> None:
        if self.model not in MODELS:
            raise ConfigError(f"unknown model {self.model!r}; choose one of {', '.join(MODELS)}")
        if self.model == "mlp":
            if self.conv_devices:
                raise ConfigError("conv_devices applies to model 'cnn'")
            return
        if not self.conv_channels or any(c < 1 for c in self.conv_channels):
            raise ConfigError(f"conv_channels must be positive, got {self.conv_channels}")
        if not 0 <= self.conv_devices <= len(self.conv_channels):
            raise ConfigError(
                f"conv_devices must be in [0, {len(self.conv_channels)}] (0: automatic), "
                f"got {self.conv_devices}"
            )
        if self.allocation != "naive" and self.n_devices < 2:
            raise ConfigError("a partitioned CNN needs at least 2 devices")
        if self.gpipe or self.max_layers:
            raise ConfigError("the CNN runs EdgePipe's schedule (no gpipe, no max_layers)")

    @property
    def micro_count(self) -> int:
        """Micro-batches per mini-batch (1 unless GPipe)."""
        if not self.gpipe:
            return 1
        return self.microbatches or self.n_devices

    @property
    def label(self) -> str:
        if self.allocation == "naive":
            return "naive"
        parts = [self.allocation]
        if self.model != "mlp":
            parts.insert(0, self.model)
        if self.lossless:
            parts.append("lossless")
        if self.recovery.scheme != "none":
            parts.append(self.recovery.scheme)
        if not self.pipelined:
            parts.append("nopipe")
        if self.gpipe:
            parts.append("gpipe")
        if self.max_layers:
            parts.append(f"m{self.max_layers}")
        return "_".join(parts)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["hidden"] = list(self.hidden)
        out["conv_channels"] = list(self.conv_channels)
        out["label"] = self.label
        return out


def build_allocation(
    cfg: RunConfig,
    layer_sizes: list[int],
    topology: LinkTopology,
    measured: np.ndarray | None = None,
) -> Allocation:
    """Partition, then map on the measured reception ratios (naive: one device).

    ``measured`` replaces the topology's simulated 50-probe measurement, e.g.
    with one measured between stages.
    """
    if cfg.model == "cnn":
        alloc = partition_cnn(
            cfg.allocation, cnn_spec(cfg, layer_sizes), cfg.n_devices, conv_devices=cfg.conv_devices
        )
        if cfg.allocation == "naive":
            return alloc
    elif cfg.allocation == "naive":
        return partition("naive", layer_sizes, 1)
    elif cfg.max_layers:
        alloc = partition_layers(layer_sizes, cfg.n_devices, cfg.max_layers)
    else:
        alloc = partition(cfg.allocation, layer_sizes, cfg.n_devices)
    prr = topology.prr_measured if measured is None else measured
    return map_devices(alloc, prr, method=cfg.mapping, seed=cfg.seed)


@dataclass(frozen=True)
class PreparedRun:
    """What a run's seed fixes before training starts: the devices and links, the
    allocation mapped onto them, the initial weights and every mini-batch's rows.

    The in-process simulation and a run on stages
    (:mod:`zpipe.client.runs.lossy`) both start from one of these.
    """

    config: RunConfig
    layer_sizes: list[int]
    topology: LinkTopology
    alloc: Allocation
    n_data: int
    #: the timeslot with one transmission (compute + eq. 4 airtime + margin)
    slot_s: float
    params: list[tuple[np.ndarray, np.ndarray]]
    #: training-set rows of mini-batch ``i`` (1-based data id) at index ``i - 1``
    batch_rows: list[np.ndarray]
    #: timeslots between mini-batches (the pipeline's, or 2L - 1 without pipelining)
    period: int = 0
    #: every timeslot's duration, recovery airtime charged (None: ``slot_s`` each)
    clock: SlotClock | None = None

    def __post_init__(self) -> None:
        if self.period == 0:
            object.__setattr__(self, "period", pipeline_period(self.alloc))

    @property
    def lossless(self) -> bool:
        return self.config.lossless or self.config.allocation == "naive"

    def batch(self, data: Dataset, data_id: int) -> tuple[np.ndarray, np.ndarray]:
        rows = self.batch_rows[data_id - 1]
        return data.x_train[rows], data.y_train[rows]


def cnn_spec(cfg: RunConfig, layer_sizes: Sequence[int]) -> CnnSpec:
    """The CNN of a ``model="cnn"`` run whose input and output are ``layer_sizes``'."""
    return CnnSpec.for_features(
        layer_sizes[0], layer_sizes[-1], channels=cfg.conv_channels, hidden=cfg.hidden
    )


def run_network(cfg: RunConfig, data: Dataset) -> CnnSpec | None:
    """The CNN a run trains (None: an MLP)."""
    return None if cfg.model != "cnn" else cnn_spec(cfg, [data.n_features, data.n_classes])


def prepare_run(
    cfg: RunConfig, data: Dataset, *, measured: np.ndarray | None = None
) -> PreparedRun:
    """Place, partition, map, initialise and order the data of one run
    (``measured``: map on these reception ratios instead of the simulated probes)."""
    cnn = run_network(cfg, data)
    layer_sizes = [data.n_features, *cfg.hidden, data.n_classes]
    n_weights = sum(a * b for a, b in itertools.pairwise(layer_sizes))
    if cnn is not None:
        layer_sizes, n_weights = cnn.layer_sizes, cnn.n_parameters
    if n_weights > MAX_PARAMETERS:
        raise ConfigError(
            f"layers {layer_sizes} hold {n_weights} weights, more than {MAX_PARAMETERS}; "
            "use narrower or fewer hidden layers"
        )
    topology = make_topology(max(cfg.n_devices, 1), cfg.region_m, seed=cfg.seed, model=cfg.radio)
    alloc = build_allocation(cfg, layer_sizes, topology, measured)
    slot_s = timeslot_ms(alloc) / 1000.0
    period = pipeline_period(alloc) if cfg.pipelined else sequential_period(alloc)
    links = link_costs(cfg, topology)
    micro = cfg.micro_count
    if cfg.gpipe:
        slot_s = gpipe_timeslot_ms(alloc, micro) / 1000.0
        period = gpipe_period(alloc, micro)
    if cfg.n_data is not None:
        n_data = cfg.n_data
    elif cfg.gpipe:
        assert cfg.budget_s is not None
        n_data = gpipe_data_within(alloc, micro, cfg.budget_s, max_data=MAX_DATA)
    else:
        assert cfg.budget_s is not None
        n_data = data_within_budget(alloc, links, cfg.budget_s, period=period, max_data=MAX_DATA)
    stream = _BatchStream(data, cfg.batch_size, seed=cfg.seed)
    return PreparedRun(
        config=cfg,
        layer_sizes=layer_sizes,
        topology=topology,
        alloc=alloc,
        n_data=n_data,
        slot_s=slot_s,
        params=init_mlp(layer_sizes, seed=cfg.seed)
        if cnn is None
        else cnn.init_params(seed=cfg.seed),
        batch_rows=[stream.next_rows() for _ in range(n_data)],
        period=period,
        clock=gpipe_clock(alloc, micro, n_data)
        if cfg.gpipe
        else plan_clock(alloc, links, n_data, period=period),
    )


def link_costs(cfg: RunConfig, topology: LinkTopology) -> LinkCosts:
    """What decides a run's transmissions: the same links, seed and scheme as its
    :class:`~zpipe.lossy.engine.LinkChannel` (naive: nothing crosses a link)."""
    return LinkCosts(
        prr=topology.prr,
        seed=cfg.seed,
        recovery=cfg.recovery,
        lossless=cfg.lossless or cfg.allocation == "naive",
    )


def run_training(cfg: RunConfig, data: Dataset) -> dict[str, Any]:
    """Simulate one run; a JSON-ready dict of its curves and final numbers."""
    started = time.perf_counter()
    prepared = prepare_run(cfg, data)
    layer_sizes = prepared.layer_sizes
    topology = prepared.topology
    alloc = prepared.alloc
    slot_s = prepared.slot_s
    clock = prepared.clock or plan_clock(
        alloc, link_costs(cfg, topology), prepared.n_data, period=prepared.period
    )
    n_data = prepared.n_data
    channel = LinkChannel(
        prr=topology.prr,
        seed=cfg.seed,
        recovery=cfg.recovery,
        lossless=prepared.lossless,
    )
    model = partitioned_model(prepared, data, channel)
    cnn = run_network(cfg, data)
    n_slots = clock.n_slots
    eval_slots = _eval_slots(cfg, n_slots)

    in_flight: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    losses: list[float] = []
    curve: dict[str, list[float]] = {
        "time_s": [],
        "data_done": [],
        "train_loss": [],
        "test_acc": [],
        "test_acc_lossless": [],
    }
    done = 0
    eval_index = 0
    next_eval = 0

    def evaluate(at_slot: int) -> None:
        nonlocal eval_index, losses
        acc, acc_clean = _test_accuracy(
            model, data, cfg.batch_size, eval_index, repeats=cfg.curve_test_repeats, cnn=cnn
        )
        eval_index += 1
        curve["time_s"].append(clock.time_at(at_slot))
        curve["data_done"].append(done)
        curve["train_loss"].append(float(np.mean(losses)) if losses else float("nan"))
        curve["test_acc"].append(acc)
        curve["test_acc_lossless"].append(acc_clean)
        losses = []

    last_layer = alloc.n_layers - 1
    micro = cfg.micro_count
    finished = 0  # micro-batches (mini-batches unless GPipe) through their last pass
    for ev in run_passes(prepared):
        while next_eval < len(eval_slots) - 1 and ev.timeslot >= eval_slots[next_eval]:
            evaluate(eval_slots[next_eval])
            next_eval += 1
        if ev.kind == "F":
            if ev.layer == 0:
                in_flight[ev.step] = pass_batch(prepared, data, ev)
            model.forward(ev.step, ev.layer, in_flight[ev.step][0])
        else:
            loss = model.backward(ev.step, ev.layer, in_flight[ev.step][1], lr_scale=ev.lr_scale)
            if ev.layer == last_layer and loss is not None:
                losses.append(loss)
            if ev.layer == 1:
                del in_flight[ev.step]
                finished += 1
                done = finished // micro
    final_acc, final_clean = _test_accuracy(
        model, data, cfg.batch_size, eval_index, repeats=cfg.test_repeats, cnn=cnn
    )
    curve["time_s"].append(clock.total_s)
    curve["data_done"].append(done)
    curve["train_loss"].append(float(np.mean(losses)) if losses else float("nan"))
    curve["test_acc"].append(final_acc)
    curve["test_acc_lossless"].append(final_clean)

    snn = connectivity(alloc)
    dev = np.asarray(alloc.device_of)
    return {
        "config": cfg.as_dict(),
        "layer_sizes": layer_sizes,
        "allocation": alloc.to_dict(),
        "topology": topology.to_dict(),
        "mean_prr": mean_offdiagonal(topology.prr),
        "mapping_score": mapping_score(snn, topology.prr[np.ix_(dev, dev)], range(len(dev)))
        if alloc.n_devices > 1
        else 0.0,
        "timeslot_ms": slot_s * 1000.0,
        "pipeline_period": prepared.period,
        "timeslots": n_slots,
        "n_data": n_data,
        "train_time_s": clock.total_s,
        "airtime_s": clock.airtime_s,
        "curve": curve,
        "final_test_acc": final_acc,
        "final_test_acc_lossless": final_clean,
        "final_train_loss": curve["train_loss"][-1],
        **model.propagation.as_dict(),
        "traffic": {k: v.as_dict() for k, v in sorted(channel.traffic.items())},
        "tx_factor": _tx_factor(channel),
        "wall_s": time.perf_counter() - started,
    }


def partitioned_model(
    prepared: PreparedRun,
    data: Dataset,
    channel: LinkChannel,
    *,
    record_grads: bool = False,
    record_arrivals: bool = False,
) -> PartitionedMLP:
    """The run's devices in process: numpy slices for an MLP, torch layers for a CNN."""
    cfg = prepared.config
    cnn = run_network(cfg, data)
    options: dict[str, Any] = {"record_grads": record_grads, "record_arrivals": record_arrivals}
    if cnn is not None:
        from zpipe.lossy.torch_cnn import TorchCnnShard  # torch only for the CNN

        options["shard_factory"] = TorchCnnShard.factory(cnn)
        options["weight_shapes"] = [w for w, _ in cnn.param_shapes()]
    return PartitionedMLP(prepared.alloc, prepared.params, channel, lr=cfg.lr, **options)


@dataclass(frozen=True)
class RunPass:
    """One pass of a run under its schedule (EdgePipe, no pipelining or GPipe)."""

    timeslot: int
    kind: str
    layer: int
    #: mini-batch (1-based data id)
    data: int
    #: the engine's and the links' step: the data id, or GPipe's micro-batch id
    step: int
    #: micro-batch index within the mini-batch (0 unless GPipe)
    micro: int
    lr_scale: float


def run_passes(prepared: PreparedRun) -> list[RunPass]:
    """Every pass of the run in timeslot order, under its schedule."""
    cfg = prepared.config
    if not cfg.gpipe:
        return [
            RunPass(ev.timeslot, ev.kind, ev.layer, ev.data, ev.data, 0, 1.0)
            for ev in events(prepared.alloc, prepared.n_data, period=prepared.period)
        ]
    micro = cfg.micro_count
    shares = [len(p) / cfg.batch_size for p in split_micro(np.arange(cfg.batch_size), micro)]
    return [
        RunPass(s.timeslot, s.kind, s.layer, s.data, s.step, s.micro, shares[s.micro])
        for s in gpipe_steps(prepared.alloc, micro, prepared.n_data)
    ]


def pass_batch(prepared: PreparedRun, data: Dataset, ev: RunPass) -> tuple[np.ndarray, np.ndarray]:
    """The inputs and labels one pass's (micro-)batch trains on."""
    rows = prepared.batch_rows[ev.data - 1]
    if prepared.config.gpipe:
        rows = split_micro(rows, prepared.config.micro_count)[ev.micro]
    return data.x_train[rows], data.y_train[rows]


def _tx_factor(channel: LinkChannel) -> float:
    train = [channel.traffic[k] for k in ("forward", "backward", "share") if k in channel.traffic]
    messages = sum(t.messages for t in train)
    return sum(t.data_tx + t.ack_tx for t in train) / messages if messages else 0.0


def _test_accuracy(
    model: PartitionedMLP,
    data: Dataset,
    batch_size: int,
    eval_index: int,
    *,
    repeats: int,
    cnn: CnnSpec | None = None,
) -> tuple[float, float]:
    """Mean accuracy of lossy inference passes (each output owner's view counts
    equally) and the accuracy of the same weights with nothing lost."""
    spec = EvalSpec(len(data.x_test), batch_size, repeats=repeats, eval_index=eval_index)
    lossy = accuracy(lossy_predictions(model, data.x_test, spec), spec, data.y_test)
    clean = _clean_accuracy(model, data, cnn)
    return lossy, clean


def final_eval_index(cfg: RunConfig, n_slots: int) -> int:
    """The evaluation index of a run's final test (its drop keys' evaluation point):
    one after the curve's points, each evaluated once its timeslot is reached."""
    return len(_eval_slots(cfg, n_slots)) - 1


def _eval_slots(cfg: RunConfig, n_slots: int) -> list[int]:
    return sorted({round(n_slots * k / cfg.eval_points) for k in range(1, cfg.eval_points + 1)})


def _clean_accuracy(model: PartitionedMLP, data: Dataset, cnn: CnnSpec | None = None) -> float:
    if cnn is not None:
        from zpipe.lossy.torch_cnn import cnn_predict

        logits = cnn_predict(cnn, model.full_params(), data.x_test)
        return float(np.mean(logits.argmax(axis=1) == data.y_test))
    h = data.x_test
    params = model.full_params()
    for k, (w, b) in enumerate(params):
        h = h @ w.T + b
        if k < len(params) - 1:
            h = np.maximum(h, 0.0)
    return float(np.mean(h.argmax(axis=1) == data.y_test))


class _BatchStream:
    """Mini-batches in a fresh seeded order each epoch."""

    def __init__(self, data: Dataset, batch_size: int, *, seed: int) -> None:
        if batch_size > len(data.x_train):
            raise ConfigError(
                f"batch size {batch_size} exceeds the {len(data.x_train)} training examples"
            )
        self._data = data
        self._batch = batch_size
        self._rng = np.random.default_rng([seed, 0xDA7A])
        self._order = self._rng.permutation(len(data.x_train))
        self._pos = 0

    def next_rows(self) -> np.ndarray:
        """The training-set rows of the next mini-batch."""
        if self._pos + self._batch > len(self._order):
            self._order = self._rng.permutation(len(self._data.x_train))
            self._pos = 0
        idx = self._order[self._pos : self._pos + self._batch]
        self._pos += self._batch
        return idx

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        idx = self.next_rows()
        return self._data.x_train[idx], self._data.y_train[idx]
