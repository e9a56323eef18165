"""The federated server as a sans-IO state machine: events in, training tasks out.

Every method answers the same four calls, so the simulator and a networked
shell drive them alike::

    start()                        -> [TrainTask, ...]   first dispatches
    on_update(ClientUpdate)        -> [TrainTask, ...]   a client's trained model came back
    on_task_failed(task_id)        -> [TrainTask, ...]   a client timed out or left mid-task
    observe_silence(client, s)     -> [TrainTask, ...]   ... and is out of its group (Eco-FL)
    observe_latency(client, L_n)   -> [TrainTask, ...]   a new response latency was profiled
    add_client(profile)            -> [TrainTask, ...]   a client joined the started run

and says which clients a networked shell should probe for their latency
(``probe_candidates``: Eco-FL's dropped clients, and the flat methods' clients set
aside as silent, whom no task measures).

A :class:`TrainTask` says "train these weights and send them back"; the
client trains ``local_steps`` steps with the proximal term mu around the
weights it received (FedProx). At most ``max_concurrent`` (K) clients hold a
task at any time, and no client holds two.

Methods (Eco-FL section 6.1's baselines):

- ``ecofl``: groups by eq. 4 (:mod:`zpipe.federated.grouping`), synchronous
  intra-group rounds (sample-weighted average, ``intra_syncs`` averages per
  round), asynchronous FedAsync mixing of each finished group model into the
  global model with alpha * s(staleness), dynamic regrouping and re-admission;
- ``ecofl-nodg``: the same without dynamic regrouping (Fig. 7's "w/o DG");
- ``fedat``: K-means latency tiers kept as they are, FedAT's cross-tier
  weighted average of the tiers' latest models;
- ``astraea``: Astraea's data-only grouping (JS divergence alone), with
  Eco-FL's hierarchical aggregation (the paper compares only its grouping);
- ``fedavg``: synchronous rounds of K random clients;
- ``fedasync``: K clients in flight, each returned model mixed in at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from zpipe._errors import ConfigError, ProtocolError
from zpipe.federated.aggregation import (
    fedasync_mix,
    fedat_tier_weights,
    staleness_factor,
    weighted_average,
)
from zpipe.federated.grouping import ClientProfile, Grouping, GroupingPolicy

FloatArray = npt.NDArray[np.float64]

METHODS = ("ecofl", "ecofl-nodg", "fedat", "astraea", "fedavg", "fedasync")


@dataclass(frozen=True)
class TrainTask:
    task_id: int
    client_id: int
    weights: FloatArray
    version: int  # the global model version the round (or the task) started from


@dataclass(frozen=True)
class ClientUpdate:
    task_id: int
    client_id: int
    weights: FloatArray
    n_samples: int


@dataclass(frozen=True)
class ServerConfig:
    method: str = "ecofl"
    max_concurrent: int = 20  # K
    alpha: float = 0.6
    # Eco-FL's inter-group mixing weight (section 5.1: "fine-tuned globally"); it mixes a
    # group's averaged model, not one client's, so it is a setting of its own, shared by
    # the methods that aggregate groups that way (Eco-FL, w/o DG, Astraea's grouping).
    # None: the same as FedAsync's ``alpha``.
    group_alpha: float | None = None
    staleness: str = "polynomial"
    staleness_a: float = 0.5
    intra_syncs: int = 1
    grouping: GroupingPolicy = field(default_factory=GroupingPolicy)
    seed: int = 0
    # The flat methods (fedavg, fedasync) set a client aside after observe_silence, and
    # pick it again once observe_latency measures it (its late answer or a probe's
    # answer: set-aside clients are probe_candidates), or when nothing else could run.
    # fl-server sets it: there a silent client is a peer that may never answer (issue
    # 33 finding 4: 300 silent ids took FedAsync's every slot).
    # fl-sim keeps the methods as the paper runs them: a failed client stays in the pool.
    sideline_silent: bool = False

    @property
    def inter_group_alpha(self) -> float:
        return self.alpha if self.group_alpha is None else self.group_alpha

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"method {self.method!r} is not one of {METHODS}")
        if self.max_concurrent < 1 or self.intra_syncs < 1:
            raise ConfigError("max_concurrent (K) and intra_syncs must be at least 1")
        if not 0 < self.alpha <= 1:
            raise ConfigError(f"alpha must lie in (0, 1], not {self.alpha}")
        if self.group_alpha is not None and not 0 < self.group_alpha <= 1:
            raise ConfigError(f"group_alpha must lie in (0, 1], not {self.group_alpha}")
        staleness_factor(0, function=self.staleness, a=self.staleness_a)  # validates the name


@dataclass
class _Task:
    task_id: int
    client_id: int
    owner: int  # group id, or -1 for the flat methods
    version: int


class FederatedServer:
    """Task bookkeeping shared by every method; subclasses decide who trains what."""

    def __init__(
        self, profiles: Sequence[ClientProfile], initial_weights: FloatArray, config: ServerConfig
    ) -> None:
        if not profiles:
            raise ConfigError("a federated run needs at least one client")
        self.config = config
        self.profiles = {p.client_id: p for p in profiles}
        self.global_weights = np.asarray(initial_weights, dtype=np.float64).copy()
        self.version = 0
        self.rng = np.random.default_rng(config.seed)
        self._tasks: dict[int, _Task] = {}
        self._next_task_id = 0
        self.busy: set[int] = set()
        self.failed_tasks = 0
        self.sidelined: set[int] = set()  # silent clients of a flat method (sideline_silent)
        # every global update: (the group whose model it took, -1 for a flat method's
        # client or round; the weight the new global model gave it); a bench's evidence
        self.merges: list[tuple[int, float]] = []

    @property
    def name(self) -> str:
        return self.config.method

    def _dispatch(self, client_id: int, weights: FloatArray, version: int, owner: int) -> TrainTask:
        if client_id in self.busy:
            raise AssertionError(f"client {client_id} already holds a task")
        if len(self.busy) >= self.config.max_concurrent:
            raise AssertionError("dispatch past the concurrency bound K")
        task_id = self._next_task_id
        self._next_task_id += 1
        self._tasks[task_id] = _Task(task_id, client_id, owner, version)
        self.busy.add(client_id)
        return TrainTask(task_id, client_id, weights, version)

    def _close_task(self, task_id: int, client_id: int | None) -> _Task:
        task = self._tasks.get(task_id)
        if task is None:
            raise ProtocolError(f"no task {task_id} is outstanding (late, repeated or unknown)")
        if client_id is not None and task.client_id != client_id:
            raise ProtocolError(
                f"task {task_id} was given to client {task.client_id}, not {client_id}"
            )
        del self._tasks[task_id]
        self.busy.discard(task.client_id)
        return task

    def _check_update(self, update: ClientUpdate) -> None:
        weights = np.asarray(update.weights)
        if weights.shape != self.global_weights.shape:
            raise ProtocolError(
                f"client {update.client_id} sent weights of shape {weights.shape}, "
                f"expected {self.global_weights.shape}"
            )
        if not np.all(np.isfinite(weights)):
            raise ProtocolError(f"client {update.client_id} sent non-finite weights")
        if update.n_samples <= 0:
            raise ProtocolError(f"client {update.client_id} reported {update.n_samples} samples")

    def on_update(self, update: ClientUpdate) -> list[TrainTask]:
        # validate before closing the task: a bad message leaves the task outstanding,
        # so the caller's timeout (on_task_failed) still ends it
        if update.task_id in self._tasks:
            self._check_update(update)
        task = self._close_task(update.task_id, update.client_id)
        return self._handle_update(task, update)

    def on_task_failed(self, task_id: int) -> list[TrainTask]:
        task = self._close_task(task_id, None)
        self.failed_tasks += 1
        return self._handle_failure(task)

    def observe_latency(self, client_id: int, latency_s: float) -> list[TrainTask]:
        if client_id not in self.profiles:
            raise ConfigError(f"latency reported for unknown client {client_id}")
        if not (latency_s >= 0 and math.isfinite(latency_s)):
            raise ConfigError(f"client {client_id} reported a latency of {latency_s!r}")
        return self._handle_latency(client_id, latency_s)

    def observe_silence(self, client_id: int, waited_s: float) -> list[TrainTask]:
        """A client left a task unanswered for ``waited_s`` (a lower bound of its latency)."""
        if client_id not in self.profiles:
            raise ConfigError(f"silence reported for unknown client {client_id}")
        if not (waited_s >= 0 and math.isfinite(waited_s)):
            raise ConfigError(f"client {client_id} waited for {waited_s!r}")
        return self._handle_silence(client_id, waited_s)

    def add_client(self, profile: ClientProfile) -> list[TrainTask]:
        """A client registered after start(): profile it into the run (eq. 4 for groups)."""
        if profile.client_id in self.profiles:
            raise ConfigError(f"client {profile.client_id} is already in the run")
        width = len(next(iter(self.profiles.values())).label_counts)
        if len(profile.label_counts) != width:
            raise ConfigError(
                f"client {profile.client_id} reports {len(profile.label_counts)} "
                f"label counts, the run has {width} classes"
            )
        self.profiles[profile.client_id] = profile
        return self._handle_join(profile)

    def outstanding(self) -> int:
        return len(self._tasks)

    def probe_candidates(self) -> list[int]:
        """Clients whose latency only a probe can measure, and whose latency could
        change a decision: a flat method's set-aside clients (sideline_silent), whom
        no task measures; an answered probe brings one back (observe_latency)."""
        return sorted(c for c in self.sidelined if c not in self.busy)

    def is_dropped(self, client_id: int) -> bool:
        return client_id in self.sidelined

    # -- the method's decisions ----------------------------------------------------------

    def start(self) -> list[TrainTask]:
        raise NotImplementedError

    def _handle_update(self, task: _Task, update: ClientUpdate) -> list[TrainTask]:
        raise NotImplementedError

    def _handle_failure(self, task: _Task) -> list[TrainTask]:
        raise NotImplementedError

    def _handle_latency(self, client_id: int, latency_s: float) -> list[TrainTask]:
        # flat methods do not group, so a latency decides only whether a silent client
        # (sideline_silent) is back: it is, and may take a free slot
        if client_id not in self.sidelined:
            return []
        self.sidelined.discard(client_id)
        return self._handle_join(self.profiles[client_id])

    def _handle_silence(self, client_id: int, waited_s: float) -> list[TrainTask]:
        # flat methods do not group: a silent client is a failed task, and with
        # sideline_silent is not picked again until it is heard from
        if self.config.sideline_silent:
            self.sidelined.add(client_id)
        return []

    def _handle_join(self, profile: ClientProfile) -> list[TrainTask]:
        raise NotImplementedError

    def stats(self) -> dict[str, float | int]:
        stats: dict[str, float | int] = {
            "global_updates": self.version,
            "failed_tasks": self.failed_tasks,
        }
        if self.sidelined:
            stats["sidelined_now"] = len(self.sidelined)
        return stats

    def _idle_clients(self, candidates: Sequence[int]) -> list[int]:
        idle = sorted(c for c in candidates if c not in self.busy)
        heard = [c for c in idle if c not in self.sidelined]
        # the set-aside clients get another try only when nothing else would run
        return heard if heard or self._tasks else idle

    def _sample(self, candidates: Sequence[int], k: int) -> list[int]:
        if k <= 0 or not candidates:
            return []
        chosen = self.rng.choice(len(candidates), size=min(k, len(candidates)), replace=False)
        return sorted(candidates[int(i)] for i in chosen)


class FedAvgServer(FederatedServer):
    """Synchronous rounds: K random clients, sample-weighted average, next round."""

    def __init__(
        self, profiles: Sequence[ClientProfile], initial_weights: FloatArray, config: ServerConfig
    ) -> None:
        super().__init__(profiles, initial_weights, config)
        self._results: list[tuple[FloatArray, int]] = []
        self._pending = 0

    def start(self) -> list[TrainTask]:
        return self._new_round()

    def _new_round(self) -> list[TrainTask]:
        clients = self._sample(self._idle_clients(list(self.profiles)), self.config.max_concurrent)
        self._results = []
        self._pending = len(clients)
        return [self._dispatch(c, self.global_weights, self.version, -1) for c in clients]

    def _round_step(self) -> list[TrainTask]:
        self._pending -= 1
        if self._pending > 0:
            return []
        if self._results:
            self.global_weights = weighted_average(
                [w for w, _ in self._results], [n for _, n in self._results]
            )
            self.merges.append((-1, 1.0))  # a round replaces the model
            self.version += 1
        return self._new_round()

    def _handle_update(self, task: _Task, update: ClientUpdate) -> list[TrainTask]:
        self._results.append((np.asarray(update.weights, dtype=np.float64), update.n_samples))
        return self._round_step()

    def _handle_failure(self, task: _Task) -> list[TrainTask]:
        return self._round_step()

    def _handle_join(self, profile: ClientProfile) -> list[TrainTask]:
        # a round in progress keeps its clients; with none (nobody was left), start one
        return [] if self._pending > 0 else self._new_round()


class FedAsyncServer(FederatedServer):
    """K clients in flight; each returned model is mixed in with alpha * s(staleness)."""

    def start(self) -> list[TrainTask]:
        clients = self._sample(self._idle_clients(list(self.profiles)), self.config.max_concurrent)
        return [self._dispatch(c, self.global_weights, self.version, -1) for c in clients]

    def _replace(self) -> list[TrainTask]:
        clients = self._sample(self._idle_clients(list(self.profiles)), 1)
        return [self._dispatch(c, self.global_weights, self.version, -1) for c in clients]

    def _handle_update(self, task: _Task, update: ClientUpdate) -> list[TrainTask]:
        factor = staleness_factor(
            self.version - task.version,
            function=self.config.staleness,
            a=self.config.staleness_a,
        )
        self.global_weights = fedasync_mix(
            self.global_weights, np.asarray(update.weights), self.config.alpha, factor
        )
        self.merges.append((-1, self.config.alpha * factor))
        self.version += 1
        return self._replace()

    def _handle_failure(self, task: _Task) -> list[TrainTask]:
        return self._replace()

    def _handle_join(self, profile: ClientProfile) -> list[TrainTask]:
        free = self.config.max_concurrent - len(self.busy)
        clients = self._sample(self._idle_clients(list(self.profiles)), free)
        return [self._dispatch(c, self.global_weights, self.version, -1) for c in clients]


@dataclass
class _GroupRound:
    base_version: int
    weights: FloatArray  # w^g(t_g): what this sync's clients started from
    participants: list[int]
    pending: set[int]  # task ids
    results: list[tuple[FloatArray, int]] = field(default_factory=list)
    sync_index: int = 0


class HierarchicalServer(FederatedServer):
    """Eco-FL, Eco-FL w/o DG, FedAT and Astraea's grouping: groups train synchronously,
    the global model takes each finished group model asynchronously."""

    def __init__(
        self, profiles: Sequence[ClientProfile], initial_weights: FloatArray, config: ServerConfig
    ) -> None:
        super().__init__(profiles, initial_weights, config)
        policy = _policy_for(config)
        self.grouping = Grouping(profiles, policy)
        n_groups = len(self.grouping.groups)
        if config.max_concurrent < n_groups:
            raise ConfigError(
                f"K = {config.max_concurrent} concurrent clients cannot serve {n_groups} groups: "
                "raise K or lower the number of groups"
            )
        self.per_group = config.max_concurrent // n_groups
        self._rounds: dict[int, _GroupRound] = {}
        self.tier_models = [self.global_weights.copy() for _ in range(n_groups)]
        self.tier_updates = [0] * n_groups
        self.changes = {"moved": 0, "dropped": 0, "readmitted": 0, "joined": 0}
        self.initial_mean_js = self.grouping.mean_js()
        self.initial_mean_group_latency = self.grouping.mean_group_latency()
        self.initial_dropped = len(self.grouping.dropped)

    def start(self) -> list[TrainTask]:
        return self._start_idle_groups()

    def _start_idle_groups(self) -> list[TrainTask]:
        tasks: list[TrainTask] = []
        for group in self.grouping.groups:
            if group.group_id not in self._rounds:
                tasks += self._start_round(group.group_id)
        return tasks

    def _start_round(self, group_id: int) -> list[TrainTask]:
        eligible = self._idle_clients(self.grouping.members_of(group_id))
        chosen = self._sample(eligible, self.per_group)
        if not chosen:
            return []  # idle until a member is free or joins
        weights = self.global_weights.copy()
        tasks = [self._dispatch(c, weights, self.version, group_id) for c in chosen]
        self._rounds[group_id] = _GroupRound(
            self.version, weights, chosen, {t.task_id for t in tasks}
        )
        return tasks

    def _round_of(self, task: _Task) -> _GroupRound:
        group_round = self._rounds[task.owner]
        group_round.pending.discard(task.task_id)
        return group_round

    def _handle_update(self, task: _Task, update: ClientUpdate) -> list[TrainTask]:
        group_round = self._round_of(task)
        group_round.results.append((np.asarray(update.weights, dtype=np.float64), update.n_samples))
        return self._after_task(task.owner, group_round)

    def _handle_failure(self, task: _Task) -> list[TrainTask]:
        group_round = self._round_of(task)
        group_round.participants = [c for c in group_round.participants if c != task.client_id]
        return self._after_task(task.owner, group_round)

    def _after_task(self, group_id: int, group_round: _GroupRound) -> list[TrainTask]:
        if group_round.pending:
            return []
        tasks: list[TrainTask] = []
        if group_round.results:
            group_weights = weighted_average(
                [w for w, _ in group_round.results], [n for _, n in group_round.results]
            )
            group_round.sync_index += 1
            if group_round.sync_index < self.config.intra_syncs and group_round.participants:
                # another e steps from the freshly averaged group model, same clients
                group_round.weights = group_weights
                group_round.results = []
                new = [
                    self._dispatch(c, group_weights, group_round.base_version, group_id)
                    for c in group_round.participants
                ]
                group_round.pending = {t.task_id for t in new}
                return new
            self._merge_group(group_id, group_weights, group_round.base_version)
        del self._rounds[group_id]
        tasks += self._start_idle_groups()
        return tasks

    def _merge_group(self, group_id: int, weights: FloatArray, base_version: int) -> None:
        if self.config.method == "fedat":
            self.tier_models[group_id] = weights
            self.tier_updates[group_id] += 1
            mix = fedat_tier_weights(self.tier_updates)
            self.global_weights = weighted_average(self.tier_models, mix.tolist())
            self.merges.append((group_id, float(mix[group_id])))
        else:
            factor = staleness_factor(
                self.version - base_version,
                function=self.config.staleness,
                a=self.config.staleness_a,
            )
            self.global_weights = fedasync_mix(
                self.global_weights, weights, self.config.inter_group_alpha, factor
            )
            self.merges.append((group_id, self.config.inter_group_alpha * factor))
        self.version += 1

    def _handle_latency(self, client_id: int, latency_s: float) -> list[TrainTask]:
        # a moved client that is training finishes its task for the round it was given:
        # only future selections follow the new membership
        change = self.grouping.observe_latency(client_id, latency_s)
        if change is None:
            return []
        self.changes[change.kind] += 1
        return self._start_idle_groups()

    def _handle_silence(self, client_id: int, waited_s: float) -> list[TrainTask]:
        change = self.grouping.drop_silent(client_id, waited_s)
        if change is None:
            return []
        self.changes[change.kind] += 1
        return self._start_idle_groups()

    def _handle_join(self, profile: ClientProfile) -> list[TrainTask]:
        change = self.grouping.add_client(profile)
        self.changes[change.kind] += 1
        return self._start_idle_groups()

    def probe_candidates(self) -> list[int]:
        policy = self.grouping.policy
        if policy.mode != "eco" or not policy.dynamic:
            return []  # nothing re-admits a dropped client: its latency decides nothing
        return sorted(c for c in self.grouping.dropped if c not in self.busy)

    def is_dropped(self, client_id: int) -> bool:
        return client_id in self.grouping.dropped

    def stats(self) -> dict[str, float | int]:
        return {
            **super().stats(),
            "groups": len(self.grouping.groups),
            "initial_mean_js": self.initial_mean_js,
            "initial_mean_group_latency_s": self.initial_mean_group_latency,
            "initial_dropped": self.initial_dropped,
            "mean_js": self.grouping.mean_js(),
            "mean_group_latency_s": self.grouping.mean_group_latency(),
            "dropped_now": len(self.grouping.dropped),
            **{f"clients_{kind}": n for kind, n in self.changes.items()},
        }


def _policy_for(config: ServerConfig) -> GroupingPolicy:
    policy = config.grouping
    if config.method == "ecofl":
        return replace(policy, mode="eco", dynamic=True)
    if config.method == "ecofl-nodg":
        return replace(policy, mode="eco", dynamic=False)
    if config.method == "fedat":
        return replace(policy, mode="latency", dynamic=False)
    if config.method == "astraea":
        return replace(policy, mode="data", dynamic=False)
    raise ConfigError(f"method {config.method!r} does not group clients")


def make_server(
    profiles: Sequence[ClientProfile], initial_weights: FloatArray, config: ServerConfig
) -> FederatedServer:
    """The server of ``config.method``; all share :class:`FederatedServer`'s calls."""
    if config.method == "fedavg":
        return FedAvgServer(profiles, initial_weights, config)
    if config.method == "fedasync":
        return FedAsyncServer(profiles, initial_weights, config)
    return HierarchicalServer(profiles, initial_weights, config)
