"""Eco-FL's server as a Flower ``ServerApp`` and zpipe's clients as a ``ClientApp``.

Both speak Flower's Message API (``flwr >= 1.20``): the ServerApp pushes
messages to the SuperNodes through its ``Grid`` and pulls their replies; the
ClientApp answers ``query`` (Eco-FL's profiling) and ``train`` messages.
Every decision (K-means plus eq. 4 grouping with the RT^g thresholds,
drop-out, Algorithm 1's regrouping, FedProx inside groups, FedAsync with
staleness between groups, and the baselines) is made by the same pure code as
fl-sim's: :func:`zpipe.federated.server.make_server` driven by
:class:`zpipe.federated.virtual_time.VirtualClock`. The ServerApp is only its
shell.

How the asynchronous groups map onto Flower's engine. Flower moves messages;
it has no notion of time, and its simulation runs as fast as the machine
does. Eco-FL's asynchrony lives in simulated time, as in fl-sim: a task sent
at time t completes at t + L_n * jitter, L_n being the latency the client
reported when it was last profiled. The ServerApp sends each task the moment
the server hands it out (so up to K clients train at once on Flower's
workers) and merges results in order of simulated completion: it waits for a
reply only when that task's completion is the next event. A group whose
members' latencies have elapsed reports; the global model takes each group
model when it arrives, weighted by alpha * s(staleness). For one seed the
run takes fl-sim's decisions exactly and reaches its weights.

A client's data and latency: client ``partition-id`` of the run holds
fl-sim's shard ``partition-id`` of the same seed and answers a profiling with
its latency after the tick's degree changes (``SimConfig``'s dynamic
setting), which it replays from the seed. ``failing_clients`` emulate homes
that go down: they answer the first profiling, then raise on every message;
the server drops them out of their groups when their task fails.

:func:`run_flower_simulation` runs both on ``flwr.simulation.run_simulation``
(Ray) and returns the run's results. Flower is optional:
``pip install 'zpipe[flower]'``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from zpipe._errors import ConfigError, ProtocolError
from zpipe.devices import single_threaded_blas
from zpipe.federated.flower_messages import (
    PROFILE,
    TRAIN,
    FlowerProfileReply,
    FlowerProfileRequest,
    TrainReply,
    TrainRequest,
)
from zpipe.federated.grouping import ClientProfile
from zpipe.federated.model import MLPShape, accuracy
from zpipe.federated.server import HierarchicalServer, TrainTask, make_server
from zpipe.federated.simulate import (
    Federation,
    SimConfig,
    build_federation,
    clock_config,
    initial_weights,
    run_result,
    server_config,
    train_task,
)
from zpipe.federated.virtual_time import Finished, NeedProfiles, NeedResult, VirtualClock
from zpipe.lossy.data import Dataset, load_digits_dataset

log = logging.getLogger(__name__)

POLL_S = 0.02  # between pulls of the replies: short, the engine answers in milliseconds


@dataclass(frozen=True)
class FlowerSettings:
    sim: SimConfig = field(default_factory=SimConfig)
    failing_clients: frozenset[int] = frozenset()
    reply_timeout_s: float = 300.0  # wall clock: a reply later than this is a failure
    nodes_timeout_s: float = 120.0  # wall clock: for every SuperNode to be registered
    # profiling messages in flight at once: Flower's in-memory link state scans every
    # undelivered or unanswered message for each node it serves (nodes x messages per
    # sweep), so 300 at once took 46 s on two cores and waves of 50 take a few
    profile_batch: int = 50

    def __post_init__(self) -> None:
        if not (self.reply_timeout_s > 0 and self.nodes_timeout_s > 0):
            raise ConfigError("the reply and node timeouts must be > 0")
        if self.profile_batch < 1:
            raise ConfigError("profile_batch must be at least 1")
        outside = sorted(c for c in self.failing_clients if not 0 <= c < self.sim.n_clients)
        if outside:
            raise ConfigError(f"failing clients {outside} are not clients of the run")


# -- the clients -------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _dataset() -> Dataset:
    return load_digits_dataset()


@dataclass
class _World:
    """One worker process's replay of the seed's federation (shards and degrees)."""

    federation: Federation
    tick: int = 0


_worlds: dict[SimConfig, _World] = {}


def _shards_of(config: SimConfig) -> Federation:
    """The federation as it is now in this worker (its shards never change)."""
    world = _worlds.get(config)
    return world.federation if world is not None else _world_at(config, 0)


def _world_at(config: SimConfig, tick: int) -> Federation:
    world = _worlds.get(config)
    if world is None or world.tick > tick:
        # a fresh replay: a new run, or a worker that saw a later tick of an older one
        world = _World(build_federation(config, _dataset()))
        _worlds.clear()
        _worlds[config] = world
    while world.tick < tick:
        world.federation.change_degrees(config.degrees, config.change_prob)
        world.tick += 1
    return world.federation


def make_client_app(settings: FlowerSettings) -> Any:
    """A ``flwr.clientapp.ClientApp``: client ``partition-id`` of fl-sim's federation."""
    from flwr.app import Context, Message
    from flwr.clientapp import ClientApp

    config = settings.sim
    app = ClientApp()

    def client_id_of(context: Context) -> int:
        client_id = int(context.node_config["partition-id"])
        if not 0 <= client_id < config.n_clients:
            raise ConfigError(f"partition-id {client_id} is not a client of the run")
        return client_id

    @app.query()
    def profile(msg: Message, context: Context) -> Message:
        client_id = client_id_of(context)
        request = FlowerProfileRequest.from_content(msg.content)
        if client_id in settings.failing_clients and request.tick > 0:
            raise ConnectionError(f"client {client_id} is down (emulated)")
        federation = _world_at(config, request.tick)
        reply = FlowerProfileReply(
            client_id,
            federation.latency(client_id),
            federation.shards[client_id].label_counts(federation.n_classes),
        )
        return Message(reply.to_content(), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        client_id = client_id_of(context)
        if client_id in settings.failing_clients:
            raise ConnectionError(f"client {client_id} is down (emulated)")
        request = TrainRequest.from_content(msg.content)
        if request.client_id != client_id:
            raise ProtocolError(f"task {request.task_id} is for client {request.client_id}")
        dataset = _dataset()
        shape = MLPShape(dataset.n_features, config.hidden, dataset.n_classes)
        shard = _shards_of(config).shards[client_id]
        task = TrainTask(request.task_id, client_id, request.weights, 0)
        started = time.perf_counter()
        with single_threaded_blas():
            weights = train_task(config, shape, shard, task)
        reply = TrainReply(task.task_id, weights, len(shard.y), time.perf_counter() - started)
        return Message(reply.to_content(), reply_to=msg)

    return app


# -- the server --------------------------------------------------------------------------


class _Mailbox:
    """Messages pushed through the Grid and their replies, pulled with deadlines."""

    def __init__(self, grid: Any, timeout_s: float) -> None:
        self.grid, self.timeout_s = grid, timeout_s
        self.replies: dict[str, Any] = {}  # message id -> reply
        self.pending: set[str] = set()

    def push(self, messages: list[Any]) -> list[str]:
        ids = [str(i) for i in self.grid.push_messages(messages)]
        self.pending.update(ids)
        return ids

    def _pull(self) -> None:
        for reply in self.grid.pull_messages(list(self.pending)):
            msg_id = reply.metadata.reply_to_message_id
            self.pending.discard(msg_id)
            self.replies[msg_id] = reply

    def wait(self, ids: Iterable[str]) -> dict[str, Any]:
        """The replies to ``ids`` (an error reply counts); missing ones after the
        deadline are left out."""
        wanted = set(ids)
        deadline = time.monotonic() + self.timeout_s
        while True:
            if not wanted <= self.replies.keys():
                self._pull()
            if wanted <= self.replies.keys() or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        self.pending -= wanted  # a late reply is not waited for again
        return {i: self.replies.pop(i) for i in wanted if i in self.replies}


class EcoFLServerApp:
    """The ServerApp (``.app``); after the run, ``.result`` holds what fl-sim reports
    plus the final weights, the initial groups and every task handed out."""

    def __init__(self, settings: FlowerSettings) -> None:
        from flwr.serverapp import ServerApp

        self.settings = settings
        self.result: dict[str, Any] | None = None
        self.app = ServerApp()
        self.app.main()(self._main)

    def _main(self, grid: Any, context: Any) -> None:
        with single_threaded_blas():
            self.result = self._run(grid)

    def _nodes(self, grid: Any) -> list[int]:
        deadline = time.monotonic() + self.settings.nodes_timeout_s
        while True:
            nodes = sorted(int(n) for n in grid.get_node_ids())
            if len(nodes) >= self.settings.sim.n_clients or time.monotonic() >= deadline:
                return nodes
            time.sleep(POLL_S)

    def _profile(
        self, box: _Mailbox, nodes: Iterable[int], tick: int
    ) -> dict[int, FlowerProfileReply]:
        from flwr.app import Message

        node_list = list(nodes)
        content = FlowerProfileRequest(tick).to_content()
        ids: list[str] = []
        replies: dict[str, Any] = {}
        step = self.settings.profile_batch
        for start in range(0, len(node_list), step):
            wave = box.push(
                [
                    Message(content, n, PROFILE, ttl=self.settings.reply_timeout_s)
                    for n in node_list[start : start + step]
                ]
            )
            ids += wave
            replies.update(box.wait(wave))
        profiles: dict[int, FlowerProfileReply] = {}
        for node, msg_id in zip(node_list, ids, strict=True):
            reply = replies.get(msg_id)
            if reply is None or reply.has_error():
                continue  # silent at a tick: it keeps its last latency (or is not in the run)
            try:
                profile = FlowerProfileReply.from_content(reply.content)
            except ProtocolError as exc:
                log.warning("node %d: bad profile reply: %s", node, exc)
                continue
            profiles[profile.client_id] = profile
            self._node_of[profile.client_id] = node
        return profiles

    def _send(self, box: _Mailbox, tasks: list[TrainTask]) -> None:
        from flwr.app import Message

        for task in tasks:
            request = TrainRequest(task.task_id, task.client_id, task.weights)
            msg = Message(
                request.to_content(),
                self._node_of[task.client_id],
                TRAIN,
                ttl=self.settings.reply_timeout_s,
            )
            (self._message_of[task.task_id],) = box.push([msg])
            self.dispatch_log.append((task.task_id, task.client_id, task.version))

    def _result_of(self, box: _Mailbox, task: TrainTask) -> tuple[Any, int]:
        msg_id = self._message_of.pop(task.task_id)
        reply = box.wait([msg_id]).get(msg_id)
        if reply is None or reply.has_error():
            return None, 0
        try:
            trained = TrainReply.from_content(reply.content)
        except ProtocolError as exc:
            log.warning("client %d: bad train reply: %s", task.client_id, exc)
            return None, 0
        if trained.task_id != task.task_id:
            log.warning(
                "client %d answered task %d for %d", task.client_id, trained.task_id, task.task_id
            )
            return None, 0
        self.train_s += trained.train_s
        return trained.weights, trained.n_samples

    def _run(self, grid: Any) -> dict[str, Any]:
        started = time.perf_counter()
        config = self.settings.sim
        self._node_of: dict[int, int] = {}
        self._message_of: dict[int, str] = {}
        self.dispatch_log: list[tuple[int, int, int]] = []
        self.train_s = 0.0
        box = _Mailbox(grid, self.settings.reply_timeout_s)
        nodes = self._nodes(grid)
        replies = self._profile(box, nodes, 0)
        profiled_s = time.perf_counter() - started
        if not replies:
            raise ConfigError("no SuperNode answered the profiling")
        profiles = [
            ClientProfile(c, r.latency_s, r.label_counts) for c, r in sorted(replies.items())
        ]
        dataset = _dataset()
        shape = MLPShape(dataset.n_features, config.hidden, dataset.n_classes)
        server = make_server(profiles, initial_weights(config, shape), server_config(config))
        initial_groups = (
            [server.grouping.members_of(g.group_id) for g in server.grouping.groups]
            if isinstance(server, HierarchicalServer)
            else []
        )
        evaluate: Callable[[Any], float] = lambda w: accuracy(  # noqa: E731
            w, shape, dataset.x_test, dataset.y_test
        )
        clock = VirtualClock(
            server,
            {p.client_id: p.latency_s for p in profiles},
            clock_config(config),
            evaluate=evaluate,
        )
        self._send(box, clock.take_dispatched())
        while True:
            match clock.advance():
                case Finished():
                    break
                case NeedProfiles(tick=tick):
                    answered = self._profile(box, sorted(self._node_of.values()), tick)
                    latencies = {
                        c: r.latency_s for c, r in answered.items() if c in server.profiles
                    }
                    self._send(box, clock.on_profiles(latencies))
                case NeedResult(task=task):
                    weights, n = self._result_of(box, task)
                    self._send(box, clock.on_result(weights, n))
        return run_result(
            config,
            clock,
            started,
            engine="flower-simulation",
            clients_profiled=len(profiles),
            profiling_wall_s=round(profiled_s, 3),
            client_train_wall_s=round(self.train_s, 3),
            failed_tasks=clock.log.failed_tasks,
            initial_groups=initial_groups,
            dropped=sorted(c for c in server.profiles if server.is_dropped(c)),
            dispatch_log=self.dispatch_log,
            weights=server.global_weights.tolist(),
        )


def backend_config(*, num_cpus: int = 2, client_cpus: float = 1.0) -> dict[str, Any]:
    """Ray's settings for a small machine: ``num_cpus // client_cpus`` worker processes,
    a small object store (weights are a few kB), no dashboard, quiet logs."""
    return {
        "client_resources": {"num_cpus": client_cpus, "num_gpus": 0.0},
        "init_args": {
            "num_cpus": num_cpus,
            "object_store_memory": 80 * 1024 * 1024,
            "include_dashboard": False,
            "log_to_driver": False,
            "logging_level": logging.ERROR,
        },
    }


def run_flower_simulation(
    settings: FlowerSettings, *, backend: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Eco-FL (or the baseline ``settings.sim.method``) over ``n_clients`` SuperNodes
    in Flower's simulation engine; the ServerApp's result."""
    try:
        from flwr.simulation import run_simulation
    except ImportError as exc:
        raise ConfigError(
            "Flower's simulation needs flwr[simulation]: pip install 'zpipe[flower]'"
        ) from exc
    server = EcoFLServerApp(settings)
    run_simulation(
        server_app=server.app,
        client_app=make_client_app(settings),
        num_supernodes=settings.sim.n_clients,
        backend_config=backend if backend is not None else backend_config(),
    )
    if server.result is None:
        raise ConfigError("the Flower simulation ended before the ServerApp finished (see its log)")
    return server.result
