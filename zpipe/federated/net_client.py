"""One federated client, training on its own digits shard (the command: :mod:`zpipe.cli.fl_client`).

The client holds a shard of scikit-learn's digits (``--classes``, ``--samples``
augmented training images, as fl-sim's clients do), registers with its label
counts and a profiled latency (the time ``--profile-steps`` SGD steps take,
plus ``--delay``), then trains every task it gets: the task's weights,
``local_steps`` mini-batch SGD steps with FedProx's mu (the plain numpy MLP
trainer of :mod:`zpipe.federated.model`, or with ``--pipeline-stages N`` a
zpipe pipeline of N local stage processes, :mod:`zpipe.federated.pipeline_trainer`),
and sends the weights back. It
exits on ``fl_done``, on ``fl_error`` or when the server stays silent for
``--idle-timeout`` seconds. ``--delay S`` adds S seconds to every task, to
emulate a slower device on one machine; ``--delay-from N:S`` changes that to S
from the client's N-th answer on (tasks and probes counted from 0), to
emulate a device whose speed changes mid-run (Eco-FL section 6.1). An
``fl_probe`` (the server measuring again a client it dropped out of its group
or set aside as silent; an answer brings it back) gets the work of a small
task, ``--profile-steps`` steps at the current delay, and an ``fl_probe_reply``.
Without ``--keys`` the server admits at most ``--ids-per-address`` live ids from
one address (this client's id is released once its connection closes); a refusal
is reported as "the server refused this client".

A dropped connection is not the end: libzmq reconnects under the routing id the
client chose at start (random, so no other peer can take its route), and the
socket monitor tells the client, which registers again
(:class:`~zpipe.federated.net_rejoin.ServerLink`: jittered, doubling back-off
between unanswered registrations). A server gone for ``--reconnect-timeout``
seconds ends the client with an error that says so.
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from zpipe._errors import ConfigError, ProtocolError, TransportTimeout
from zpipe.federated.data import ClientShard, make_shards
from zpipe.federated.model import FloatArray, MLPShape, init_weights, local_train
from zpipe.federated.net_rejoin import ServerLink
from zpipe.federated.net_wire import (
    CLIENT_KEY_NAME,
    SERVER_KEY_NAME,
    shape_from,
    weights_from,
    weights_tensor,
)
from zpipe.log import get_logger
from zpipe.lossy.data import Dataset

if TYPE_CHECKING:
    from zpipe.federated.pipeline_trainer import PipelineTrainer
from zpipe.protocol import WireMessage
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
from zpipe.transport.codec import decode_typed
from zpipe.transport.sockets import (
    SocketOptions,
    new_context,
    open_socket,
    recv_frames,
    send,
)

log = get_logger("zpipe.federated.client")

MAX_MESSAGE_BYTES = 64 << 20
MAX_LOCAL_STEPS = 100_000


@dataclass(frozen=True)
class NetClientConfig:
    server: str
    client: int
    classes: tuple[int, ...] = ()  # empty: two classes drawn from the seed
    samples: int = 40
    seed: int = 0
    delay_s: float = 0.0
    profile_steps: int = 10
    connect_timeout_s: float = 15.0
    idle_timeout_s: float = 600.0
    send_timeout_s: float = 5.0
    # after a dropped connection: how long the server may stay unreachable (or not
    # welcome this client back) before the client gives up
    reconnect_timeout_s: float = 120.0
    keys_dir: Path | None = None
    key_name: str = CLIENT_KEY_NAME
    server_key_name: str = SERVER_KEY_NAME
    pipeline_stages: int = 0  # 0: the numpy trainer; N: a zpipe pipeline of N stages
    delay_changes: tuple[tuple[int, float], ...] = ()  # (from answer N, delay S)

    def delay_at(self, answer: int) -> float:
        """The extra seconds of the ``answer``-th answer (tasks and probes, from 0)."""
        delay = self.delay_s
        for first, changed in sorted(self.delay_changes):
            if answer >= first:
                delay = changed
        return delay


def client_shard(config: NetClientConfig, dataset: Dataset) -> ClientShard:
    rng = np.random.default_rng([config.seed, 11, config.client])
    classes = config.classes or tuple(
        sorted(int(c) for c in rng.choice(dataset.n_classes, size=2, replace=False))
    )
    if any(not 0 <= c < dataset.n_classes for c in classes):
        raise ConfigError(f"--classes must lie in 0..{dataset.n_classes - 1}")
    return make_shards(dataset, [classes], samples_per_client=config.samples, rng=rng)[0]


class FederatedClient:
    def __init__(
        self, config: NetClientConfig, dataset: Dataset, pipeline: PipelineTrainer | None = None
    ) -> None:
        self.config = config
        self.pipeline = pipeline
        self.shard = client_shard(config, dataset)
        self.n_classes = dataset.n_classes
        self.n_features = dataset.n_features
        self._context = new_context()
        self._dealer: zmq.asyncio.Socket | None = None
        # the dealer's connection events: a drop, then a new connection (rejoin)
        self._monitor: zmq.asyncio.Socket | None = None
        self._poller = zmq.asyncio.Poller()
        self._registration: FlRegister | None = None  # sent again after a drop
        # the jitter of re-registrations; not seeded: clients must not agree on it
        self._jitter = random.Random()
        self.tasks_done = 0
        self.answers = 0  # tasks and probes answered: what --delay-from counts

    def open(self) -> None:
        options = SocketOptions(max_message_bytes=MAX_MESSAGE_BYTES)
        dealer = open_socket(self._context, zmq.DEALER, options)
        # a routing id of its own, kept across libzmq's reconnections: the server's
        # ROUTER (ROUTER_HANDOVER) then routes to the new connection; random, so that
        # no other peer can name it and take this client's route
        routing_id = f"fl-client-{self.config.client}-{secrets.token_hex(8)}"
        dealer.setsockopt(zmq.ROUTING_ID, routing_id.encode())
        if self.config.keys_dir is not None:
            keys = self.config.keys_dir
            security.secure_client(
                dealer,
                security.load_keypair(keys, self.config.key_name),
                security.load_keypair_public(keys, self.config.server_key_name),
            )
        self._monitor = dealer.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
        )
        dealer.connect(self.config.server)
        self._dealer = dealer
        self._poller.register(dealer, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)

    def close(self) -> None:
        if self._dealer is not None:
            if self._monitor is not None:
                self._dealer.disable_monitor()
                self._monitor.close(linger=0)
            self._dealer.close(linger=0)
        self._context.term()

    def _emit(self, event: dict[str, Any]) -> None:
        print(json.dumps({"client": self.config.client, **event}), flush=True)

    async def profile_latency(self) -> float:
        """Seconds a task of ``--profile-steps`` steps takes here (what the server groups by).

        On a pipeline this is also its warm-up: the first run's set-up is not a task's."""
        shape = MLPShape(self.n_features, 32, self.n_classes)
        weights = init_weights(shape, np.random.default_rng(0))
        if self.pipeline is not None:
            await self._local_train(weights, shape, self.config.profile_steps, 10, 0.1, 0.0, 0)
        started = time.perf_counter()
        await self._local_train(weights, shape, self.config.profile_steps, 10, 0.1, 0.0, 0)
        return time.perf_counter() - started + self.config.delay_at(self.answers)

    async def _probe(self, probe: FlProbe) -> None:
        """A probe's work: a small task's steps at this client's current speed."""
        shape = MLPShape(self.n_features, 32, self.n_classes)
        weights = init_weights(shape, np.random.default_rng(0))
        started = time.perf_counter()
        await self._local_train(weights, shape, self.config.profile_steps, 10, 0.1, 0.0, 0)
        delay = self.config.delay_at(self.answers)
        if delay > 0:
            await asyncio.sleep(delay)
        work_s = time.perf_counter() - started
        reply = FlProbeReply(probe=probe.probe, client=self.config.client, work_s=work_s)
        await self._send(reply)
        self.answers += 1
        self._emit({"event": "probed", "probe": probe.probe, "work_s": round(work_s, 4)})

    async def _local_train(
        self,
        weights: FloatArray,
        shape: MLPShape,
        steps: int,
        batch_size: int,
        lr: float,
        mu: float,
        seed: Sequence[int] | int,
    ) -> FloatArray:
        rng = np.random.default_rng(seed)
        if self.pipeline is not None:
            return await self.pipeline.train(
                weights,
                shape,
                self.shard.x,
                self.shard.y,
                steps=steps,
                batch_size=batch_size,
                lr=lr,
                mu=mu,
                rng=rng,
            )
        return local_train(
            weights,
            shape,
            self.shard.x,
            self.shard.y,
            steps=steps,
            batch_size=batch_size,
            lr=lr,
            mu=mu,
            rng=rng,
        )

    async def _send(self, message: WireMessage) -> None:
        assert self._dealer is not None
        await send(
            self._dealer,
            message.to_message(),
            peer="fl-server",
            timeout_s=self.config.send_timeout_s,
        )

    async def _receive(self, timeout_s: float, awaited: str) -> WireMessage | None:
        """The server's next message; None if it did not decode (logged and dropped)."""
        assert self._dealer is not None
        frames = await recv_frames(
            self._dealer, timeout_s=timeout_s, peer="fl-server", awaited=awaited
        )
        try:
            return decode_typed(frames, max_message_bytes=MAX_MESSAGE_BYTES)
        except ProtocolError as exc:
            log.warning("fl_message_dropped", reason=str(exc))
            return None

    async def register(self) -> None:
        """Register within ``--connect-timeout``; a refused key looks like a silent server
        (the CURVE handshake fails before the server sees a message), so both say so."""
        counts = list(self.shard.label_counts(self.n_classes))
        latency = await self.profile_latency()
        register = FlRegister(client=self.config.client, label_counts=counts, latency_s=latency)
        self._registration = register
        deadline = time.monotonic() + self.config.connect_timeout_s
        try:
            assert self._dealer is not None
            # no connection (refused, or no server yet) leaves no room to queue: the same wait
            await send(
                self._dealer,
                register.to_message(),
                peer="fl-server",
                timeout_s=self.config.connect_timeout_s,
            )
            while True:
                left = max(0.0, deadline - time.monotonic())
                message = await self._receive(left, "fl_welcome")
                if isinstance(message, FlWelcome):
                    self._emit({"event": "registered", "latency_s": round(latency, 4)})
                    return
                if isinstance(message, FlError):
                    raise ProtocolError(f"the server refused this client: {message.reason}")
        except TransportTimeout:
            raise TransportTimeout(
                "fl-server",
                f"fl_welcome: is the server running at {self.config.server}, and (with "
                "--keys) is this client's key in its key directory?",
                self.config.connect_timeout_s,
            ) from None

    async def serve(self) -> str:
        await self.register()
        config = self.config
        link = ServerLink(
            reply_timeout_s=config.send_timeout_s,
            gone_timeout_s=config.reconnect_timeout_s,
            draw=self._jitter.random,
        )
        heard_at = time.monotonic()
        while True:
            now = time.monotonic()
            await self._link_events(link, now)
            if link.expired(now):
                raise TransportTimeout(
                    "fl-server",
                    f"a connection back to {config.server} and a welcome (its connection "
                    f"dropped {link.gone_for(now):.1f} s ago; --reconnect-timeout)",
                    config.reconnect_timeout_s,
                )
            idle_until = heard_at + config.idle_timeout_s
            if link.state == "registered" and now >= idle_until:
                raise TransportTimeout(
                    "fl-server", "a task or the run's end", config.idle_timeout_s
                )
            if link.register_due(now):
                assert self._registration is not None
                await self._send(self._registration)
                link.registration_sent(now)
                log.info("fl_registering_again", client=config.client, attempt=link.attempts)
                continue
            until = min(link.next_event(), idle_until if link.state == "registered" else now + 1)
            message = await self._next_message(until - now)
            if message is None:
                continue
            heard_at = time.monotonic()
            if isinstance(message, FlWelcome):
                gone_s = link.gone_for(heard_at)
                if link.welcomed():
                    self._emit({"event": "rejoined", "gone_s": round(gone_s, 3)})
            elif isinstance(message, FlTask):
                await self._train(message)
            elif isinstance(message, FlProbe):
                await self._probe(message)
            elif isinstance(message, FlDone):
                self._emit({"event": "done", "reason": message.reason, "tasks": self.tasks_done})
                return message.reason
            elif isinstance(message, FlError):
                raise ProtocolError(f"the server refused a message: {message.reason}")
            else:
                log.warning("fl_message_dropped", reason=f"unexpected {message.KIND}")

    async def _next_message(self, timeout_s: float) -> WireMessage | None:
        """The server's next message within ``timeout_s``; None after the timeout, after
        a connection event (read by :meth:`_link_events`), or for a dropped message."""
        ready = dict(await self._poller.poll(int(1000 * max(timeout_s, 0.0)) + 1))
        if self._dealer not in ready:
            return None
        return await self._receive(self.config.send_timeout_s, "the rest of a message")

    async def _link_events(self, link: ServerLink, now: float) -> None:
        """Feed the monitor's queued events to ``link``, never waiting."""
        assert self._monitor is not None
        while True:
            try:
                frames = await self._monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                link.disconnected(now)
                log.warning("fl_server_disconnected", client=self.config.client)
                self._emit({"event": "disconnected"})
            elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED and link.state == "down":
                link.connected(now)
                self._emit({"event": "reconnected"})

    async def _train(self, task: FlTask) -> None:
        try:
            shape = shape_from(task.shape)
            if (shape.n_in, shape.n_out) != (self.n_features, self.n_classes):
                raise ProtocolError(f"model shape {task.shape} does not fit this client's data")
            if not (0 < task.local_steps <= MAX_LOCAL_STEPS and task.batch_size > 0):
                raise ProtocolError("local_steps and batch_size must be positive")
            if not (task.lr > 0 and task.mu >= 0):
                raise ProtocolError("lr must be > 0 and mu >= 0")
            weights = weights_from(task.tensors, shape.size, what="fl_task")
        except ProtocolError as exc:
            log.warning("fl_task_refused", task=task.task, reason=str(exc))
            return
        self._emit({"event": "task", "task": task.task})
        started = time.perf_counter()
        trained = await self._local_train(
            weights,
            shape,
            task.local_steps,
            task.batch_size,
            task.lr,
            task.mu,
            [task.seed, 5, task.task],  # the seeds fl-sim's clients use for the same task
        )
        delay = self.config.delay_at(self.answers)
        if delay > 0:
            await asyncio.sleep(delay)
        update = FlUpdate(
            task=task.task,
            client=self.config.client,
            n_samples=len(self.shard.y),
            train_s=time.perf_counter() - started,
            tensors=(weights_tensor(trained),),
        )
        await self._send(update)
        self.tasks_done += 1
        self.answers += 1
