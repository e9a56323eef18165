"""``python -m zpipe fl-server``: the federated server over zpipe's transport.

A thin I/O shell around the same sans-IO server object fl-sim drives
(:mod:`zpipe.federated.server`): it turns messages and timeouts into the
object's calls and its :class:`TrainTask` answers into messages; it decides
nothing itself (``--trace`` records every input, and
:func:`zpipe.federated.net_trace.replay` reproduces every decision)::

    fl_register from N clients (label counts and a profiled latency, never samples)
        -> ClientProfiles -> make_server(...).start() -> fl_task to each chosen client
    fl_update     -> on_update(), then observe_latency(client, measured round trip)
    no fl_update within --task-timeout -> on_task_failed(), then
                     observe_latency(client, --task-timeout): a lower bound of its latency,
                     which puts a silent client out of its group's range (a drop-out)

The run ends after ``--updates`` global model updates, after ``--duration``
seconds, or when nothing is in flight and nothing can be dispatched. Every
wait has a deadline; a message that does not decode, does not fit its kind,
comes from an unregistered peer or names a task that is not the sender's is
dropped (counted, logged) and the server goes on. With ``--keys DIR`` the
socket is a CurveZMQ server whose allow-list is every ``NAME.key`` in DIR but
its own (``fl-server``).
"""

from __future__ import annotations

import argparse
import asyncio
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

from zpipe._errors import ConfigError, PeerGoneError, ProtocolError, TransportTimeout, ZpipeError
from zpipe.federated.cli import _alpha, _lambda
from zpipe.federated.grouping import ClientProfile, GroupingPolicy
from zpipe.federated.model import MLPShape, accuracy, init_weights
from zpipe.federated.net_trace import config_to_json, dispatch_events
from zpipe.federated.net_wire import SERVER_KEY_NAME, weights_from, weights_tensor
from zpipe.federated.server import (
    METHODS,
    ClientUpdate,
    FederatedServer,
    ServerConfig,
    TrainTask,
    make_server,
)
from zpipe.log import get_logger
from zpipe.lossy.data import Dataset
from zpipe.protocol import REGISTRY, WireMessage
from zpipe.protocol.federated import FlDone, FlError, FlRegister, FlTask, FlUpdate, FlWelcome
from zpipe.transport import security
from zpipe.transport.sockets import (
    SocketOptions,
    bind_endpoint,
    decode_frames,
    new_context,
    open_socket,
    recv_frames,
    send,
    validate_endpoint,
)

log = get_logger("zpipe.federated.server")

