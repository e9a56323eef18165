"""Federated learning on one machine in simulated time (Eco-FL section 6.1's setting).

Every client is an in-process object that really trains the model
(:mod:`zpipe.federated.model`) on its own shard; only time is simulated.
A client's response latency is a base delay drawn from a normal
distribution times a collaborative degree from {0.2, 0.4, 0.6, 0.8, 1.0};
every ``change_every_s`` simulated seconds each client redraws its degree
with probability ``change_prob`` (the paper's dynamic setting), and the
server is told every client's current latency (its continuous profiling).
A task given at time t returns at t + latency * (1 + jitter * N(0, 1)).

The server is the same sans-IO object a networked shell would drive
(:mod:`zpipe.federated.server`): the loop below only delivers its tasks'
results in order of simulated completion time. A seed fixes the clients
(latencies, degrees and their changes, classes, shards, initial weights),
so every method of one seed faces the same federation.

With ``pipeline_latency`` (``fl-sim --pipeline-latency``) no latency is drawn:
each client is a home of 1-4 devices drawn from
:data:`~zpipe.federated.home_plan.DEVICE_CLASSES` (Jetson NX, TX2, Nano), and its
latency is the period of Eco-FL's plan of the client's model over them
(:func:`~zpipe.federated.home_plan.home_period_s`), in units where a home of one
NX takes ``delay_mean_s``. The dynamic setting redraws a home's devices
(probability ``change_prob`` every ``change_every_s``) and plans it again.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from zpipe._errors import ConfigError
from zpipe.devices import single_threaded_blas
from zpipe.federated.data import PARTITIONS, ClientShard, client_classes, make_shards
from zpipe.federated.grouping import ClientProfile, GroupingPolicy
from zpipe.federated.home_plan import CLASSES_BY_NAME, DEVICE_CLASSES, home_period_s
from zpipe.federated.model import MLPShape, accuracy, init_weights, local_train
from zpipe.federated.server import (
    METHODS,
    FederatedServer,
    ServerConfig,
    TrainTask,
    make_server,
)
from zpipe.federated.virtual_time import (
    ClockConfig,
    Finished,
    NeedProfiles,
    NeedResult,
    VirtualClock,
)
from zpipe.lossy.data import Dataset

DEGREES = (0.2, 0.4, 0.6, 0.8, 1.0)
# more devices than any home of Eco-FL's set-ups; the order search grows as n!
MAX_HOME_DEVICES = 6


@dataclass(frozen=True)
class SimConfig:
    method: str = "ecofl"
    n_clients: int = 300
    n_groups: int = 5
    # response-latency groups of the rlg-* data layouts (the paper's 5 RLGs); None: n_groups.
    # Apart from n_groups, so a run may group clients otherwise than the data was laid out.
    n_rlg: int | None = None
    max_concurrent: int = 20
    lam: float = 10.0
    rt_factor: float = 1.0
    rt_floor_fraction: float = 0.1
    alpha: float = 0.6
    group_alpha: float | None = None  # Eco-FL's inter-group alpha; None: ``alpha``
    staleness: str = "polynomial"
    staleness_a: float = 0.5
    intra_syncs: int = 1
    mu: float = 0.05
    local_steps: int = 10
    batch_size: int = 10
    lr: float = 0.1
    hidden: int = 32
    more_hidden: tuple[int, ...] = ()  # hidden layers after the first (pipeline clients)
    # a client's latency is its home's planned pipeline period, not a draw (module notes)
    pipeline_latency: bool = False
    home_sizes: tuple[int, int] = (1, 4)  # devices in a home: drawn uniformly in [lo, hi]
    # the device classes a home's devices are drawn from (empty: every class)
    home_classes: tuple[str, ...] = ()
    samples_per_client: int = 40
    partition: str = "niid"
    delay_mean_s: float = 10.0
    delay_std_s: float = 3.0
    degrees: tuple[float, ...] = DEGREES
    change_every_s: float = 100.0
    change_prob: float = 0.1
    jitter: float = 0.05
    budget_s: float = 2000.0
    eval_every_s: float = 50.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"method {self.method!r} is not one of {METHODS}")
        if self.partition not in PARTITIONS:
            raise ConfigError(f"partition {self.partition!r} is not one of {PARTITIONS}")
        if self.n_rlg is not None and self.n_rlg < 1:
            raise ConfigError("the data layout needs at least one response-latency group")
        if self.n_clients < 1 or self.local_steps < 1 or self.batch_size < 1:
            raise ConfigError("clients, local steps and batch size must be at least 1")
        if not (self.budget_s > 0 and self.eval_every_s > 0 and self.change_every_s > 0):
            raise ConfigError("budget, evaluation and change intervals must be > 0")
        if not (self.delay_mean_s > 0 and self.delay_std_s >= 0 and self.degrees):
            raise ConfigError("the base delay must be > 0, its spread >= 0, degrees non-empty")
        if not 0 <= self.change_prob <= 1 or self.jitter < 0:
            raise ConfigError("change_prob must lie in [0, 1] and jitter be >= 0")
        lo, hi = self.home_sizes
        if not 1 <= lo <= hi <= MAX_HOME_DEVICES:
            raise ConfigError(
                f"home sizes must satisfy 1 <= lo <= hi <= {MAX_HOME_DEVICES}, got {lo}-{hi}"
            )
        unknown = sorted(set(self.home_classes) - set(CLASSES_BY_NAME))
        if unknown:
            raise ConfigError(f"unknown device classes {unknown}; known: {sorted(CLASSES_BY_NAME)}")
        if self.hidden < 1 or any(w < 1 for w in self.more_hidden):
            raise ConfigError("hidden layer widths must be >= 1")


# Fields added after results were published: left out of a run's config record while
# at their defaults, so that earlier runs' results.json stay byte-identical.
_LATER_FIELDS = {
    "more_hidden": (),
    "pipeline_latency": False,
    "home_sizes": (1, 4),
    "home_classes": (),
}


def config_record(config: SimConfig) -> dict[str, Any]:
    record = asdict(config)
    for name, default in _LATER_FIELDS.items():
        if getattr(config, name) == default:
            del record[name]
    return record


def sim_shape(config: SimConfig, dataset: Dataset) -> MLPShape:
    """The model every client of a run trains."""
    return MLPShape(dataset.n_features, config.hidden, dataset.n_classes, config.more_hidden)


@dataclass
class Federation:
    """The clients of one seed: shards, base delays and collaborative degrees."""

    shards: list[ClientShard]
    base_delay_s: np.ndarray
    degree: np.ndarray
    n_classes: int
    env_rng: np.random.Generator = field(repr=False)

    def latency(self, client_id: int) -> float:
        return float(self.base_delay_s[client_id] * self.degree[client_id])

    def change_degrees(self, degrees: tuple[float, ...], probability: float) -> None:
        changing = self.env_rng.random(len(self.degree)) < probability
        new = self.env_rng.choice(np.asarray(degrees), size=len(self.degree))
        self.degree = np.where(changing, new, self.degree)

    def profiles(self) -> list[ClientProfile]:
        return [
            ClientProfile(c, self.latency(c), shard.label_counts(self.n_classes))
            for c, shard in enumerate(self.shards)
        ]


@dataclass
class PipelineFederation(Federation):
    """Clients whose latency is their home's planned pipeline period (module notes)."""

    homes: list[tuple[str, ...]] = field(default_factory=list)
    shape: MLPShape = field(default_factory=lambda: MLPShape(64, 32, 10))
    batch_size: int = 10
    home_sizes: tuple[int, int] = (1, 4)
    home_classes: tuple[str, ...] = ()
    time_unit_s: float = 10.0  # the latency of a home of one reference device

    def latency(self, client_id: int) -> float:
        period = home_period_s(self.shape, self.homes[client_id], self.batch_size)
        reference = home_period_s(self.shape, (DEVICE_CLASSES[0].name,), self.batch_size)
        return self.time_unit_s * period / reference

    def change_degrees(self, degrees: tuple[float, ...], probability: float) -> None:
        """The dynamic setting for homes: a changing client's devices are drawn again."""
        changing = self.env_rng.random(len(self.homes)) < probability
        for client in np.flatnonzero(changing):
            self.homes[int(client)] = draw_home(self.env_rng, self.home_sizes, self.home_classes)

    def home_summary(self) -> dict[str, Any]:
        latencies = [self.latency(c) for c in range(len(self.homes))]
        return {
            "mean_devices": round(float(np.mean([len(h) for h in self.homes])), 3),
            "latency_s": {
                "min": round(min(latencies), 3),
                "median": round(float(np.median(latencies)), 3),
                "max": round(max(latencies), 3),
            },
        }


