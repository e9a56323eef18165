"""The stage process: registers with the coordinator, builds its shard, streams micro-batches.

Three data tasks per assignment keep compute overlapped with the network::

    receive ──inbox(2)──> compute (thread) ──outbox(2)──> send (emulated link)

The bounded queues are the backpressure: a slow downstream fills the outbox,
which stalls compute, which fills the inbox, which stops receiving, which
fills the upstream's zmq queue. The event loop never computes, so it keeps
answering heartbeats while a layer runs for seconds.
"""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import zmq
import zmq.asyncio

from zpipe._errors import ConfigError, ProtocolError, TransportTimeout, ZpipeError
from zpipe.config import Timeouts
from zpipe.log import get_logger
from zpipe.models import ModelSpec
from zpipe.profiler import profile_model
from zpipe.stage.linkprobe import PROBE_DOMAIN, ProbeResponder, measure_link
from zpipe.stage.metrics import StageCounters
from zpipe.stage.replicas import ReplicaStore, peer_request
from zpipe.stage.shard import Shard
from zpipe.stage.train_shard import TrainShard
from zpipe.stage.trainer import Group, TrainingExecutor, TrainingSetup
from zpipe.training.allreduce import RingAllReduce
from zpipe.transport import codec, security
from zpipe.transport.codec import Message
from zpipe.transport.emulation import EmulatedLink, LinkSpec
from zpipe.transport.ports import free_tcp_port
from zpipe.transport.sockets import (
    SocketOptions,
    advertised_endpoint,
    bind_endpoint,
    decode_frames,
    frames_nbytes,
    new_context,
    open_socket,
    recv_frames,
    send,
)

log = get_logger("zpipe.stage")


class CoordinatorLost(ZpipeError):
    """The coordinator could not be reached, or went silent."""


@dataclass(frozen=True)
class StageConfig:
    name: str
    coordinator: str
    data_bind: str = "tcp://0.0.0.0:0"
    # Where link probes are answered; None: the data socket's host, any free port.
    probe_bind: str | None = None
    advertise_host: str | None = None
    threads: int | None = None
    slowdown: float = 1.0
    link: LinkSpec = field(default_factory=LinkSpec)
    memory_mb: float | None = None
    keys_dir: Path | None = None
    timeouts: Timeouts = field(default_factory=Timeouts)
    socket_options: SocketOptions = field(default_factory=SocketOptions)

    def __post_init__(self) -> None:
        if not self.slowdown >= 1.0:
            raise ConfigError(
                f"--slowdown must be >= 1 (a factor on compute time), got {self.slowdown}"
            )
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")


@dataclass
class _Assignment:
    run: int
    epoch: int
    start: int
    end: int
    index: int
    num_stages: int
    upstream: str
    downstream: str
    downstream_endpoint: str
    shard: Shard | TrainShard
    upstream_key: str | None = None
    downstream_key: str | None = None
    # training runs only: the round's settings, every neighbour device's (endpoint, key)
    # that this one sends to, and this device's port in its group's all-reduce ring
    training: TrainingSetup | None = None
    peers: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    ring_bind: str = ""
    ring_endpoint: str = ""


# What the data port of a stage accepts, and from whom, besides data from upstream.
CLIENT = "client"


