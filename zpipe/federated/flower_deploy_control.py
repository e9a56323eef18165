"""Eco-FL's decisions on Flower's deployment engine, in wall-clock time (sans-IO).

On a SuperLink the clients are real SuperNodes and time is the wall clock:
a client's response latency L_n is the round trip of its last task or
profiling, measured by the server, as fl-server measures it. The server
object (:mod:`zpipe.federated.server`: grouping by eq. 4 with the RT^g
thresholds, Algorithm 1, drop-out, FedProx inside groups, FedAsync between
groups, and the baselines) decides who trains what; :class:`DeployController`
decides what the Flower shell (:mod:`zpipe.federated.flower_deploy`) has no
view of: which SuperNode is which client, when a task or a profiling has
timed out, which dropped clients to profile again, when the run ends. It
never touches Flower or a clock: the shell feeds it the time and what came
back, and carries out the commands it returns:

- :class:`SendProfile`: Eco-FL's profiling of a SuperNode (a ``query``
  message; the client answers after the work of a small task, so the round
  trip is its latency, as a task's is). The shell profiles every SuperNode it
  sees; the controller profiles again the clients that Eco-FL dropped out
  (``probe_candidates``: no task measures them);
- :class:`SendTrain`: a task (a ``train`` message) to a client's SuperNode;
- :class:`Event`: a line of the run's event log (registered, dropped,
  readmitted, update, eval, ...), for people and tests.

A SuperNode that dies mid-task leaves its task unanswered: at the deadline
(or at Flower's error reply, whichever comes first) the client is silent, so
Eco-FL drops it out of its group and the group's round goes on without it.
A SuperNode that starts again registers under a new node id; its profiling
names the same client (its ``partition-id``), whose measured latency then
re-admits it (Algorithm 1) when it fits a group's range. A task still
outstanding on the node it replaced is lost: it fails at once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from zpipe._errors import ConfigError, ProtocolError
from zpipe.federated.grouping import ClientProfile
from zpipe.federated.server import (
    METHODS,
    ClientUpdate,
    FederatedServer,
    HierarchicalServer,
    TrainTask,
    make_server,
)

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class DeploySettings:
    """One deployment run's settings: Flower's run config (``--run-config``), read
    alike by the ServerApp and every ClientApp (key ``task-timeout-s`` is field
    ``task_timeout_s``)."""

    method: str = "ecofl"
    clients: int = 3  # SuperNodes profiled before the run starts (partition-id 0..clients-1)
    n_groups: int = 1
    max_concurrent: int = 3  # K
    lam: float = 10.0
    rt_factor: float = 1.0
    # RT^g is at least this fraction of the group's centre: on one machine the wall-clock
    # latencies of identical homes differ by a few percent, so a floor of 1.0 keeps them
    # in one range (fl-server's --rt-floor 0.1 dropped fast clients here)
    rt_floor_fraction: float = 1.0
    alpha: float = 0.6
    mu: float = 0.05
    local_steps: int = 10
    batch_size: int = 10
    lr: float = 0.1
    hidden: int = 32
    samples_per_client: int = 100
    partition: str = "niid"
    seed: int = 0
    stages: int = 2  # pipeline stage processes of each client (its home's devices)
    probe_steps: int = 1  # SGD steps of a profiling's work
    max_updates: int = 4  # global model updates that end the run
    duration_s: float = 600.0
    nodes_timeout_s: float = 120.0  # for ``clients`` SuperNodes to be profiled
    task_timeout_s: float = 60.0
    profile_timeout_s: float = 60.0
    probe_interval_s: float = 5.0  # between profilings of a dropped client
    eval_every: int = 1  # global updates between evaluations
    events_path: str = ""  # a JSON-lines log of the run's events ("" none)
    result_path: str = ""  # the run's result as JSON ("" none)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"method {self.method!r} is not one of {METHODS}")
        counts = (self.clients, self.max_concurrent, self.local_steps, self.batch_size)
        if min(counts) < 1 or min(self.max_updates, self.eval_every, self.probe_steps) < 1:
            raise ConfigError("client counts, steps, updates and eval-every must be >= 1")
        if not 1 <= self.stages <= 2:
            raise ConfigError("stages must be 1 or 2 (the federated MLP has two layers)")
        timeouts = (
            self.duration_s,
            self.nodes_timeout_s,
            self.task_timeout_s,
            self.profile_timeout_s,
        )
        if not all(t > 0 and math.isfinite(t) for t in timeouts):
            raise ConfigError("the duration and every timeout must be finite and > 0")
        if not (self.probe_interval_s >= 0 and math.isfinite(self.probe_interval_s)):
            raise ConfigError("probe-interval-s must be finite and >= 0")

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> DeploySettings:
        """The settings a run config names; keys it leaves out keep their defaults."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in run_config.items():
            name = key.replace("-", "_")
            if name not in fields:
                raise ConfigError(f"run config key {key!r} is not a setting of the run")
            default = getattr(cls, name)
            if isinstance(default, bool) or isinstance(value, bool):
                raise ConfigError(f"run config key {key!r} is {value!r}")
            if isinstance(default, float) and isinstance(value, int | float):
                values[name] = float(value)
            elif isinstance(value, type(default)):
                values[name] = value
            else:
                raise ConfigError(
                    f"run config key {key!r} is {value!r}, not a {type(default).__name__}"
                )
        return cls(**values)

    def run_config(self) -> dict[str, Any]:
        """The run config that names these settings (Flower's ``--run-config`` keys)."""
        return {f.name.replace("_", "-"): getattr(self, f.name) for f in dataclasses.fields(self)}


