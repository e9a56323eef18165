"""An assignment of units to this stage, and building its shard.

An ``assign`` message names the model, the unit range, the neighbours and the
plan epoch; :class:`AssignmentBuilder` builds the shard in the compute thread
(inference shards are kept and reused when the next run asks for the same
units; training shards are built afresh, from a replica or from snapshots
fetched from peers) and returns the :class:`Assignment` the runtime connects
once the coordinator says so.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq
import zmq.asyncio

from zpipe._errors import ConfigError, ProtocolError
from zpipe.log import get_logger
from zpipe.models import ModelSpec
from zpipe.planner.async_schedule import ASYNC_SCHEDULE
from zpipe.planner.profile import ModelProfile
from zpipe.protocol.generation import GenSetup
from zpipe.protocol.stage_control import Assign
from zpipe.stage.data_parallel import RingPort
from zpipe.stage.emulated_compute import EmulatedShard
from zpipe.stage.executors.async_shard import AsyncShard
from zpipe.stage.executors.sync_training import TrainingSetup
from zpipe.stage.executors.training_shard import TrainShard
from zpipe.stage.shard import Shard
from zpipe.training.async_fast_state import unit_digests
from zpipe.transport import security
from zpipe.transport.slowdown import Slowdown, slowdown_factor
from zpipe.transport.sockets import SocketOptions, open_socket

log = get_logger("zpipe.stage")


@dataclass
class Assignment:
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
    # that this one sends to, and this device's port in its group's all-reduce ring:
    # bound when assigned, so the endpoint reported is one this device holds (the
    # ring takes the port when it connects; until then the assignment owns it)
    training: TrainingSetup | None = None
    peers: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    ring_port: RingPort | None = None
    ring_endpoint: str = ""

    def release_ring_port(self) -> None:
        """Close the ring port if no ring took it (an assignment never connected)."""
        if self.ring_port is not None:
            self.ring_port.close()
            self.ring_port = None


@dataclass(frozen=True)
class BuiltAssignment:
    assignment: Assignment
    reused: bool  # the previous run's shard, kept
    senders: list[str | None]  # the public keys that may send to the data port


# (endpoint, public key, peer name) -> a connected PUSH socket
PushConnector = Callable[[str, "str | None", str], zmq.asyncio.Socket]


def push_connector(
    context: zmq.asyncio.Context, options: SocketOptions, keypair: security.KeyPair | None
) -> PushConnector:
    def connect(endpoint: str, key: str | None, peer: str) -> zmq.asyncio.Socket:
        if not endpoint:
            raise ProtocolError(f"the coordinator sent no endpoint for {peer!r}")
        sock = open_socket(context, zmq.PUSH, options)
        if keypair is not None:
            if not key:
                sock.close(linger=0)
                raise ProtocolError(f"the coordinator sent no public key for {peer!r}")
            security.secure_client(sock, keypair, key.encode())
        sock.connect(endpoint)
        return sock

    return connect


def sender_endpoints(message: Assign) -> list[str | None]:
    """The data endpoints of whoever sends to this stage under ``message``: the
    upstream's (inference), every upstream and downstream neighbour's (training;
    gradients come back from downstream). Without keys their hosts are who the data
    port admits (:mod:`zpipe.transport.address_auth`)."""
    if message.mode != "train" or not isinstance(message.train, dict):
        return [message.upstream_endpoint]
    out: list[str | None] = []
    for side in ("upstream", "downstream"):
        entry = message.train.get(side)
        endpoints = entry.get("endpoints") if isinstance(entry, dict) else None
        if isinstance(endpoints, list):
            out += [e if isinstance(e, str) else None for e in endpoints]
    return out


def generation_sender_endpoints(setup: GenSetup) -> list[str]:
    """The data endpoints of whoever sends to this stage in a generation run: its
    upstream stage (the first stage's is the last one, whose tokens close the ring)
    and, for the first stage, the client (at its sink). Empty when the coordinator
    named none (one from before ``upstream_endpoint``)."""
    return [e for e in (setup.upstream_endpoint, setup.sink_endpoint) if e]


def resumed_state(message: Assign) -> dict[str, torch.Tensor] | None:
    """The replica an assignment carries (weights and optimizer state), if any."""
    keys = message.state_keys
    if keys is None:
        if message.tensors:
            raise ProtocolError("an assignment carries tensors but no state_keys")
        return None
    if len(keys) != len(message.tensors) or not all(isinstance(k, str) for k in keys):
        raise ProtocolError("an assignment's state_keys do not match its tensors")
    # Copies: the frames' memory belongs to the zmq message, the shard keeps these.
    return {k: t.clone() for k, t in zip(keys, message.tensors, strict=True)}


def _build_training(kind: type[TrainShard], spec: ModelSpec, start: int, end: int, *,
                    run: int, **settings: Any) -> TrainShard:  # fmt: skip
    """A training shard (compute thread); an asynchronous one resumed from a state logs
    each unit's digest and its update count (a fast recovery's survivors compare it
    with what they had: zpipe.coordinator.runs.async_fast_recovery)."""
    shard = kind.build(spec, start, end, **settings)
    if isinstance(shard, AsyncShard) and settings.get("state") is not None:
        log.info("async_state_resumed", run=run, updates=shard.updates,
                 digests=unit_digests(shard.training_state()))  # fmt: skip
    return shard


ShardKey = tuple[ModelSpec, int, int, str]  # (spec, start, end, dtype)
# the units an assignment's "fetch" list names, from snapshots here or at peers
FetchState = Callable[[list[Any], ModelSpec], Awaitable[dict[str, torch.Tensor]]]
# (assignment, its "train" settings) -> the senders to allow
PrepareTraining = Callable[[Assignment, dict[str, Any]], list["str | None"]]
ParseTraining = Callable[[Assign], TrainingSetup]


class AssignmentBuilder:
    """Builds assignments' shards in the compute thread; keeps the last inference shard."""

    def __init__(
        self,
        *,
        compute: ThreadPoolExecutor,
        slowdown: Slowdown,
        emulate_compute: ModelProfile | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self._compute = compute
        self._slowdown = slowdown
        self._emulate = emulate_compute  # build emulated shards from this profile
        self._device = torch.device(device)  # where the shards compute (--device)
        # The last shard built, by (spec, start, end, dtype), so a repeated run reuses it.
        self._cached: tuple[ShardKey, Shard] | None = None

    async def build(
        self,
        message: Assign,
        *,
        parse_training: ParseTraining,
        prepare_training: PrepareTraining,
        fetch_state: FetchState,
    ) -> BuiltAssignment:
        spec = ModelSpec.from_dict(message.model)
        key: ShardKey = (spec, message.start, message.end, message.dtype)
        reused = self._cached is not None and self._cached[0] == key
        training = parse_training(message) if message.mode == "train" else None
        loop = asyncio.get_running_loop()
        shard: Shard | TrainShard
        if training is not None and self._emulate is not None:
            raise ConfigError("--emulate-compute emulates inference only; it cannot train")
        if training is not None:
            # Trained weights are never reused by another run: build afresh.
            self._cached, reused = None, False
            train = dict(message.train or {})  # parse_training found the settings
            resumed = resumed_state(message)
            if message.fetch:
                # (the model: a fast recovery's "initial" entries are built from it)
                fetched = await fetch_state(list(message.fetch), spec)
                resumed = {**(resumed or {}), **fetched}
            # asynchronous 1F1B keeps weight versions (zpipe.stage.executors.async_shard)
            kind = AsyncShard if training.schedule == ASYNC_SCHEDULE else TrainShard
            shard = await loop.run_in_executor(
                self._compute,
                lambda: _build_training(
                    kind,
                    spec,
                    key[1],
                    key[2],
                    first=training.index == 0,
                    last=training.index == training.num_stages - 1,
                    loss=str(train["loss"]),
                    optimizer=dict(train["optimizer"]),
                    slowdown=self._slowdown,
                    state=resumed,
                    device=self._device,
                    lr_schedule=train.get("lr_schedule"),
                    start_step=int(train.get("start_step") or 0),
                    resume_optimizer=bool(train.get("resume_optimizer")),
                    run=message.run,
                ),
            )
        elif self._cached is not None and reused:
            shard = self._cached[1]  # the same units again: keep them, build nothing
        else:
            self._cached = None  # let the old units go before the new ones are built
            shard = await loop.run_in_executor(self._compute, lambda: self._build_shard(key))
            self._cached = (key, shard)
        assignment = Assignment(
            run=message.run,
            epoch=message.epoch,
            start=key[1],
            end=key[2],
            index=message.index,
            num_stages=message.num_stages,
            upstream=message.upstream,
            downstream=message.downstream,
            downstream_endpoint=message.downstream_endpoint,
            shard=shard,
            upstream_key=message.upstream_key,
            downstream_key=message.downstream_key,
            training=training,
        )
        senders = [assignment.upstream_key]
        if training is not None:
            senders = prepare_training(assignment, dict(message.train or {}))
        return BuiltAssignment(assignment, reused, senders)

    def _build_shard(self, key: ShardKey) -> Shard:
        spec, start, end, dtype = key
        if self._emulate is not None:
            return EmulatedShard.build_emulated(
                spec,
                start,
                end,
                self._emulate,
                dtype=dtype,
                slowdown=slowdown_factor(self._slowdown),  # a schedule: its factor now
            )
        return Shard.build(
            spec, start, end, dtype=dtype, slowdown=self._slowdown, device=self._device
        )