def draw_home(
    rng: np.random.Generator, sizes: tuple[int, int], classes: tuple[str, ...] = ()
) -> tuple[str, ...]:
    """A home's devices: how many uniformly in ``sizes``, each of a uniform class (of
    ``classes``; empty: of every class)."""
    names = classes or tuple(c.name for c in DEVICE_CLASSES)
    count = int(rng.integers(sizes[0], sizes[1] + 1))
    picks = rng.integers(0, len(names), size=count)
    return tuple(names[int(k)] for k in picks)


def build_federation(config: SimConfig, dataset: Dataset) -> Federation:
    rng = np.random.default_rng([config.seed, 1])
    # a normal base delay, kept positive (a tenth of the mean at least)
    base = np.maximum(
        rng.normal(config.delay_mean_s, config.delay_std_s, config.n_clients),
        0.1 * config.delay_mean_s,
    )
    degree = rng.choice(np.asarray(config.degrees), size=config.n_clients)
    homes: PipelineFederation | None = None
    if config.pipeline_latency:
        # the draws above still happen, so that the classes and shards below are those
        # of the drawn-latency mode's seed (under niid; rlg-* follow the new latencies)
        home_rng = np.random.default_rng([config.seed, 7])
        homes = PipelineFederation(
            [],
            base,
            degree,
            dataset.n_classes,
            np.random.default_rng([config.seed, 2]),
            homes=[
                draw_home(home_rng, config.home_sizes, config.home_classes)
                for _ in range(config.n_clients)
            ],
            shape=sim_shape(config, dataset),
            batch_size=min(config.batch_size, config.samples_per_client),
            home_sizes=config.home_sizes,
            home_classes=config.home_classes,
            time_unit_s=config.delay_mean_s,
        )
    latencies = (
        [homes.latency(c) for c in range(config.n_clients)]
        if homes is not None
        else (base * degree).tolist()
    )
    classes = client_classes(
        config.partition,
        latencies,
        n_classes=dataset.n_classes,
        n_rlg=config.n_groups if config.n_rlg is None else config.n_rlg,
        rng=rng,
        seed=config.seed,
    )
    shards = make_shards(dataset, classes, samples_per_client=config.samples_per_client, rng=rng)
    if homes is not None:
        homes.shards = shards
        return homes
    return Federation(
        shards, base, degree, dataset.n_classes, np.random.default_rng([config.seed, 2])
    )