# ------------------------------------------------------------------- commands


@dataclass(frozen=True)
class SendProfile:
    node_id: int


@dataclass(frozen=True)
class SendTrain:
    node_id: int
    task: TrainTask


@dataclass(frozen=True)
class Event:
    fields: Mapping[str, Any]


Command = SendProfile | SendTrain | Event


@dataclass
class _Outstanding:
    client_id: int
    node_id: int
    sent_at: float


@dataclass
class _Log:
    events: list[dict[str, Any]] = field(default_factory=list)
    curve: list[tuple[int, float]] = field(default_factory=list)  # (version, accuracy)
    updates: int = 0
    failed_tasks: int = 0


class DeployController:
    """Registration, then the server object's tasks, against the wall clock."""

    def __init__(
        self,
        settings: DeploySettings,
        server_factory: Callable[[Sequence[ClientProfile]], FederatedServer],
        evaluate: Callable[[FloatArray], float],
    ) -> None:
        self.settings = settings
        self._server_factory, self._evaluate_fn = server_factory, evaluate
        self.server: FederatedServer | None = None
        self.node_of: dict[int, int] = {}  # client id -> its SuperNode now
        self.client_of: dict[int, int] = {}  # node id -> client id (every node that answered)
        self.pending_profiles: dict[int, ClientProfile] = {}  # before the start
        self.reason = ""
        self.log = _Log()
        self._tasks: dict[int, _Outstanding] = {}
        self._profiling: dict[int, float] = {}  # node id -> sent at
        self._profile_ended: dict[int, float] = {}  # client id -> last profiling's end
        self._first_seen: float | None = None
        self._end_at = math.inf
        self._online: set[int] | None = None  # None: not told, every node may be

    def set_online(self, node_ids: Iterable[int]) -> None:
        """The SuperNodes the SuperLink lists as online: a dropped client whose node
        is not among them is not profiled (Flower would answer at once that the node
        is unavailable) until its node, or a new one of its, is listed."""
        self._online = {int(n) for n in node_ids}

    # ---------------------------------------------------------------- helpers

    def _event(self, now: float, kind: str, **fields: Any) -> Event:
        event = {"event": kind, "t": round(now, 3), **fields}
        self.log.events.append(event)
        return Event(event)

    def _running(self) -> FederatedServer:
        if self.server is None:
            raise ConfigError("the deployment run has not started")
        return self.server

    @property
    def started(self) -> bool:
        return self.server is not None

    def profiling(self, node_id: int) -> bool:
        return node_id in self._profiling

    # ----------------------------------------------------------------- profiling

    def profile(self, node_id: int, now: float) -> list[Command]:
        """Profile a SuperNode the shell sees (a new one, or one that did not answer
        yet); nothing while one profiling of it is out."""
        if node_id in self._profiling:
            return []
        if self._first_seen is None:
            self._first_seen = now
        self._profiling[node_id] = now
        return [SendProfile(node_id)]

    def on_profile(
        self, node_id: int, client_id: int, label_counts: Sequence[int], now: float
    ) -> list[Command]:
        """A SuperNode answered its profiling as client ``client_id``; the round trip
        is the client's latency."""
        sent_at = self._profiling.pop(node_id, None)
        if sent_at is None:
            raise ProtocolError(f"node {node_id} answered a profiling that is not out")
        latency = max(0.0, now - sent_at)
        known = self.client_of.get(node_id)
        if known is not None and known != client_id:
            raise ProtocolError(f"node {node_id} was client {known}, now says {client_id}")
        previous = self.node_of.get(client_id)
        if previous is not None and previous != node_id and previous in self._profiling:
            # the old node of a client that came back: its profiling will not come back
            del self._profiling[previous]
        self.client_of[node_id] = client_id
        self.node_of[client_id] = node_id
        self._profile_ended[client_id] = now
        profile = ClientProfile(client_id, latency, tuple(int(c) for c in label_counts))
        if self.server is None:
            self.pending_profiles[client_id] = profile
            return [
                self._event(now, "registered", client=client_id, node=node_id, latency_s=latency)
            ]
        server = self.server
        commands: list[Command] = []
        if previous is not None and previous != node_id:
            commands.append(self._event(now, "rejoined", client=client_id, node=node_id))
            for task_id in [t for t, o in self._tasks.items() if o.client_id == client_id]:
                commands += self._fail(server, task_id, now, "node replaced")
        if client_id not in server.profiles:
            commands.append(self._event(now, "joined", client=client_id, latency_s=latency))
            return [*commands, *self._dispatch(server.add_client(profile), now)]
        return [*commands, *self._observe(server, client_id, latency, now)]

    def on_profile_failed(self, node_id: int, now: float) -> list[Command]:
        """A profiling came back as an error, or timed out: a lower bound of the
        client's latency (a dropped client stays dropped), or an unknown node."""
        sent_at = self._profiling.pop(node_id, None)
        if sent_at is None:
            return []
        client_id = self.client_of.get(node_id)
        commands: list[Command] = [
            self._event(now, "profile_failed", node=node_id, client=client_id)
        ]
        if client_id is None or self.node_of.get(client_id) != node_id:
            return commands  # a node that never answered, or one its client left
        self._profile_ended[client_id] = now
        server = self.server
        if server is None or client_id not in server.profiles:
            return commands
        waited = max(now - sent_at, 0.0)
        return [*commands, *self._silent(server, client_id, waited, now)]

    # ------------------------------------------------------------------ the run

    def ready(self, now: float) -> bool:
        """Whether the run can start: every expected client profiled, or the nodes'
        deadline passed with at least one."""
        if len(self.pending_profiles) >= self.settings.clients:
            return True
        waited = 0.0 if self._first_seen is None else now - self._first_seen
        return bool(self.pending_profiles) and waited >= self.settings.nodes_timeout_s

    def start(self, now: float) -> list[Command]:
        if self.server is not None:
            raise ConfigError("the deployment run has already started")
        if not self.pending_profiles:
            raise ConfigError("no SuperNode answered its profiling")
        profiles = [self.pending_profiles[c] for c in sorted(self.pending_profiles)]
        server = self._server_factory(profiles)
        self.server = server
        self._end_at = now + self.settings.duration_s
        groups = (
            [server.grouping.members_of(g.group_id) for g in server.grouping.groups]
            if isinstance(server, HierarchicalServer)
            else []
        )
        dropped = sorted(c for c in server.profiles if server.is_dropped(c))
        commands: list[Command] = [
            self._event(now, "started", clients=len(profiles), groups=groups, dropped=dropped),
            self._evaluate(server, now),
        ]
        return [*commands, *self._dispatch(server.start(), now)]

    def on_train_reply(
        self, task_id: int, weights: FloatArray | None, n_samples: int, now: float
    ) -> list[Command]:
        """A task's reply: trained weights, or ``None`` (Flower's error reply)."""
        server = self._running()
        outstanding = self._tasks.get(task_id)
        if outstanding is None:
            return []  # it failed already (deadline, or its node was replaced)
        if weights is None:
            return self._fail(server, task_id, now, "error reply")
        update = ClientUpdate(task_id, outstanding.client_id, weights, n_samples)
        before = server.version
        try:
            tasks = server.on_update(update)
        except ProtocolError as exc:
            event = self._event(now, "bad_update", task=task_id, error=str(exc))
            return [event, *self._fail(server, task_id, now, "bad update")]
        del self._tasks[task_id]
        self.log.updates += 1
        latency = max(now - outstanding.sent_at, 0.0)
        commands: list[Command] = [
            self._event(
                now,
                "update",
                task=task_id,
                client=outstanding.client_id,
                latency_s=round(latency, 3),
                version=server.version,
            )
        ]
        commands += self._evaluate_if_due(server, before, now)
        commands += self._dispatch(tasks, now)
        return [*commands, *self._observe(server, outstanding.client_id, latency, now)]

    def tick(self, now: float) -> tuple[list[Command], bool]:
        """Time passed: tasks and profilings past their deadline, dropped clients due
        for a profiling; and whether the run ends here (:attr:`reason` says why)."""
        server = self._running()
        if server.version >= self.settings.max_updates:
            self.reason = "updates"
            return [], True
        if now >= self._end_at:
            self.reason = "duration"
            return [], True
        commands: list[Command] = []
        late = [
            t for t, o in self._tasks.items() if now - o.sent_at >= self.settings.task_timeout_s
        ]
        for task_id in late:
            commands += self._fail(server, task_id, now, "timed out")
        for node_id in [
            n for n, at in self._profiling.items() if now - at >= self.settings.profile_timeout_s
        ]:
            commands += self.on_profile_failed(node_id, now)
        commands += self._probe_dropped(server, now)
        # with probing off, a dropped client can never be re-admitted: it does not
        # keep the run alive
        probing = self.settings.probe_interval_s > 0 and server.probe_candidates()
        if not self._tasks and not self._profiling and not probing:
            self.reason = "nothing to dispatch"
            return commands, True
        return commands, False

    def finish(self, now: float) -> list[Command]:
        server = self._running()
        commands: list[Command] = []
        if not self.log.curve or self.log.curve[-1][0] != server.version:
            commands.append(self._evaluate(server, now))
        commands.append(self._event(now, "finished", reason=self.reason, version=server.version))
        return commands

    def outstanding_tasks(self) -> dict[int, int]:
        """Task id -> the node it was sent to."""
        return {t: o.node_id for t, o in self._tasks.items()}

    # ------------------------------------------------------------------ internals

    def _evaluate(self, server: FederatedServer, now: float) -> Event:
        accuracy = float(self._evaluate_fn(server.global_weights))
        self.log.curve.append((server.version, accuracy))
        return self._event(now, "eval", version=server.version, accuracy=round(accuracy, 4))

    def _evaluate_if_due(self, server: FederatedServer, before: int, now: float) -> list[Command]:
        every = self.settings.eval_every
        return [self._evaluate(server, now)] if server.version // every > before // every else []

    def _dispatch(self, tasks: Sequence[TrainTask], now: float) -> list[Command]:
        commands: list[Command] = []
        for task in tasks:
            node = self.node_of[task.client_id]
            self._tasks[task.task_id] = _Outstanding(task.client_id, node, now)
            commands.append(
                self._event(now, "dispatched", task=task.task_id, client=task.client_id, node=node)
            )
            commands.append(SendTrain(node, task))
        return commands

    def _fail(self, server: FederatedServer, task_id: int, now: float, why: str) -> list[Command]:
        outstanding = self._tasks.pop(task_id)
        self.log.failed_tasks += 1
        client = outstanding.client_id
        commands: list[Command] = [
            self._event(now, "task_failed", task=task_id, client=client, why=why)
        ]
        # the silence first: a client that it drops out must not be picked again by the
        # new round its failure may start (fl-server's controller does the same)
        commands += self._silent(server, client, max(now - outstanding.sent_at, 0.0), now)
        before = server.version
        tasks = server.on_task_failed(task_id)  # may end a round: a merge without it
        commands += self._evaluate_if_due(server, before, now)
        return [*commands, *self._dispatch(tasks, now)]

    def _silent(
        self, server: FederatedServer, client_id: int, waited_s: float, now: float
    ) -> list[Command]:
        was_dropped = server.is_dropped(client_id)
        tasks = server.observe_silence(client_id, waited_s)
        commands: list[Command] = []
        if server.is_dropped(client_id) and not was_dropped:
            commands.append(
                self._event(now, "dropped", client=client_id, waited_s=round(waited_s, 3))
            )
        return [*commands, *self._dispatch(tasks, now)]

    def _observe(
        self, server: FederatedServer, client_id: int, latency_s: float, now: float
    ) -> list[Command]:
        was_dropped = server.is_dropped(client_id)
        tasks = server.observe_latency(client_id, latency_s)
        commands: list[Command] = []
        if server.is_dropped(client_id) != was_dropped:
            kind = "readmitted" if was_dropped else "dropped"
            commands.append(self._event(now, kind, client=client_id, latency_s=round(latency_s, 3)))
        return [*commands, *self._dispatch(tasks, now)]

    def _probe_dropped(self, server: FederatedServer, now: float) -> list[Command]:
        if self.settings.probe_interval_s <= 0:
            return []
        commands: list[Command] = []
        for client_id in server.probe_candidates():
            node = self.node_of.get(client_id)
            ended = self._profile_ended.get(client_id, -math.inf)
            if node is None or node in self._profiling:
                continue
            if self._online is not None and node not in self._online:
                continue
            if now - ended < self.settings.probe_interval_s:
                continue
            commands += self.profile(node, now)
        return commands


def make_deploy_server(
    settings: DeploySettings, initial_weights: FloatArray
) -> Callable[[Sequence[ClientProfile]], FederatedServer]:
    """The server object of ``settings.method`` over the profiled clients."""
    from zpipe.federated.simulate import SimConfig, server_config

    config = server_config(
        SimConfig(
            method=settings.method,
            n_clients=settings.clients,
            n_groups=settings.n_groups,
            max_concurrent=settings.max_concurrent,
            lam=settings.lam,
            rt_factor=settings.rt_factor,
            rt_floor_fraction=settings.rt_floor_fraction,
            alpha=settings.alpha,
            seed=settings.seed,
        )
    )
    return lambda profiles: make_server(profiles, initial_weights, config)