MAX_CLIENT_ID = 1_000_000
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
            self.duration_s,
        )
        if not all(t > 0 and math.isfinite(t) for t in timeouts):
            raise ConfigError("timeouts and the duration must be finite and > 0")
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
            security.secure_server(router, keypair)
        else:
            security.warn_open_cluster(log, "fl-server")
        self._router = router
        self.endpoint = bind_endpoint(router, self.config.bind)
        return self.endpoint

    def close(self) -> None:
        if self._router is not None:
            self._router.close(linger=0)
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
        except ProtocolError as exc:
            self._drop(routing_id, str(exc))
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
        client = message.client
        if not 0 <= client <= MAX_CLIENT_ID:
            raise ProtocolError(f"client id {client} is not in 0..{MAX_CLIENT_ID}")
        known = self._routes.get(client)
        if known is not None and known != routing_id:
            raise ProtocolError(f"client id {client} is already registered by another peer")
        if routing_id in self._clients and self._clients[routing_id].client_id != client:
            raise ProtocolError("a peer registers once, under one client id")
        counts = message.label_counts
        n_classes = self.dataset.n_classes
        if len(counts) != n_classes or not all(
            isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= 1 << 31 for c in counts
        ):
            raise ProtocolError(f"label_counts must be {n_classes} non-negative integers")
        if sum(counts) <= 0:
            raise ProtocolError("a client without samples cannot train")
        latency = float(message.latency_s)
        if not (latency >= 0 and math.isfinite(latency)):
            raise ProtocolError(f"latency_s must be finite and >= 0, got {latency!r}")
        return ClientProfile(client, latency, tuple(int(c) for c in counts))

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
            if server.outstanding() == 0:
                reason = "nothing to dispatch"  # every client dropped out or failed
                break
            for task_id in [t for t, o in self._outstanding.items() if o.deadline <= now]:
                await self._fail(server, task_id)
            next_deadline = min((o.deadline for o in self._outstanding.values()), default=end_at)
            received = await self._receive(min(next_deadline, end_at) - time.monotonic())
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
        self._record({"event": "failed", "task": task_id})
        await self._dispatch(server.on_task_failed(task_id))
        await self._observe(server, outstanding.client, self.config.task_timeout_s)

    async def _observe(self, server: FederatedServer, client: int, latency_s: float) -> None:
        self._record({"event": "latency", "client": client, "latency_s": latency_s})
        await self._dispatch(server.observe_latency(client, latency_s))

    async def _handle(
        self, server: FederatedServer, routing_id: bytes, message: WireMessage
    ) -> None:
        profile = self._clients.get(routing_id)
        if profile is None:
            reason = f"{message.KIND} from a peer that has not registered"
            if isinstance(message, FlRegister):
                try:
                    self._profile_of(routing_id, message)
                    reason = "the run has started: registrations are closed"
                except ProtocolError as exc:
                    reason = str(exc)
                await self._send(routing_id, FlError(reason=reason), "late client")
            self._drop(routing_id, reason)
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


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    from zpipe.cli_common import (
        existing_dir,
        non_negative_float,
        non_negative_int,
        positive_float,
        positive_int,
    )
    from zpipe.federated.aggregation import STALENESS_FUNCTIONS

    defaults = NetServerConfig()
    p = argparse.ArgumentParser(
        prog="python -m zpipe fl-server",
        description="Serve federated learning (Eco-FL or a baseline) to fl-client processes.",
    )
    p.add_argument("--bind", default="tcp://0.0.0.0:5600", help="ZeroMQ endpoint to listen on")
    p.add_argument("--clients", type=positive_int, default=3, help="registrations to await")
    p.add_argument("--method", choices=METHODS, default="ecofl")
    p.add_argument("--groups", type=positive_int, default=2, help="latency groups")
    p.add_argument("--concurrent", type=positive_int, default=20, help="K: clients in flight")
    p.add_argument("--lam", type=_lambda, default=10.0, help="eq. 4's lambda, s (inf allowed)")
    p.add_argument("--rt-factor", type=positive_float, default=1.0, help="RT^g / K-means radius")
    p.add_argument(
        "--rt-floor", type=non_negative_float, default=0.1, help="RT^g at least this x centre"
    )
    p.add_argument("--alpha", type=_alpha, default=0.6, help="FedAsync mixing alpha")
    p.add_argument("--staleness", choices=STALENESS_FUNCTIONS, default="polynomial")
    p.add_argument("--staleness-a", type=non_negative_float, default=0.5)
    p.add_argument("--intra-syncs", type=positive_int, default=1)
    p.add_argument("--hidden", type=positive_int, default=defaults.hidden, help="MLP width")
    p.add_argument("--local-steps", type=positive_int, default=defaults.local_steps)
    p.add_argument("--batch-size", type=positive_int, default=defaults.batch_size)
    p.add_argument("--lr", type=positive_float, default=defaults.lr)
    p.add_argument("--mu", type=non_negative_float, default=defaults.mu, help="FedProx mu")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--updates", type=positive_int, default=50, help="global updates to run")
    p.add_argument("--duration", type=positive_float, default=600.0, help="wall-clock limit, s")
    p.add_argument("--eval-every", type=positive_int, default=5, help="updates between evals")
    p.add_argument("--register-timeout", type=positive_float, default=60.0, metavar="S")
    p.add_argument("--task-timeout", type=positive_float, default=30.0, metavar="S")
    p.add_argument("--send-timeout", type=positive_float, default=5.0, metavar="S")
    p.add_argument("--keys", type=existing_dir, default=None, metavar="DIR", help="CurveZMQ keys")
    p.add_argument("--key-name", default=SERVER_KEY_NAME, help="this server's key in --keys")
    p.add_argument("--trace", type=Path, default=None, help="JSON lines of the server's inputs")
    return p


def config_from_args(args: argparse.Namespace) -> NetServerConfig:
    return NetServerConfig(
        server=ServerConfig(
            method=args.method,
            max_concurrent=args.concurrent,
            alpha=args.alpha,
            staleness=args.staleness,
            staleness_a=args.staleness_a,
            intra_syncs=args.intra_syncs,
            grouping=GroupingPolicy(
                n_groups=args.groups,
                lam=args.lam,
                rt_factor=args.rt_factor,
                rt_floor_fraction=args.rt_floor,
                seed=args.seed,
            ),
            seed=args.seed,
        ),
        bind=validate_endpoint(args.bind, flag="--bind"),
        clients=args.clients,
        hidden=args.hidden,
        local_steps=args.local_steps,
        batch_size=args.batch_size,
        lr=args.lr,
        mu=args.mu,
        seed=args.seed,
        register_timeout_s=args.register_timeout,
        task_timeout_s=args.task_timeout,
        send_timeout_s=args.send_timeout,
        max_updates=args.updates,
        duration_s=args.duration,
        eval_every=args.eval_every,
        keys_dir=args.keys,
        key_name=args.key_name,
        trace=args.trace,
    )


async def _serve(config: NetServerConfig) -> dict[str, Any]:
    from zpipe.lossy.data import load_digits_dataset

    shell = FederatedShell(config, load_digits_dataset())
    try:
        shell.open()
        return await shell.serve()
    finally:
        shell.close()


def main(argv: Sequence[str] | None = None) -> int:
    from zpipe.log import configure_logging
    from zpipe.lossy.experiment import single_threaded_blas

    args = build_parser().parse_args(argv)
    configure_logging(log_format="console", level="info")
    try:
        with single_threaded_blas():
            summary = asyncio.run(_serve(config_from_args(args)))
    except ZpipeError as exc:
        print(f"python -m zpipe fl-server: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    print(json.dumps(summary), flush=True)
    return 0