class StageRuntime:
    def __init__(self, config: StageConfig) -> None:
        self.config = config
        self.counters = StageCounters()
        self._context = new_context()
        self._compute = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"compute-{config.name}"
        )
        self._assignment: _Assignment | None = None
        self._data_tasks: list[asyncio.Task[None]] = []
        self._downstream: zmq.asyncio.Socket | None = None
        self._peers: dict[str, zmq.asyncio.Socket] = {}
        self._ring: RingAllReduce | None = None
        self._trainer: TrainingExecutor | None = None
        self._weights_task: asyncio.Task[None] | None = None
        self._backup_task: asyncio.Task[None] | None = None
        # snapshots for chain replication: this stage's own, and peers' backups
        self.replicas = ReplicaStore()
        self._link: EmulatedLink | None = None
        self._control: zmq.asyncio.Socket | None = None
        self._data_in: zmq.asyncio.Socket | None = None
        self._authenticator: security.CurveAuthenticator | None = None
        self._data_allow: security.PeerAllowList | None = None
        self._probe_allow: security.PeerAllowList | None = None
        self._probe_in: zmq.asyncio.Socket | None = None
        self._probe_responder: ProbeResponder | None = None
        self._link_probe_task: asyncio.Task[None] | None = None
        self._keypair: security.KeyPair | None = None
        self._coordinator_key: bytes | None = None
        self._stopping = asyncio.Event()
        self._heard_from_coordinator = time.monotonic()
        self._assign_task: asyncio.Task[None] | None = None
        self._profile_task: asyncio.Task[None] | None = None
        # The last shard built, by (spec, start, end, dtype), so a repeated run reuses it.
        self._shard: tuple[tuple[ModelSpec, int, int, str], Shard] | None = None
        # A built shard waiting for the coordinator's "connect", with its downstream key.
        self._pending: _Assignment | None = None
        self.data_endpoint = ""
        self.probe_endpoint = ""

    # ------------------------------------------------------------------ set-up

    def _setup_security(self) -> None:
        keys_dir = self.config.keys_dir
        if keys_dir is None:
            security.warn_open_cluster(log, f"stage {self.config.name}")
            return
        self._keypair = security.load_keypair(keys_dir, self.config.name)
        self._coordinator_key = security.load_keypair_public(keys_dir, "coordinator")
        # Until the coordinator assigns an upstream peer, nobody may send data.
        self._data_allow = security.PeerAllowList()
        self._authenticator = security.CurveAuthenticator(self._context, self._data_allow)
        # Link probes come from any cluster member the coordinator names (link_peers).
        self._probe_allow = security.PeerAllowList()
        self._authenticator.add_domain(PROBE_DOMAIN, self._probe_allow)
        self._authenticator.start()

    def _open_sockets(self) -> None:
        opts = self.config.socket_options
        self._data_in = open_socket(self._context, zmq.PULL, opts)
        if self._keypair is not None:
            security.secure_server(self._data_in, self._keypair)
        bound = bind_endpoint(self._data_in, self.config.data_bind)
        self.data_endpoint = advertised_endpoint(
            bound, advertise_host=self.config.advertise_host, toward=self.config.coordinator
        )
        self._probe_in = open_socket(self._context, zmq.ROUTER, opts)
        if self._keypair is not None:
            security.secure_server(self._probe_in, self._keypair, domain=PROBE_DOMAIN)
        probe_bound = bind_endpoint(self._probe_in, self._probe_bind())
        self.probe_endpoint = advertised_endpoint(
            probe_bound, advertise_host=self.config.advertise_host, toward=self.config.coordinator
        )
        self._probe_responder = ProbeResponder(
            socket=self._probe_in,
            link=self.config.link,
            name=self.config.name,
            send_timeout_s=self.config.timeouts.reply_s,
            max_message_bytes=opts.max_message_bytes,
            peer_handler=self._on_peer_request,
        )
        self._control = open_socket(self._context, zmq.DEALER, opts)
        self._control.setsockopt(zmq.ROUTING_ID, self.config.name.encode())
        if self._keypair is not None and self._coordinator_key is not None:
            security.secure_client(self._control, self._keypair, self._coordinator_key)
        self._control.connect(self.config.coordinator)

    def _probe_bind(self) -> str:
        if self.config.probe_bind is not None:
            return self.config.probe_bind
        # The data socket's host with any free port: reachable wherever data is.
        return self.config.data_bind.rsplit(":", 1)[0] + ":0"

    def _info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "cores": os.cpu_count() or 1,
            "threads": torch.get_num_threads(),
            "slowdown": self.config.slowdown,
            "memory_mb": self.config.memory_mb,
            "link": self.config.link.to_dict(),
            "probe_endpoint": self.probe_endpoint,
            "torch": torch.__version__,
        }

    async def _send_control(
        self,
        kind: str,
        body: dict[str, Any],
        epoch: int = 0,
        timeout_s: float | None = None,
        tensors: tuple[torch.Tensor, ...] = (),
    ) -> None:
        assert self._control is not None
        await send(
            self._control,
            Message(kind, body, epoch=epoch, tensors=tensors),
            timeout_s=timeout_s or self.config.timeouts.send_s,
            peer="coordinator",
        )

    def _registration(self) -> dict[str, Any]:
        return {
            "name": self.config.name,
            "data_endpoint": self.data_endpoint,
            "info": self._info(),
            "public_key": self._keypair.public.decode() if self._keypair else None,
        }

    async def _register(self) -> float:
        """Register until the coordinator answers or ``connect_s`` runs out."""
        assert self._control is not None
        deadline = time.monotonic() + self.config.timeouts.connect_s
        body = self._registration()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CoordinatorLost(
                    f"could not reach the coordinator at {self.config.coordinator} within "
                    f"{self.config.timeouts.connect_s:g} s; is it running, and are --coordinator "
                    "and --keys right?"
                )
            try:
                await asyncio.wait_for(self._send_control("register", body), min(left, 1.0))
                frames = await recv_frames(
                    self._control,
                    timeout_s=min(left, 1.0),
                    peer="coordinator",
                    awaited="registration reply",
                )
            except (TransportTimeout, asyncio.TimeoutError):
                continue
            try:
                reply = decode_frames(frames, self.config.socket_options.max_message_bytes)
            except ProtocolError as exc:
                log.warning("dropped_message", peer="coordinator", error=str(exc))
                continue
            if reply.kind == "refused":
                raise ConfigError(f"the coordinator refused this stage: {reply['reason']}")
            if reply.kind == "registered":
                return float(reply["heartbeat_interval"])

    # ------------------------------------------------------------ main loops

    async def serve(self) -> None:
        """Run until shut down by the coordinator, a signal, or coordinator loss."""
        if self.config.threads is not None:
            torch.set_num_threads(self.config.threads)
        self._setup_security()
        self._open_sockets()
        log.info(
            "stage_starting",
            stage=self.config.name,
            data_endpoint=self.data_endpoint,
            coordinator=self.config.coordinator,
            threads=torch.get_num_threads(),
            slowdown=self.config.slowdown,
        )
        try:
            interval = await self._register()
            self._heard_from_coordinator = time.monotonic()
            log.info("stage_registered", stage=self.config.name, heartbeat_interval=interval)
            control = asyncio.create_task(self._control_loop())
            heartbeat = asyncio.create_task(self._heartbeat_loop(interval))
            stopping = asyncio.create_task(self._stopping.wait())
            tasks: set[asyncio.Task[Any]] = {control, heartbeat, stopping}
            if self._probe_responder is not None:
                tasks.add(asyncio.create_task(self._probe_responder.serve()))
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in tasks:
                task.cancel()
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            await self.close()

    def stop(self) -> None:
        self._stopping.set()

    async def _heartbeat_loop(self, interval: float) -> None:
        silence_limit = self.config.timeouts.coordinator_silence_s
        while True:
            await asyncio.sleep(interval)
            silent = time.monotonic() - self._heard_from_coordinator
            if silent > silence_limit:
                raise CoordinatorLost(
                    f"no word from the coordinator at {self.config.coordinator} for "
                    f"{silent:.1f} s (limit {silence_limit:g} s)"
                )
            try:
                # A DEALER blocks while the coordinator is unreachable; never for
                # longer than an interval, so the silence check above keeps running.
                await self._send_control(
                    "heartbeat",
                    {"name": self.config.name, "metrics": self.counters.to_dict()},
                    timeout_s=interval,
                )
            except TransportTimeout as exc:
                log.warning("heartbeat_not_sent", stage=self.config.name, error=str(exc))

    async def _control_loop(self) -> None:
        assert self._control is not None
        while True:
            frames = await recv_frames(
                self._control, timeout_s=None, peer="coordinator", awaited="control message"
            )
            self._heard_from_coordinator = time.monotonic()
            try:
                message = decode_frames(frames, self.config.socket_options.max_message_bytes)
                await self._handle_control(message)
            except ProtocolError as exc:
                self.counters.dropped += 1
                log.warning(
                    "dropped_message", stage=self.config.name, peer="coordinator", error=str(exc)
                )

    async def _handle_control(self, message: Message) -> None:
        kind = message.kind
        if kind in ("heartbeat_ack", "registered"):
            return
        if kind == "register_again":
            # A coordinator restarted without our registration (or one that had
            # declared us dead): join it again; what this stage runs is unchanged.
            log.warning("registering_again", stage=self.config.name, reason=message["reason"])
            await self._send_control("register", self._registration())
        elif kind == "refused":
            raise CoordinatorLost(f"the coordinator refused this stage: {message['reason']}")
        elif kind == "probe":
            await self._send_control("probe_ack", {"nonce": message["nonce"]})
        elif kind == "assign":
            # Building a shard can take long; keep answering the coordinator meanwhile.
            if self._assign_task is not None and not self._assign_task.done():
                self._assign_task.cancel()
            self._assign_task = asyncio.create_task(self._assign(message))
        elif kind == "connect":
            await self._connect(message)
        elif kind == "profile_request":
            # Profiling runs for seconds: off the receive loop, and only one at a time.
            if self._profile_task is None or self._profile_task.done():
                self._profile_task = asyncio.create_task(self._profile(message))
        elif kind == "link_peers":
            # Every cluster member may probe this stage's links; allowed before anyone does.
            if self._probe_allow is not None:
                self._probe_allow.replace(
                    {str(n): str(k).encode() for n, k in message["keys"].items()}
                )
            await self._send_control("link_peers_ok", {"name": self.config.name})
        elif kind == "link_probe_request":
            if self._link_probe_task is None or self._link_probe_task.done():
                self._link_probe_task = asyncio.create_task(self._measure_link(message))
        elif kind == "weights_request":
            if self._weights_task is not None and not self._weights_task.done():
                # The newest request wins: an older one waits for a round of a run that
                # a failure ended, and would otherwise block every later request.
                self._weights_task.cancel()
            self._weights_task = asyncio.create_task(self._send_weights(message))
        elif kind == "backup_request":
            if self._backup_task is not None and not self._backup_task.done():
                self._backup_task.cancel()  # the newest request wins, as for weights
            self._backup_task = asyncio.create_task(self._backup(message))
        elif kind == "metrics_request":
            await self._send_control(
                "metrics",
                {
                    "run": message["run"],
                    "name": self.config.name,
                    "metrics": self.counters.to_dict(),
                },
                epoch=message.epoch,
            )
        elif kind == "shutdown":
            log.info("stage_shutdown", stage=self.config.name, reason=message["reason"])
            self.stop()
        else:
            raise ProtocolError(f"unexpected control message {kind!r} from the coordinator")

    async def _profile(self, message: Message) -> None:
        """Profile the requested model on this device (its threads, its slowdown)."""
        body = message.body
        reply: dict[str, Any] = {"name": self.config.name, "profile": None, "error": ""}
        try:
            spec = ModelSpec.from_dict(body["model"])
            loop = asyncio.get_running_loop()
            profile = await loop.run_in_executor(
                self._compute,
                lambda: profile_model(
                    spec,
                    batch_sizes=[int(body["batch_size"])],
                    dtype=str(body["dtype"]),
                    warmup=1,
                    repeats=max(1, int(body["repeats"])),
                    slowdown=self.config.slowdown,
                    device_name=self.config.name,
                    train=bool(body.get("train", False)),
                ),
            )
            reply["profile"] = profile.to_dict()
            log.info(
                "profiled",
                stage=self.config.name,
                units=profile.num_units,
                forward_s=round(sum(profile.times(int(body["batch_size"]))), 4),
            )
        except Exception as exc:  # reported to the coordinator, which plans without us
            reply["error"] = f"{type(exc).__name__}: {exc}"
            log.error("profile_failed", stage=self.config.name, error=reply["error"])
        await self._send_control("profile_reply", reply)

    async def _measure_link(self, message: Message) -> None:
        """Measure the link from this stage to another one and report it."""
        target = str(message["target"])
        reply: dict[str, Any] = {
            "name": self.config.name,
            "target": target,
            "bandwidth_bps": None,
            "rtt_s": None,
            "error": "",
        }
        try:
            key = message.get("key")
            measured = await measure_link(
                context=self._context,
                endpoint=str(message["endpoint"]),
                target=target,
                link=self.config.link,
                socket_options=self.config.socket_options,
                timeout_s=self.config.timeouts.reply_s,
                keypair=self._keypair,
                server_key=str(key).encode() if key else None,
            )
            reply["bandwidth_bps"] = measured.bandwidth_bps
            reply["rtt_s"] = measured.rtt_s
            log.info(
                "link_measured",
                stage=self.config.name,
                target=target,
                bandwidth_mbps=round(measured.bandwidth_mbps, 1),
                rtt_ms=round(measured.rtt_s * 1e3, 3),
                took_s=round(measured.took_s, 3),
            )
        except (ZpipeError, zmq.ZMQError) as exc:  # reported; the coordinator falls back
            reply["error"] = f"{type(exc).__name__}: {exc}"
            log.warning("link_probe_failed", stage=self.config.name, target=target, error=str(exc))
        await self._send_control("link_probe_reply", reply)

    async def _assign(self, message: Message) -> None:
        body = message.body
        run, epoch = int(body["run"]), message.epoch
        log.info(
            "assignment_received",
            stage=self.config.name,
            run=run,
            epoch=epoch,
            start=body["start"],
            end=body["end"],
            downstream=body["downstream"],
        )
        await self._stop_data_tasks()
        self._assignment = None
        self._pending = None
        started = time.monotonic()
        try:
            spec = ModelSpec.from_dict(body["model"])
            key = (spec, int(body["start"]), int(body["end"]), str(body["dtype"]))
            reused = self._shard is not None and self._shard[0] == key
            training = self._training_setup(message) if body.get("mode") == "train" else None
            shard: Shard | TrainShard
            if training is not None:
                # Trained weights are never reused by another run: build afresh.
                self._shard, reused = None, False
                loop = asyncio.get_running_loop()
                train = dict(body["train"])
                resumed = _resumed_state(message)
                if body.get("fetch"):
                    resumed = {**(resumed or {}), **await self._fetched_state(list(body["fetch"]))}
                shard = await loop.run_in_executor(
                    self._compute,
                    lambda: TrainShard.build(
                        spec,
                        key[1],
                        key[2],
                        first=training.index == 0,
                        last=training.index == training.num_stages - 1,
                        loss=str(train["loss"]),
                        optimizer=dict(train["optimizer"]),
                        slowdown=self.config.slowdown,
                        state=resumed,
                    ),
                )
            elif self._shard is not None and reused:
                shard = self._shard[1]  # the same units again: keep them, build nothing
            else:
                self._shard = None  # let the old units go before the new ones are built
                loop = asyncio.get_running_loop()
                shard = await loop.run_in_executor(
                    self._compute,
                    lambda: Shard.build(
                        spec, key[1], key[2], dtype=key[3], slowdown=self.config.slowdown
                    ),
                )
                self._shard = (key, shard)
            assignment = _Assignment(
                run=run,
                epoch=epoch,
                start=int(body["start"]),
                end=int(body["end"]),
                index=int(body["index"]),
                num_stages=int(body["num_stages"]),
                upstream=str(body["upstream"]),
                downstream=str(body["downstream"]),
                downstream_endpoint=str(body["downstream_endpoint"]),
                shard=shard,
                upstream_key=body.get("upstream_key"),
                downstream_key=body.get("downstream_key"),
                training=training,
            )
            senders = [assignment.upstream_key]
            if training is not None:
                senders = self._prepare_training(assignment, dict(body["train"]))
            if self._data_allow is not None:
                # Allowed before anyone connects: a refused CURVE handshake is not retried.
                self._data_allow.replace([k.encode() for k in senders if k])
        except Exception as exc:  # any failure to build is reported, and the stage keeps serving
            log.error("assignment_failed", stage=self.config.name, run=run, error=str(exc))
            await self._send_control(
                "assign_failed",
                {"run": run, "name": self.config.name, "error": f"{type(exc).__name__}: {exc}"},
                epoch=epoch,
            )
            return
        self._pending = assignment
        build_s = time.monotonic() - started
        log.info(
            "assignment_ready",
            stage=self.config.name,
            run=run,
            epoch=epoch,
            build_s=round(build_s, 3),
            reused=reused,
        )
        ready: dict[str, Any] = {"run": run, "name": self.config.name, "build_s": build_s}
        if assignment.ring_endpoint:
            ready["ring_endpoint"] = assignment.ring_endpoint
        await self._send_control("ready", ready, epoch=epoch)

    async def _connect(self, message: Message) -> None:
        """Second phase of an assignment: every stage now allows its upstream's key."""
        run = int(message["run"])
        if self._pending is None or self._pending.run != run:
            raise ProtocolError(f"connect for run {run}, which this stage was not assigned")
        assignment = self._pending
        self._pending = None
        try:
            if assignment.training is not None:
                await self._connect_training(assignment, message.get("ring"))
            else:
                self._connect_downstream(assignment, assignment.downstream_key)
        except Exception as exc:
            await self._send_control(
                "assign_failed",
                {"run": run, "name": self.config.name, "error": f"{type(exc).__name__}: {exc}"},
                epoch=assignment.epoch,
            )
            return
        self._assignment = assignment
        self.counters.reset()
        self._start_data_tasks(assignment)
        log.info(
            "connected",
            stage=self.config.name,
            run=run,
            epoch=assignment.epoch,
            downstream=assignment.downstream,
        )
        await self._send_control(
            "connected", {"run": run, "name": self.config.name}, epoch=assignment.epoch
        )

    def _connect_downstream(self, assignment: _Assignment, downstream_key: str | None) -> None:
        self._downstream = self._connect_push(
            self._downstream,
            assignment.downstream_endpoint,
            downstream_key,
            assignment.downstream,
        )

    def _connect_push(
        self, old: zmq.asyncio.Socket | None, endpoint: str, key: str | None, peer: str
    ) -> zmq.asyncio.Socket:
        if old is not None:
            old.close(linger=0)
        if not endpoint:
            raise ConfigError(f"the coordinator sent no endpoint for {peer!r}")
        sock = open_socket(self._context, zmq.PUSH, self.config.socket_options)
        if self._keypair is not None:
            if not key:
                raise ConfigError(f"the coordinator sent no public key for {peer!r}")
            security.secure_client(sock, self._keypair, key.encode())
        sock.connect(endpoint)
        return sock

    # ------------------------------------------------------------- data plane

    def _start_data_tasks(self, assignment: _Assignment) -> None:
        if assignment.training is not None:
            self._start_training_tasks(assignment, assignment.training)
            return
        inbox: asyncio.Queue[Message] = asyncio.Queue(2)
        outbox: asyncio.Queue[Message] = asyncio.Queue(2)
        if not self.config.link.is_ideal:
            self._link = EmulatedLink(self.config.link, self._send_downstream)
        self._data_tasks = [
            asyncio.create_task(self._receive_loop(assignment, inbox)),
            asyncio.create_task(self._compute_loop(assignment, inbox, outbox)),
            asyncio.create_task(self._send_loop(assignment, outbox)),
        ]

    # ---------------------------------------------------------- training plane

    def _training_setup(self, message: Message) -> TrainingSetup:
        body = message.body
        train = body.get("train")
        if not isinstance(train, dict):
            raise ConfigError("a training assignment needs its 'train' settings")

        def group(entry: Any) -> Group:
            names = tuple(str(n) for n in entry["names"])
            shares = tuple(int(x) for x in entry["shares"])
            if not names or len(names) != len(shares):
                raise ValueError(f"a group needs one share per device: {entry!r}")
            return Group(names, shares)

        try:
            own = group(train["group"])
            rank = int(train["group"]["rank"])
            if not 0 <= rank < len(own.names) or own.names[rank] != self.config.name:
                raise ValueError(f"rank {rank} of {own.names} is not {self.config.name!r}")
            return TrainingSetup(
                run=int(body["run"]),
                epoch=message.epoch,
                name=self.config.name,
                index=int(body["index"]),
                num_stages=int(body["num_stages"]),
                schedule=str(train["schedule"]),
                num_microbatches=int(train["num_microbatches"]),
                warmup=int(train["warmup"]),
                group=own,
                rank=rank,
                upstream=group(train["upstream"]),
                downstream=group(train["downstream"]),
                wait_s=self.config.timeouts.result_s,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed training settings: {exc!r}") from None

    def _prepare_training(self, assignment: _Assignment, train: dict[str, Any]) -> list[str | None]:
        """Note every neighbour's endpoint and key, reserve a ring port; the senders to allow."""
        allowed: list[str | None] = []
        for side in ("upstream", "downstream"):
            entry = train[side]
            keys = list(entry.get("keys") or [None] * len(entry["names"]))
            allowed += keys
            for name, endpoint, key in zip(entry["names"], entry["endpoints"], keys, strict=True):
                if side == "downstream" or name != CLIENT:
                    assignment.peers[str(name)] = (str(endpoint), key)
        setup = assignment.training
        assert setup is not None
        if len(setup.group.names) > 1:
            host = self.data_endpoint.rsplit(":", 1)[0]
            bind_host = self.config.data_bind.rsplit(":", 1)[0]
            port = free_tcp_port(bind_host)
            assignment.ring_bind = f"{bind_host}:{port}"
            assignment.ring_endpoint = f"{host}:{port}"
        return allowed

    async def _connect_training(self, assignment: _Assignment, ring: Any) -> None:
        for sock in self._peers.values():
            sock.close(linger=0)
        self._peers = {
            name: self._connect_push(None, endpoint, key, name)
            for name, (endpoint, key) in assignment.peers.items()
        }
        setup = assignment.training
        assert setup is not None
        if len(setup.group.names) > 1:
            if not isinstance(ring, dict):
                raise ConfigError("a shared stage was not told its all-reduce ring")
            keys = ring.get("keys")
            self._ring = RingAllReduce(
                context=self._context,
                rank=setup.rank,
                endpoints=[str(e) for e in ring["endpoints"]],
                bind=assignment.ring_bind,
                socket_options=self.config.socket_options,
                keypair=self._keypair,
                peer_keys=[str(k).encode() for k in keys] if self._keypair and keys else None,
                authenticator=self._authenticator,
                timeout_s=self.config.timeouts.result_s,
                epoch=assignment.epoch,
                name=f"stage {setup.index}",
                pace=self._pace_on_link,
            )
            await self._ring.start()

    async def _pace_on_link(self, nbytes: int) -> None:
        """All-reduce traffic crosses the device's one (emulated) radio too."""
        if self._link is not None:
            await self._link.pace(nbytes)

    def _start_training_tasks(self, assignment: _Assignment, setup: TrainingSetup) -> None:
        assert isinstance(assignment.shard, TrainShard)
        outbox: asyncio.Queue[tuple[str, Message]] = asyncio.Queue()
        if not self.config.link.is_ideal:
            # One emulated link for both directions: a device has one radio.
            self._link = EmulatedLink(self.config.link, self._send_to_neighbour)

        async def queue_send(target: str, message: Message) -> None:
            outbox.put_nowait((target, message))

        self._trainer = TrainingExecutor(
            setup,
            assignment.shard,
            send=queue_send,
            compute=self._compute,
            counters=self.counters,
            reducer=self._ring,
        )
        self._data_tasks = [
            asyncio.create_task(self._receive_loop(assignment, asyncio.Queue(1))),
            asyncio.create_task(self._trainer.run()),
            asyncio.create_task(self._training_send_loop(assignment, outbox)),
        ]

    async def _deliver_training(self, message: Message) -> None:
        trainer = self._trainer
        assert trainer is not None
        if message.kind == "error":
            # A stage upstream failed: the round cannot finish; tell the client.
            await trainer.pass_on_error(message)
            return
        try:
            trainer.deliver(message)
        except ZpipeError as exc:
            self.counters.dropped += 1
            log.warning("dropped_message", stage=self.config.name, error=str(exc))

    async def _training_send_loop(
        self, assignment: _Assignment, outbox: asyncio.Queue[tuple[str, Message]]
    ) -> None:
        while True:
            target, message = await outbox.get()
            started = time.perf_counter()
            try:
                if self._link is not None:
                    nbytes = sum(t.numel() * t.element_size() for t in message.tensors)
                    await self._link.submit((target, message), nbytes)
                else:
                    await self._send_to_neighbour((target, message))
            except ZpipeError as exc:  # the coordinator decides what a stuck peer means
                log.error(
                    "send_failed",
                    stage=self.config.name,
                    epoch=assignment.epoch,
                    kind=message.kind,
                    error=str(exc),
                )
            self.counters.send_s += time.perf_counter() - started

    async def _send_to_neighbour(self, item: object) -> None:
        assert isinstance(item, tuple)
        peer, message = item
        sock = self._peers.get(peer)
        if sock is None:
            raise ConfigError(f"no socket to send {message.kind} to {peer!r}")
        self.counters.bytes_out += await send(
            sock, message, timeout_s=self.config.timeouts.send_s, peer=peer
        )

    async def _send_weights(self, message: Message) -> None:
        """Once round ``step`` is done here, send this stage's weights to the coordinator."""
        run, step = int(message["run"]), int(message["step"])
        reply: dict[str, Any] = {
            "run": run,
            "name": self.config.name,
            "step": step,
            "keys": [],
            "error": "",
        }
        tensors: tuple[torch.Tensor, ...] = ()
        trainer = self._trainer
        try:
            if trainer is None or trainer.setup.run != run:
                raise ConfigError(f"this stage is not training run {run}")
            shard = trainer.shard
            if message.get("latest"):
                # The run broke elsewhere: stop it here, then read the state in the
                # compute thread, after whatever step it was running.
                await self._stop_data_tasks()
                loop = asyncio.get_running_loop()
                state = await loop.run_in_executor(self._compute, shard.training_state)
                reply["completed"] = trainer.completed_steps
            else:
                await trainer.wait_for_step(step, self.config.timeouts.result_s)
                state = shard.training_state() if message.get("optimizer") else shard.state_dict()
            if len(state) > codec.MAX_TENSORS:
                raise ConfigError(
                    f"this stage holds {len(state)} tensors, more than one message "
                    f"carries ({codec.MAX_TENSORS})"
                )
            reply["keys"] = list(state)
            reply["metrics"] = self.counters.to_dict()
            tensors = tuple(state.values())
        except ZpipeError as exc:
            reply["error"] = f"{type(exc).__name__}: {exc}"
            log.error("weights_not_sent", stage=self.config.name, error=reply["error"])
        await self._send_control("weights", reply, epoch=message.epoch, tensors=tensors)

    async def _backup(self, message: Message) -> None:
        """Once round ``step`` is done: keep a snapshot of this stage's state, and send
        a copy to its backup holder (a peer stage, or the coordinator in the reply)."""
        run, step = int(message["run"]), int(message["step"])
        holder = str(message["holder"])
        reply: dict[str, Any] = {"run": run, "name": self.config.name, "step": step,
                                 "holder": holder, "keys": [], "bytes": 0, "error": ""}  # fmt: skip
        tensors: tuple[torch.Tensor, ...] = ()
        trainer = self._trainer
        try:
            if trainer is None or trainer.setup.run != run:
                raise ConfigError(f"this stage is not training run {run}")
            await trainer.wait_for_step(step, self.config.timeouts.result_s)
            loop = asyncio.get_running_loop()
            state = await loop.run_in_executor(
                self._compute,
                lambda: {k: t.clone() for k, t in trainer.shard.training_state().items()},
            )
            self.replicas.put(self.config.name, run, step, state)
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
            reply["bytes"] = nbytes
            reply["metrics"] = self.counters.to_dict()
            if holder == "coordinator":
                reply["keys"], tensors = list(state), tuple(state.values())
            elif holder:
                await self._pace_on_link(nbytes)
                answer = await peer_request(
                    self._context,
                    peer=holder,
                    endpoint=str(message["holder_endpoint"]),
                    server_key=message.get("holder_key"),
                    keypair=self._keypair,
                    message=Message(
                        "backup",
                        {"run": run, "step": step, "owner": self.config.name, "keys": list(state)},
                        tensors=tuple(state.values()),
                    ),
                    expect="backup_ok",
                    options=self.config.socket_options,
                    timeout_s=self.config.timeouts.result_s,
                )
                if answer["error"]:
                    raise ConfigError(f"{holder} did not keep the backup: {answer['error']}")
        except ZpipeError as exc:
            reply["error"] = f"{type(exc).__name__}: {exc}"
            log.error("backup_failed", stage=self.config.name, error=reply["error"])
        await self._send_control("backed_up", reply, epoch=message.epoch, tensors=tensors)

    async def _on_peer_request(self, message: Message) -> Message:
        """A peer's backup to keep, or units of a snapshot a peer fetches."""
        if message.kind == "backup":
            keys = [str(k) for k in message["keys"]]
            if len(keys) != len(message.tensors):
                return Message("backup_ok", {"run": message["run"], "step": message["step"],
                                             "error": "keys and tensors do not match"})  # fmt: skip
            # Copies: the frames' memory belongs to the zmq message.
            state = {k: t.clone() for k, t in zip(keys, message.tensors, strict=True)}
            self.replicas.put(
                str(message["owner"]), int(message["run"]), int(message["step"]), state
            )
            log.info("backup_kept", stage=self.config.name, owner=message["owner"],
                     run=message["run"], step=message["step"])  # fmt: skip
            return Message(
                "backup_ok", {"run": message["run"], "step": message["step"], "error": ""}
            )
        try:
            units = self.replicas.units(
                str(message["owner"]), int(message["run"]), int(message["step"]),
                int(message["start"]), int(message["end"]),
            )  # fmt: skip
        except ConfigError as exc:
            return Message("units", {"keys": [], "error": str(exc)})
        return Message("units", {"keys": list(units), "error": ""}, tensors=tuple(units.values()))

    async def _fetched_state(self, fetch: list[Any]) -> dict[str, torch.Tensor]:
        """The units an assignment says to take from snapshots: this stage's own or a
        peer's (its snapshot, or a backup it holds), fetched from that peer."""
        state: dict[str, torch.Tensor] = {}
        for entry in fetch:
            if not isinstance(entry, dict):
                raise ProtocolError("a fetch entry must be a map")
            owner, source = str(entry["owner"]), str(entry["from"])
            run, step = int(entry["run"]), int(entry["step"])
            start, end = int(entry["start"]), int(entry["end"])
            if source == self.config.name:
                units = self.replicas.units(owner, run, step, start, end)
                state.update({k: t.clone() for k, t in units.items()})
                continue
            reply = await peer_request(
                self._context,
                peer=source,
                endpoint=str(entry["endpoint"]),
                server_key=entry.get("key"),
                keypair=self._keypair,
                message=Message(
                    "fetch_units",
                    {"owner": owner, "run": run, "step": step, "start": start, "end": end},
                ),
                expect="units",
                options=self.config.socket_options,
                timeout_s=self.config.timeouts.result_s,
            )
            if reply["error"]:
                raise ConfigError(
                    f"{source} could not send units [{start}, {end}): {reply['error']}"
                )
            if len(reply["keys"]) != len(reply.tensors):
                raise ProtocolError(f"{source} sent mismatched units")
            state.update(
                {str(k): t.clone() for k, t in zip(reply["keys"], reply.tensors, strict=True)}
            )
        return state

    async def _stop_data_tasks(self) -> None:
        for task in self._data_tasks:
            task.cancel()
        for task in self._data_tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception as exc:
                log.error("data_task_failed", stage=self.config.name, error=str(exc))
        self._data_tasks = []
        self._trainer = None
        if self._ring is not None:
            # Before the next assignment sets its allow-list: closing takes the ring
            # neighbour's key back out of it.
            await self._ring.close()
            self._ring = None
        if self._link is not None:
            await self._link.close()
            self._link = None

    async def _receive_loop(self, assignment: _Assignment, inbox: asyncio.Queue[Message]) -> None:
        assert self._data_in is not None
        max_bytes = self.config.socket_options.max_message_bytes
        while True:
            frames = await recv_frames(
                self._data_in, timeout_s=None, peer=assignment.upstream, awaited="micro-batch"
            )
            self.counters.bytes_in += frames_nbytes(frames)
            try:
                self._check_sender(frames[0])
                message = decode_frames(frames, max_bytes)
                self._check_data_message(message, assignment)
            except ProtocolError as exc:
                self.counters.dropped += 1
                log.warning(
                    "dropped_message",
                    stage=self.config.name,
                    epoch=assignment.epoch,
                    error=str(exc),
                )
                continue
            if self._trainer is not None and message.epoch == assignment.epoch:
                await self._deliver_training(message)
                continue
            if message.epoch != assignment.epoch:
                self.counters.stale += 1
                log.debug(
                    "stale_message",
                    stage=self.config.name,
                    epoch=message.epoch,
                    current=assignment.epoch,
                )
                continue
            await inbox.put(message)

    def _check_sender(self, frame: zmq.Frame) -> None:
        """CURVE checks keys only at the handshake: a peer connected under an older
        assignment could keep sending, so each message's key is checked again."""
        if self._data_allow is None:
            return
        key = security.sender_public_key(frame)
        if key is None or key not in self._data_allow:
            raise ProtocolError("data from a peer that is not the assigned upstream")

    def _check_data_message(self, message: Message, assignment: _Assignment) -> None:
        setup = assignment.training
        senders: dict[str, tuple[str, ...]] = {
            "data": (assignment.upstream,),
            "error": (assignment.upstream,),
        }
        if setup is not None:
            senders = {"data": setup.upstream.names, "error": setup.upstream.names}
            senders["grad"] = setup.downstream.names
            if setup.last:
                senders["labels"] = (CLIENT,)
        expected = senders.get(message.kind)
        if expected is None:
            raise ProtocolError(f"{message.kind!r} does not belong on the data port")
        if message["src"] not in expected:
            raise ProtocolError(
                f"{message.kind} from {message['src']!r}, but it must come from {list(expected)}"
            )
        if setup is None and message.kind != "error" and not message.tensors:
            raise ProtocolError(f"a {message.kind} message carries no tensors")

    async def _compute_loop(
        self, assignment: _Assignment, inbox: asyncio.Queue[Message], outbox: asyncio.Queue[Message]
    ) -> None:
        loop = asyncio.get_running_loop()
        name = self.config.name
        counters = self.counters
        shard = assignment.shard
        assert isinstance(shard, Shard)
        streaming = False  # idle time counts from the first input, not from the assignment
        while True:
            waited_from = time.perf_counter()
            message = await inbox.get()
            if streaming:
                counters.idle_s += time.perf_counter() - waited_from
            streaming = True
            mb = int(message["mb"])
            if message.kind == "error":
                # Someone upstream failed on this micro-batch: pass the word on.
                out = Message("error", {**message.body, "src": name}, epoch=assignment.epoch)
            else:
                computing_from = time.perf_counter()
                try:
                    outputs, _ = await loop.run_in_executor(
                        self._compute, shard.forward, message.tensors
                    )
                    counters.busy_s += time.perf_counter() - computing_from
                    counters.microbatches += 1
                    out = Message(
                        "data",
                        {"run": assignment.run, "mb": mb, "src": name},
                        epoch=assignment.epoch,
                        tensors=outputs,
                    )
                except Exception as exc:  # a bad input must not take the stage down
                    counters.busy_s += time.perf_counter() - computing_from
                    counters.errors += 1
                    log.warning(
                        "microbatch_failed",
                        stage=name,
                        epoch=assignment.epoch,
                        mb=mb,
                        error=str(exc),
                    )
                    out = Message(
                        "error",
                        {
                            "run": assignment.run,
                            "mb": mb,
                            "src": name,
                            "stage": name,
                            "message": f"{type(exc).__name__}: {exc}",
                        },
                        epoch=assignment.epoch,
                    )
            log.debug("microbatch_done", stage=name, epoch=assignment.epoch, mb=mb)
            blocked_from = time.perf_counter()
            await outbox.put(out)
            counters.blocked_s += time.perf_counter() - blocked_from

    async def _send_loop(self, assignment: _Assignment, outbox: asyncio.Queue[Message]) -> None:
        while True:
            message = await outbox.get()
            started = time.perf_counter()
            try:
                if self._link is not None:
                    nbytes = sum(t.numel() * t.element_size() for t in message.tensors)
                    delivered = await self._link.submit(message, nbytes)
                    if not delivered:
                        self.counters.lost += 1
                else:
                    await self._send_downstream(message)
            except TransportTimeout as exc:
                # The coordinator decides what a stuck downstream means; keep serving.
                log.error(
                    "send_failed",
                    stage=self.config.name,
                    epoch=assignment.epoch,
                    mb=message["mb"],
                    error=str(exc),
                )
            self.counters.send_s += time.perf_counter() - started

    async def _send_downstream(self, item: object) -> None:
        assert self._downstream is not None and isinstance(item, Message)
        peer = self._assignment.downstream if self._assignment else "downstream"
        self.counters.bytes_out += await send(
            self._downstream, item, timeout_s=self.config.timeouts.send_s, peer=peer
        )

    # --------------------------------------------------------------- shutdown

    async def close(self) -> None:
        await self._stop_data_tasks()
        if self._assign_task is not None:
            self._assign_task.cancel()
        if self._link_probe_task is not None:
            self._link_probe_task.cancel()
        if self._probe_responder is not None:
            await self._probe_responder.close()
        if self._weights_task is not None:
            self._weights_task.cancel()
        for peer in self._peers.values():
            peer.close(linger=0)
        if self._ring is not None:
            await self._ring.close()
        for sock in (
            self._downstream,
            self._data_in,
            self._probe_in,
            self._control,
        ):
            if sock is not None:
                sock.close(linger=0)
        if self._authenticator is not None:
            self._authenticator.stop()
        self._compute.shutdown(wait=False, cancel_futures=True)
        self._context.term()


def _resumed_state(message: Message) -> dict[str, torch.Tensor] | None:
    """The replica an assignment carries (weights and optimizer state), if any."""
    keys = message.get("state_keys")
    if keys is None:
        if message.tensors:
            raise ProtocolError("an assignment carries tensors but no state_keys")
        return None
    if len(keys) != len(message.tensors) or not all(isinstance(k, str) for k in keys):
        raise ProtocolError("an assignment's state_keys do not match its tensors")
    # Copies: the frames' memory belongs to the zmq message, the shard keeps these.
    return {k: t.clone() for k, t in zip(keys, message.tensors, strict=True)}