def run_simulation(
    config: SimConfig,
    dataset: Dataset,
    *,
    on_server: Callable[[FederatedServer], None] | None = None,
) -> dict[str, Any]:
    """One federated run; returns its accuracy curve against simulated time and its
    stats (``on_server``: see :func:`run_federation`)."""
    # the matrices are tiny: BLAS threads would only fight other processes for the cores
    with single_threaded_blas():
        return run_federation(
            config, build_federation(config, dataset), dataset, on_server=on_server
        )


def server_config(config: SimConfig) -> ServerConfig:
    """The server settings of a run (fl-sim's and the Flower ServerApp's alike)."""
    return ServerConfig(
        method=config.method,
        max_concurrent=config.max_concurrent,
        alpha=config.alpha,
        group_alpha=config.group_alpha,
        staleness=config.staleness,
        staleness_a=config.staleness_a,
        intra_syncs=config.intra_syncs,
        grouping=GroupingPolicy(
            n_groups=config.n_groups,
            lam=config.lam,
            rt_factor=config.rt_factor,
            rt_floor_fraction=config.rt_floor_fraction,
            seed=config.seed,
        ),
        seed=config.seed,
    )


def clock_config(config: SimConfig) -> ClockConfig:
    return ClockConfig(
        seed=config.seed,
        jitter=config.jitter,
        budget_s=config.budget_s,
        eval_every_s=config.eval_every_s,
        change_every_s=config.change_every_s,
    )


