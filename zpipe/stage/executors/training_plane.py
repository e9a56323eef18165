"""The training glue of a stage: its settings, its neighbours, its ring, its sends.

:mod:`zpipe.stage.executors.sync_training` runs a schedule's actions; this module connects it
to the world: it reads a training assignment's settings
(:func:`training_setup`), notes every neighbour device's endpoint and key and
binds its all-reduce port (:func:`prepare_training`), then, once the
coordinator says connect, opens a PUSH to every neighbour and joins the
group's ring (:class:`TrainingPlane`), hands arrived pieces to the executor
and sends what it queues, over the device's one (possibly emulated) radio.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import zmq.asyncio

from zpipe._errors import PeerGoneError, ProtocolError, ZpipeError
from zpipe.log import get_logger
from zpipe.planner.async_schedule import ASYNC_SCHEDULE
from zpipe.protocol.data_plane import MicroBatchError
from zpipe.protocol.stage_control import Assign
from zpipe.stage.assignment import Assignment, PushConnector
from zpipe.stage.data_parallel import RingAllReduce, RingPort
from zpipe.stage.dataport import DataMessage
from zpipe.stage.executors.async_training import AsyncTrainingExecutor
from zpipe.stage.executors.sync_training import (
    DataParallelGroup,
    Outgoing,
    TrainingExecutor,
    TrainingSetup,
)
from zpipe.stage.executors.training_shard import TrainShard
from zpipe.stage.lifecycle import CLIENT
from zpipe.stage.live_copies import ChainPeer, CopyRoutes, LiveCopySender
from zpipe.stage.metrics import LinkMeter, StageCounters
from zpipe.stage.speed_watch import StageSpeedWatch
from zpipe.transport import security
from zpipe.transport.codec import Message
from zpipe.transport.emulation import EmulatedLink, LinkSpec
from zpipe.transport.sockets import SocketOptions, send

log = get_logger("zpipe.stage")


def training_setup(message: Assign, *, name: str, wait_s: float) -> TrainingSetup:
    """A training assignment's settings, checked; a :class:`ProtocolError` if malformed."""
    train = message.train
    if not isinstance(train, dict):
        raise ProtocolError("a training assignment needs its 'train' settings")

    def group(entry: Any) -> DataParallelGroup:
        names = tuple(str(n) for n in entry["names"])
        shares = tuple(int(x) for x in entry["shares"])
        if not names or len(names) != len(shares):
            raise ValueError(f"a group needs one share per device: {entry!r}")
        return DataParallelGroup(names, shares)

    try:
        own = group(train["group"])
        rank = int(train["group"]["rank"])
        if not 0 <= rank < len(own.names) or own.names[rank] != name:
            raise ValueError(f"rank {rank} of {own.names} is not {name!r}")
        return TrainingSetup(
            run=message.run,
            epoch=message.epoch,
            name=name,
            index=message.index,
            num_stages=message.num_stages,
            schedule=str(train["schedule"]),
            num_microbatches=int(train["num_microbatches"]),
            warmup=int(train["warmup"]),
            group=own,
            rank=rank,
            upstream=group(train["upstream"]),
            downstream=group(train["downstream"]),
            wait_s=wait_s,
            backup_from=tuple(str(n) for n in train.get("backup_from") or ()),
            async_settings=dict(train["async"]) if train.get("async") is not None else None,
            chain_to=_chain_peer(train.get("chain_to")),
            forward_watch=_forward_watch(train.get("forward_watch")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed training settings: {exc!r}") from None


def _forward_watch(value: Any) -> float | None:
    """The forward watch's factor (None: no watch); ValueError unless a number > 1."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"forward_watch must be a number, got {value!r}")
    if not (math.isfinite(value) and value > 1):
        raise ValueError(f"forward_watch must be a factor > 1, got {value}")
    return float(value)


def _chain_peer(entry: Any) -> ChainPeer | None:
    """The next stage that holds this one's chain copies (None: the coordinator does)."""
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise ValueError(f"chain_to must be a map, got {entry!r}")
    key = entry.get("key")
    return ChainPeer(str(entry["name"]), str(entry["endpoint"]), None if key is None else str(key))


def prepare_training(
    assignment: Assignment,
    train: dict[str, Any],
    *,
    data_endpoint: str,
    data_bind: str,
    ring_sockets: RingSockets,
) -> list[str | None]:
    """Note every neighbour's endpoint and key, bind the ring port; the senders to allow."""
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
        # Bound now, on any free port, and reported as bound: a port picked, closed
        # and bound at connect could be taken meanwhile by any socket bound to port 0.
        port = ring_sockets.open_port(
            bind=data_bind.rsplit(":", 1)[0] + ":0",
            prev_key=_previous_rank_key(train["group"], setup.rank, ring_sockets.secured),
            prev_label=f"rank {(setup.rank - 1) % len(setup.group.names)} of stage {setup.index}",
        )
        assignment.ring_port = port
        assignment.ring_endpoint = f"{data_endpoint.rsplit(':', 1)[0]}:{port.port}"
    return allowed


def _previous_rank_key(group: dict[str, Any], rank: int, secured: bool) -> bytes | None:
    """The public key of the rank before ``rank`` in its group, which alone may connect
    to this rank's ring port; None without keys."""
    if not secured:
        return None
    keys = group.get("keys")
    names = group["names"]
    if not isinstance(keys, list) or len(keys) != len(names):
        # A coordinator from before the ring port was bound at assignment sends the
        # group's keys only with "connect", too late for a port that is already bound.
        raise ProtocolError(
            "a secured data-parallel group needs its devices' public keys in the "
            "assignment's group (is the coordinator older than this stage? run one "
            "zpipe version on every device)"
        )
    prev = (rank - 1) % len(names)
    key = keys[prev]
    if not isinstance(key, str) or not key:
        raise ProtocolError(f"the assignment's group has no public key for rank {prev}")
    return key.encode()


@dataclass(frozen=True)
class RingSockets:
    """What a stage opens its ring ports with: its context, socket options and keys."""

    context: zmq.asyncio.Context
    options: SocketOptions
    keypair: security.KeyPair | None = None
    authenticator: security.CurveAuthenticator | None = None

    @property
    def secured(self) -> bool:
        return self.keypair is not None

    def open_port(self, *, bind: str, prev_key: bytes | None, prev_label: str) -> RingPort:
        return RingPort(
            context=self.context,
            bind=bind,
            options=self.options,
            keypair=self.keypair,
            prev_key=prev_key,
            prev_label=prev_label,
            authenticator=self.authenticator,
        )


class TrainingPlane:
    """One training assignment's sockets to its neighbours, its ring and its executor."""

    def __init__(
        self,
        *,
        assignment: Assignment,
        context: zmq.asyncio.Context,
        connector: PushConnector,
        compute: ThreadPoolExecutor,
        counters: StageCounters,
        link: LinkSpec,
        socket_options: SocketOptions,
        keypair: security.KeyPair | None,
        authenticator: security.CurveAuthenticator | None,
        timeout_s: float,
        send_timeout_s: float,
        copy_routes: CopyRoutes | None = None,
    ) -> None:
        assert assignment.training is not None and isinstance(assignment.shard, TrainShard)
        self.assignment = assignment
        self.setup: TrainingSetup = assignment.training
        self._context = context
        self._connector = connector
        self._compute = compute
        self._counters = counters
        # how long the bytes take to leave, and a bound on what is on its way
        self._meter = LinkMeter(counters)
        self._options = socket_options
        self._keypair = keypair
        self._authenticator = authenticator
        self._timeout_s = timeout_s
        self._send_timeout_s = send_timeout_s
        self._peers: dict[str, zmq.asyncio.Socket] = {}
        self._ring: RingAllReduce | None = None
        # (neighbour, micro-batch, the encoded message): the timeline names the batch
        self._outbox: asyncio.Queue[tuple[str, int, Message]] = asyncio.Queue()
        # One emulated link for both directions: a device has one radio.
        self._link = None if link.is_ideal else EmulatedLink(link, self._send_to_neighbour)
        self.trainer: TrainingExecutor | None = None
        self._copy_routes = copy_routes

    async def connect(self, ring: Any) -> None:
        """Open a PUSH to every neighbour, join the group's ring, make the executor."""
        self._peers = {
            name: self._connector(endpoint, key, name)
            for name, (endpoint, key) in self.assignment.peers.items()
        }
        setup = self.setup
        if len(setup.group.names) > 1:
            if not isinstance(ring, dict):
                raise ProtocolError("a shared stage was not told its all-reduce ring")
            keys = ring.get("keys")
            if self.assignment.ring_port is None:
                raise ProtocolError("a shared stage has no ring port (it was not assigned one)")
            self._ring = RingAllReduce(
                context=self._context,
                rank=setup.rank,
                endpoints=[str(e) for e in ring["endpoints"]],
                port=self.assignment.ring_port,
                socket_options=self._options,
                keypair=self._keypair,
                peer_keys=[str(k).encode() for k in keys] if self._keypair and keys else None,
                authenticator=self._authenticator,
                timeout_s=self._timeout_s,
                epoch=self.assignment.epoch,
                name=f"stage {setup.index}",
                pace=self.pace,
            )
            self.assignment.ring_port = None  # the ring owns it now, and closes it
            await self._ring.start()
        shard = self.assignment.shard
        assert isinstance(shard, TrainShard)
        executor = AsyncTrainingExecutor if setup.schedule == ASYNC_SCHEDULE else TrainingExecutor
        self.trainer = executor(
            setup,
            shard,
            send=self._queue_send,
            compute=self._compute,
            counters=self._counters,
            reducer=self._ring,
        )
        trainer = self.trainer
        if (
            isinstance(trainer, AsyncTrainingExecutor)
            and trainer.settings.live_copies
            and self._copy_routes is not None
        ):
            trainer.copies = LiveCopySender(
                name=setup.name,
                chain_to=setup.chain_to,
                routes=self._copy_routes,
                counters=self._counters,
            )
        if (
            isinstance(trainer, AsyncTrainingExecutor)
            and setup.forward_watch is not None
            and self._copy_routes is not None
        ):
            # its verdicts go up the coordinator connection, as the live copies' notices
            trainer.speed_watch = StageSpeedWatch(
                run=setup.run, name=setup.name, epoch=setup.epoch, factor=setup.forward_watch
            )
            trainer.report_speed = self._copy_routes.to_coordinator

    def rewire(self, setup: TrainingSetup, peers: dict[str, tuple[str, str | None]]) -> None:
        """A re-partition left a device out: ``setup`` from here on, and a PUSH to each
        new neighbour of ``peers`` (those already open stay)."""
        self.setup = self.assignment.training = setup
        for name, (endpoint, key) in peers.items():
            if name not in self._peers:
                self._peers[name] = self._connector(endpoint, key, name)
                self.assignment.peers[name] = (endpoint, key)

    async def _queue_send(self, target: str, message: Outgoing) -> None:
        self._outbox.put_nowait((target, message.mb, message.to_message()))

    async def pace(self, nbytes: int) -> None:
        """All-reduce traffic and backups cross the device's one (emulated) radio too."""
        if self._link is not None:
            await self._link.pace(nbytes)

    async def deliver(self, message: DataMessage) -> None:
        """A checked piece of this assignment's epoch, for the executor."""
        trainer = self.trainer
        assert trainer is not None
        if isinstance(message, MicroBatchError):
            # A stage upstream failed: the round cannot finish; tell the client.
            await trainer.pass_on_error(message)
            return
        try:
            trainer.deliver(message)
        except ZpipeError as exc:
            self._counters.dropped += 1
            log.warning("dropped_message", stage=self.setup.name, peer=message.src, error=str(exc))

    async def run(self) -> None:
        trainer = self.trainer
        assert trainer is not None
        copies = trainer.copies if isinstance(trainer, AsyncTrainingExecutor) else None
        if copies is None:
            await trainer.run()
            return
        # the copies leave beside the training; the last period's copy (offered as the
        # training ends) still leaves before the run reports done, bounded like a result
        sender = asyncio.create_task(copies.run(), name="live-copies")
        try:
            await trainer.run()
            await copies.drain(self._timeout_s)
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender

    async def send_loop(self) -> None:
        while True:
            target, mb, message = await self._outbox.get()
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
                    stage=self.setup.name,
                    epoch=self.assignment.epoch,
                    kind=message.kind,
                    peer=target,
                    error=str(exc),
                )
            sent_at = time.perf_counter()
            self._counters.send_s += sent_at - started
            self._counters.timeline.record(mb, "send", started, sent_at)

    async def _send_to_neighbour(self, item: object) -> None:
        assert isinstance(item, tuple)
        peer, message = item
        sock = self._peers.get(peer)
        if sock is None:
            raise PeerGoneError(peer, message.kind)  # not a neighbour of this assignment
        await self._meter.room(timeout_s=self._send_timeout_s)
        try:
            self._counters.bytes_out += await send(
                sock,
                message,
                timeout_s=self._send_timeout_s,
                peer=peer,
                on_queued=self._meter.track,
            )
        except BaseException:
            self._meter.release()  # not queued: its place in the window is free again
            raise

    async def close(self) -> None:
        self._meter.close()
        # Before the next assignment sets its allow-list: closing the ring takes the
        # ring neighbour's key back out of it.
        if self._ring is not None:
            await self._ring.close()
            self._ring = None
        self.assignment.release_ring_port()  # a connect that failed before the ring took it
        if self._link is not None:
            await self._link.close()
            self._link = None

    def release_peers(self) -> None:
        """Close the sockets to the neighbours: only once the next assignment connects
        (or the stage closes), so what they still queue gets a chance to leave."""
        for sock in self._peers.values():
            sock.close(linger=0)
        self._peers = {}
