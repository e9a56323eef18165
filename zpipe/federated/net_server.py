"""``python -m zpipe fl-server``: the federated server over zpipe's transport.

A thin I/O shell around the same sans-IO server object fl-sim drives
(:mod:`zpipe.federated.server`): it turns messages and timeouts into the
object's calls and its :class:`TrainTask` answers into messages; it decides
nothing itself (``--trace`` records every input, and
:func:`zpipe.federated.net_trace.replay` reproduces every decision)::

    fl_register from N clients (label counts and a profiled latency, never samples)
        -> ClientProfiles -> make_server(...).start() -> fl_task to each chosen client
    fl_update     -> on_update(), then observe_latency(client, measured round trip)
    no fl_update within --task-timeout -> observe_latency(client, --task-timeout), then
                     on_task_failed(): the timeout is a lower bound of its latency, which
                     puts a silent client out of its group's range (a drop-out) before the
                     failure can start a round that would pick it again

    a dropped client (Eco-FL) -> fl_probe every --probe-interval s; its round trip
                     -> observe_latency(): Algorithm 1 re-admits it once it fits a range
    fl_register after the start -> add_client() (eq. 4 association), then its tasks

The run ends after ``--updates`` global model updates, after ``--duration``
seconds, or when nothing is in flight and nothing can be dispatched or probed. Every
wait has a deadline; a message that does not decode, does not fit its kind,
comes from an unregistered peer or names a task that is not the sender's is
dropped (counted, logged) and the server goes on. With ``--keys DIR`` the
socket is a CurveZMQ server whose allow-list is every ``NAME.key`` in DIR but
its own (``fl-server``), and whose ``roles.txt`` decides which keys may act as
fl clients (:mod:`zpipe.federated.net_admission`).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import zmq
import zmq.asyncio

from zpipe._errors import (
    ConfigError,
    PeerGoneError,
    ProtocolError,
    RoleError,
    TransportTimeout,
)
from zpipe.federated.grouping import ClientProfile
from zpipe.federated.model import MLPShape, accuracy, init_weights
from zpipe.federated.net_admission import SenderRoles, profile_from_register
from zpipe.federated.net_trace import config_to_json, dispatch_events
from zpipe.federated.net_wire import SERVER_KEY_NAME, weights_from, weights_tensor
from zpipe.federated.probing import ProbeResult, ProbeSchedule
from zpipe.federated.server import (
    ClientUpdate,
    FederatedServer,
    ServerConfig,
    TrainTask,
    make_server,
)
from zpipe.log import get_logger
from zpipe.lossy.data import Dataset
from zpipe.protocol import REGISTRY, WireMessage
from zpipe.protocol.federated import (
    FlDone,
    FlError,
    FlProbe,
    FlProbeReply,
    FlRegister,
    FlTask,
    FlUpdate,
    FlWelcome,
)
from zpipe.transport import security
from zpipe.transport.sockets import (
    SocketOptions,
    bind_endpoint,
    decode_frames,
    new_context,
    open_socket,
    recv_frames,
    send,
)

log = get_logger("zpipe.federated.server")

MAX_MESSAGE_BYTES = 64 << 20


@dataclass(frozen=True)
class NetServerConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    bind: str = "tcp://127.0.0.1:0"
    clients: int = 3  # registrations awaited before the run starts
    hidden: int = 32
    local_steps: int = 10
    batch_size: int = 10
    lr: float = 0.1
    mu: float = 0.05
    seed: int = 0
    register_timeout_s: float = 60.0
    task_timeout_s: float = 30.0
    probe_interval_s: float = 5.0  # 0: never probe dropped clients
    probe_timeout_s: float = 30.0
    send_timeout_s: float = 5.0
    max_updates: int = 50
    duration_s: float = 600.0
    eval_every: int = 5  # global updates between evaluations
    keys_dir: Path | None = None
    key_name: str = SERVER_KEY_NAME
    trace: Path | None = None

    def __post_init__(self) -> None:
        if self.clients < 1 or self.max_updates < 1 or self.eval_every < 1:
            raise ConfigError("--clients, --updates and --eval-every must be at least 1")
        timeouts = (
            self.register_timeout_s,
            self.task_timeout_s,
            self.send_timeout_s,
            self.probe_timeout_s,
            self.duration_s,
        )
        if not all(t > 0 and math.isfinite(t) for t in timeouts):
            raise ConfigError("timeouts and the duration must be finite and > 0")
        if not (self.probe_interval_s >= 0 and math.isfinite(self.probe_interval_s)):
            raise ConfigError("--probe-interval must be finite and >= 0")
        grouped = self.server.method not in ("fedavg", "fedasync")
        if grouped and self.server.max_concurrent < self.server.grouping.n_groups:
            raise ConfigError(
                f"--concurrent {self.server.max_concurrent} cannot serve "
                f"--groups {self.server.grouping.n_groups}: every group needs a client in flight"
            )


@dataclass
class _Outstanding:
    client: int
    sent_at: float
    deadline: float


class FederatedShell:
    """One federated run: registration, then the server object's tasks over the network."""

    def __init__(
        self, config: NetServerConfig, dataset: Dataset, *, out: IO[str] | None = None
    ) -> None:
        self.config = config
        self.dataset = dataset
        self.shape = MLPShape(dataset.n_features, config.hidden, dataset.n_classes)
        self.out = out or sys.stdout
        self._context = new_context()
        self._router: zmq.asyncio.Socket | None = None
        self._authenticator: security.CurveAuthenticator | None = None
        self._routes: dict[int, bytes] = {}  # client id -> routing id
        self._clients: dict[bytes, ClientProfile] = {}
        self._outstanding: dict[int, _Outstanding] = {}
        self._probes = ProbeSchedule(config.probe_interval_s, config.probe_timeout_s)
        self._roles: SenderRoles | None = None
        self._trace: IO[str] | None = None
        self.dropped_messages = 0
        self.endpoint = ""

    # ------------------------------------------------------------------ socket

    def open(self) -> str:
        options = SocketOptions(max_message_bytes=MAX_MESSAGE_BYTES, send_hwm=64, recv_hwm=64)
        router = open_socket(self._context, zmq.ROUTER, options)
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client keeps its route
        keys_dir = self.config.keys_dir
        if keys_dir is not None:
            keypair = security.load_keypair(keys_dir, self.config.key_name)
            allowed = security.load_public_keys(keys_dir)
            allow = security.PeerAllowList(
                {name: key for name, key in allowed.items() if name != self.config.key_name}
            )
            self._authenticator = security.CurveAuthenticator(self._context, allow)
            self._authenticator.start()
            self._roles = SenderRoles(keys_dir)
            security.secure_server(router, keypair)
        else:
            security.warn_open_cluster(log, "fl-server")
        self._router = router
        self.endpoint = bind_endpoint(router, self.config.bind)
        return self.endpoint

    def close(self) -> None:
        if self._router is not None:
            # a bounded linger: the run's last messages (every client's fl_done) are only
            # queued when close comes, and linger 0 dropped one a loaded client then
            # waited for until its own idle limit
            self._router.close(linger=int(1000 * min(self.config.send_timeout_s, 2.0)))
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()
        if self._trace is not None:
            self._trace.close()

    async def _send(self, routing_id: bytes, message: WireMessage, peer: str) -> bool:
        assert self._router is not None
        try:
            await send(
                self._router,
                message.to_message(),
                routing_id=routing_id,
                peer=peer,
                timeout_s=self.config.send_timeout_s,
            )
        except zmq.ZMQError:  # ROUTER_MANDATORY: the peer is not connected
            log.warning("fl_send_failed", peer=peer, error=str(PeerGoneError(peer, message.KIND)))
            return False
        except TransportTimeout as exc:
            log.warning("fl_send_failed", peer=peer, error=str(exc))
            return False
        return True

    async def _receive(self, timeout_s: float) -> tuple[bytes, WireMessage] | None:
        """The next valid message and its sender; None on a timeout or a dropped message."""
        assert self._router is not None
        try:
            frames = await recv_frames(
                self._router, timeout_s=max(timeout_s, 0.0), peer="fl clients", awaited="a message"
            )
        except TransportTimeout:
            return None
        routing_id = bytes(frames[0].bytes) if frames else b""
        try:
            message = decode_frames(frames[1:], MAX_MESSAGE_BYTES)
            typed = REGISTRY.parse(message)
            if self._roles is not None and len(frames) > 1:
                self._roles.check(typed.KIND, frames[1])
        except ProtocolError as exc:
            self._drop(routing_id, str(exc))
            return None
        except RoleError as exc:
            self.dropped_messages += 1
            log.warning("role_refused", error=str(exc))
            if typed.KIND == FlRegister.KIND:  # tell a would-be client why, once
                await self._send(routing_id, FlError(reason=str(exc)), "refused key")
            return None
        return routing_id, typed

    def _drop(self, routing_id: bytes, reason: str) -> None:
        self.dropped_messages += 1
        client = self._clients.get(routing_id)
        log.warning(
            "fl_message_dropped",
            client=None if client is None else client.client_id,
            reason=reason,
        )

    def _record(self, event: dict[str, Any]) -> None:
        if self._trace is not None:
            self._trace.write(json.dumps(event) + "\n")

    def _emit(self, event: dict[str, Any]) -> None:
        self.out.write(json.dumps(event) + "\n")
        self.out.flush()

    # ------------------------------------------------------------ registration

    async def register_clients(self) -> None:
        deadline = time.monotonic() + self.config.register_timeout_s
        while len(self._clients) < self.config.clients:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            received = await self._receive(left)
            if received is None:
                continue
            routing_id, message = received
            if not isinstance(message, FlRegister):
                self._drop(routing_id, f"{message.KIND} before the run started")
                continue
            try:
                profile = self._profile_of(routing_id, message)
            except ProtocolError as exc:
                self._drop(routing_id, str(exc))
                await self._send(routing_id, FlError(reason=str(exc)), "unregistered client")
                continue
            self._clients[routing_id] = profile
            self._routes[profile.client_id] = routing_id
            await self._send(routing_id, FlWelcome(client=profile.client_id), self._peer(profile))
            self._emit(
                {"event": "registered", "client": profile.client_id, "latency_s": profile.latency_s}
            )
        if not self._clients:
            raise ConfigError(f"no client registered within {self.config.register_timeout_s:g} s")

    def _profile_of(self, routing_id: bytes, message: FlRegister) -> ClientProfile:
        profile = profile_from_register(message, self.dataset.n_classes)
        known = self._routes.get(profile.client_id)
        if known is not None and known != routing_id:
            raise ProtocolError(
                f"client id {profile.client_id} is already registered by another peer"
            )
        if routing_id in self._clients and self._clients[routing_id].client_id != profile.client_id:
            raise ProtocolError("a peer registers once, under one client id")
        return profile

    @staticmethod
    def _peer(profile: ClientProfile) -> str:
        return f"fl client {profile.client_id}"

    # ----------------------------------------------------------------- the run

    async def run(self) -> dict[str, Any]:
        config = self.config
        started = time.monotonic()
        end_at = started + config.duration_s
        initial = init_weights(self.shape, np.random.default_rng([config.seed, 3]))
        profiles = sorted(self._clients.values(), key=lambda p: p.client_id)
        self._record(
            {
                "event": "config",
                "server": config_to_json(config.server),
                "shape": [self.shape.n_in, self.shape.n_hidden, self.shape.n_out],
                "initial_weights": initial.tolist(),
            }
        )
        self._record(
            {
                "event": "profiles",
                "profiles": [[p.client_id, p.latency_s, list(p.label_counts)] for p in profiles],
            }
        )
        try:
            server = make_server(profiles, initial, config.server)
        except ConfigError as exc:
            # the clients would otherwise wait for tasks until their idle timeout
            for routing_id, profile in self._clients.items():
                await self._send(
                    routing_id, FlDone(reason=f"server error: {exc}"), self._peer(profile)
                )
            raise
        curve: list[dict[str, float | int]] = []
        self._evaluate(server, started, curve)
        await self._dispatch(server.start())
        reason = "updates"
        while server.version < config.max_updates:
            now = time.monotonic()
            if now >= end_at:
                reason = "duration"
                break
            for task_id in [t for t, o in self._outstanding.items() if o.deadline <= now]:
                await self._fail(server, task_id)
            for result in self._probes.expired(now):
                await self._probed(server, result)
            await self._send_probes(server, now)
            candidates = server.probe_candidates() if self._probes.enabled else []
            if server.outstanding() == 0 and self._probes.outstanding() == 0 and not candidates:
                reason = "nothing to dispatch"  # every client dropped out or failed
                break
            next_deadline = min(
                min((o.deadline for o in self._outstanding.values()), default=end_at),
                self._probes.next_event(candidates),
                end_at,
            )
            received = await self._receive(next_deadline - time.monotonic())
            if received is None:
                continue
            before = server.version
            await self._handle(server, *received)
            if server.version // config.eval_every > before // config.eval_every:
                self._evaluate(server, started, curve)
        if not curve or curve[-1]["global_updates"] != server.version:
            self._evaluate(server, started, curve)
        self._record(
            {"event": "end", "version": server.version, "weights": server.global_weights.tolist()}
        )
        for routing_id, profile in self._clients.items():
            await self._send(routing_id, FlDone(reason=reason), self._peer(profile))
        return {
            "event": "fl_server_done",
            "method": config.server.method,
            "reason": reason,
            "clients": sorted(self._routes),
            "global_updates": server.version,
            "final_acc": curve[-1]["test_acc"],
            "curve": curve,
            "dropped_messages": self.dropped_messages,
            "probes": self._probes.sent,
            "stats": server.stats(),
            "wall_s": round(time.monotonic() - started, 3),
        }

    def _evaluate(
        self, server: FederatedServer, started: float, curve: list[dict[str, float | int]]
    ) -> None:
        acc = accuracy(server.global_weights, self.shape, self.dataset.x_test, self.dataset.y_test)
        point = {
            "global_updates": server.version,
            "elapsed_s": round(time.monotonic() - started, 3),
            "test_acc": round(acc, 4),
        }
        curve.append(point)
        self._emit({"event": "eval", **point})

    async def _dispatch(self, tasks: Sequence[TrainTask]) -> None:
        config = self.config
        for event in dispatch_events(tasks):
            self._record(event)
        for task in tasks:
            now = time.monotonic()
            self._outstanding[task.task_id] = _Outstanding(
                task.client_id, now, now + config.task_timeout_s
            )
            message = FlTask(
                task=task.task_id,
                version=task.version,
                shape=[self.shape.n_in, self.shape.n_hidden, self.shape.n_out],
                local_steps=config.local_steps,
                batch_size=config.batch_size,
                lr=config.lr,
                mu=config.mu,
                seed=config.seed,
                tensors=(weights_tensor(task.weights.copy()),),
            )
            # a task that cannot be sent (the client is gone) is left to time out like
            # one whose answer is lost: one rule for every silent client
            await self._send(self._routes[task.client_id], message, f"fl client {task.client_id}")

    async def _fail(self, server: FederatedServer, task_id: int) -> None:
        outstanding = self._outstanding.pop(task_id)
        log.warning("fl_task_timed_out", task=task_id, client=outstanding.client)
        self._emit({"event": "task_failed", "task": task_id, "client": outstanding.client})
        # the timeout is its latency first: a client that it drops out must not be picked
        # again by the new round its failure may start
        await self._observe(server, outstanding.client, self.config.task_timeout_s)
        self._record({"event": "failed", "task": task_id})
        await self._dispatch(server.on_task_failed(task_id))

    async def _observe(self, server: FederatedServer, client: int, latency_s: float) -> None:
        self._record({"event": "latency", "client": client, "latency_s": latency_s})
        was_dropped = server.is_dropped(client)
        tasks = server.observe_latency(client, latency_s)
        if server.is_dropped(client) != was_dropped:
            kind = "readmitted" if was_dropped else "dropped"
            self._emit({"event": kind, "client": client, "latency_s": round(latency_s, 4)})
        await self._dispatch(tasks)

    async def _send_probes(self, server: FederatedServer, now: float) -> None:
        if not self._probes.enabled:
            return
        for probe_id, client in self._probes.due(now, server.probe_candidates()):
            # an unsendable probe (the client is gone) times out like an unanswered one
            await self._send(self._routes[client], FlProbe(probe=probe_id), f"fl client {client}")

    async def _probed(self, server: FederatedServer, result: ProbeResult) -> None:
        self._emit(
            {
                "event": "probe",
                "client": result.client_id,
                "latency_s": round(result.latency_s, 4),
                "answered": result.answered,
            }
        )
        await self._observe(server, result.client_id, result.latency_s)

    async def _join(self, server: FederatedServer, routing_id: bytes, message: FlRegister) -> None:
        """A registration after the start: the client joins the run (eq. 4 for groups)."""
        try:
            profile = self._profile_of(routing_id, message)
        except ProtocolError as exc:
            self._drop(routing_id, str(exc))
            await self._send(routing_id, FlError(reason=str(exc)), "late client")
            return
        self._clients[routing_id] = profile
        self._routes[profile.client_id] = routing_id
        await self._send(routing_id, FlWelcome(client=profile.client_id), self._peer(profile))
        self._record(
            {
                "event": "join",
                "client": profile.client_id,
                "latency_s": profile.latency_s,
                "label_counts": list(profile.label_counts),
            }
        )
        tasks = server.add_client(profile)
        self._emit(
            {
                "event": "joined",
                "client": profile.client_id,
                "latency_s": profile.latency_s,
                "dropped": server.is_dropped(profile.client_id),
            }
        )
        await self._dispatch(tasks)

    async def _handle(
        self, server: FederatedServer, routing_id: bytes, message: WireMessage
    ) -> None:
        profile = self._clients.get(routing_id)
        if profile is None:
            if isinstance(message, FlRegister):
                await self._join(server, routing_id, message)
            else:
                self._drop(routing_id, f"{message.KIND} from a peer that has not registered")
            return
        if isinstance(message, FlProbeReply):
            result = self._probes.answered(message.probe, profile.client_id, time.monotonic())
            if result is None:
                self._drop(routing_id, f"probe {message.probe} is not outstanding for this client")
            else:
                await self._probed(server, result)
            return
        if not isinstance(message, FlUpdate):
            self._drop(routing_id, f"{message.KIND} is not expected from a client now")
            return
        outstanding = self._outstanding.get(message.task)
        if outstanding is None or outstanding.client != profile.client_id:
            self._drop(routing_id, f"task {message.task} is not outstanding for this client")
            return
        try:
            if message.n_samples != profile.n_samples:
                # the weight of its model in every average: the count it registered with
                raise ProtocolError(
                    f"fl_update: {message.n_samples} samples, registered with {profile.n_samples}"
                )
            weights = weights_from(message.tensors, self.shape.size, what="fl_update")
            update = ClientUpdate(message.task, profile.client_id, weights, message.n_samples)
            tasks = server.on_update(update)
        except ProtocolError as exc:
            self._drop(routing_id, str(exc))  # the task stays outstanding until its deadline
            return
        del self._outstanding[message.task]
        latency = time.monotonic() - outstanding.sent_at
        self._record(
            {
                "event": "update",
                "task": message.task,
                "client": profile.client_id,
                "n_samples": message.n_samples,
                "weights": weights.tolist(),
            }
        )
        self._emit(
            {
                "event": "update",
                "task": message.task,
                "client": profile.client_id,
                "latency_s": round(latency, 4),
                "global_updates": server.version,
            }
        )
        await self._dispatch(tasks)
        await self._observe(server, profile.client_id, latency)

    async def serve(self) -> dict[str, Any]:
        if self.config.trace is not None:
            self._trace = self.config.trace.open("w")
        self._emit({"event": "listening", "endpoint": self.endpoint or self.open()})
        await self.register_clients()
        return await self.run()