def initial_weights(config: SimConfig, shape: MLPShape) -> np.ndarray:
    return init_weights(shape, np.random.default_rng([config.seed, 3]))


def train_task(
    config: SimConfig, shape: MLPShape, shard: ClientShard, task: TrainTask
) -> np.ndarray:
    """A client's local training of one task, seeded by the task (so any transport
    that runs it, fl-sim inline or a Flower ClientApp, trains the same weights)."""
    return local_train(
        task.weights,
        shape,
        shard.x,
        shard.y,
        steps=config.local_steps,
        batch_size=config.batch_size,
        lr=config.lr,
        mu=config.mu,
        rng=np.random.default_rng([config.seed, 5, task.task_id]),
    )


def run_result(
    config: SimConfig, clock: VirtualClock, started: float, **extra: Any
) -> dict[str, Any]:
    """What a run reports (fl-sim's JSON and the Flower ServerApp's alike)."""
    return {
        "method": config.method,
        "seed": config.seed,
        "config": config_record(config),
        "curve": {"time_s": clock.log.curve_t, "test_acc": clock.log.curve_acc},
        "final_acc": clock.log.curve_acc[-1],
        "client_tasks": clock.log.client_tasks,
        **clock.reached,
        "stats": clock.server.stats(),
        **extra,
        "wall_s": round(time.perf_counter() - started, 3),
    }


def run_federation(
    config: SimConfig,
    federation: Federation,
    dataset: Dataset,
    *,
    max_updates: int | None = None,
    on_server: Callable[[FederatedServer], None] | None = None,
) -> dict[str, Any]:
    """One run over given clients (``config.n_clients`` of them). With ``max_updates``
    it also stops once the global model has had that many updates, and reports the
    simulated time that took and the accuracy then (what fl-server's --updates ends at).
    ``on_server`` is handed the server once the run ends (a bench reads its merges).

    The clock (:class:`~zpipe.federated.virtual_time.VirtualClock`) decides; this
    loop only trains each task inline and reads the federation's latencies."""
    started = time.perf_counter()
    extra: dict[str, Any] = {}
    if isinstance(federation, PipelineFederation):  # the homes as the run starts
        extra["pipeline_homes"] = federation.home_summary()
    shape = sim_shape(config, dataset)
    server = make_server(
        federation.profiles(), initial_weights(config, shape), server_config(config)
    )
    clock = VirtualClock(
        server,
        {c: federation.latency(c) for c in range(config.n_clients)},
        clock_config(config),
        evaluate=lambda w: accuracy(w, shape, dataset.x_test, dataset.y_test),
        max_updates=max_updates,
    )
    while True:
        clock.take_dispatched()  # trained when their completion comes up, below
        match clock.advance():
            case Finished():
                break
            case NeedProfiles():
                federation.change_degrees(config.degrees, config.change_prob)
                clock.on_profiles({c: federation.latency(c) for c in range(config.n_clients)})
            case NeedResult(task=task):
                shard = federation.shards[task.client_id]
                clock.on_result(train_task(config, shape, shard, task), len(shard.y))
    if on_server is not None:
        on_server(server)
    return run_result(config, clock, started, **extra)


def time_to_accuracy(result: dict[str, Any], target: float) -> float:
    """The first evaluation time at which the run reached ``target`` (inf if never)."""
    for t, acc in zip(result["curve"]["time_s"], result["curve"]["test_acc"], strict=True):
        if acc >= target:
            return float(t)
    return math.inf
