"""Many heartbeat-only stages in one asyncio process, for a coordinator at scale.

A real stage process costs an interpreter, torch and its sockets; a coordinator
that holds a few hundred of them cannot be tried that way on one machine. A
:class:`FakePeer` speaks the stage's control protocol on a DEALER of its own
(registers, sends a heartbeat every interval with a stage's metrics, answers
probes, registers again when asked) and nothing more: it never takes work, so
it is for membership, liveness and planning at scale, not for runs.
:class:`FakePeers` runs many of them on one zmq context, their heartbeats
spread over the interval as independent processes' would be, and records what
they saw: the round trip of every heartbeat (the coordinator's reply latency,
its event loop's lag included), probes, and requests to register again (the
sign that the coordinator had declared a live peer dead).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from zpipe._errors import ProtocolError, TransportTimeout, ZpipeError
from zpipe.coordinator.loop_lag import LagSummary, LoopLag
from zpipe.protocol import WireMessage
from zpipe.protocol.stage_control import (
    Heartbeat,
    HeartbeatAck,
    Probe,
    ProbeAck,
    Refused,
    Register,
    RegisterAgain,
    Registered,
    Shutdown,
)
from zpipe.stage.metrics import StageCounters
from zpipe.transport.codec import decode_typed
from zpipe.transport.sockets import (
    SocketOptions,
    new_context,
    open_socket,
    recv_frames,
    send,
)


class FakePeerError(ZpipeError):
    """A fake peer could not register (refused, or no answer in time)."""


@dataclass
class PeerStats:
    """What one fake peer saw."""

    heartbeats: int = 0
    acks: int = 0
    probes: int = 0
    register_again: int = 0
    refused: str = ""
    dropped: int = 0
    # round trips of the recent heartbeats (sent to acknowledged), seconds
    round_trips: deque[float] = field(default_factory=lambda: deque(maxlen=4096))


class FakePeer:
    """One heartbeat-only stage on its own DEALER connection."""

    def __init__(
        self,
        name: str,
        socket: zmq.asyncio.Socket,
        *,
        options: SocketOptions,
        info: dict[str, Any],
        reply_s: float,
    ) -> None:
        self.name = name
        self.stats = PeerStats()
        self.heartbeat_interval_s = 0.0
        self._socket = socket
        self._options = options
        self._reply_s = reply_s
        self._registration = Register(
            name=name,
            data_endpoint="tcp://127.0.0.1:9",  # never connected to: it takes no work
            info=info,
            public_key=None,
        )
        self._sent_at: deque[float] = deque(maxlen=64)  # heartbeats not yet acknowledged
        self._metrics = StageCounters().to_dict()

    async def register(self, timeout_s: float) -> None:
        """Register until the coordinator answers ``registered`` (or refuses)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                # a coordinator still starting (its imports take seconds under load)
                # reads nothing yet, and the registrations sent again every second fill
                # the send queue: wait for room until the deadline, as a stage does
                await self._send(
                    self._registration, timeout_s=max(0.01, deadline - time.monotonic())
                )
            except TransportTimeout:
                continue
            try:
                frames = await recv_frames(
                    self._socket,
                    timeout_s=min(1.0, max(0.01, deadline - time.monotonic())),
                    peer="coordinator",
                    awaited="registration reply",
                )
            except TransportTimeout:
                continue
            reply = decode_typed(frames, max_message_bytes=self._options.max_message_bytes)
            if isinstance(reply, Refused):
                self.stats.refused = reply.reason
                raise FakePeerError(f"{self.name} was refused: {self.stats.refused}")
            if isinstance(reply, Registered):
                self.heartbeat_interval_s = float(reply.heartbeat_interval)
                return
        raise FakePeerError(f"{self.name}: no registration reply within {timeout_s:g} s")

    async def _send(self, message: WireMessage, timeout_s: float | None = None) -> None:
        await send(
            self._socket,
            message.to_message(),
            timeout_s=timeout_s or self._reply_s,
            peer="coordinator",
        )

    async def heartbeat_loop(self, phase_s: float) -> None:
        await asyncio.sleep(phase_s)
        next_at = time.monotonic()
        while True:
            self._sent_at.append(time.monotonic())
            self.stats.heartbeats += 1
            # never blocked for longer than an interval, as a stage's heartbeat
            with contextlib.suppress(TransportTimeout):
                await self._send(
                    Heartbeat(name=self.name, metrics=self._metrics),
                    timeout_s=self.heartbeat_interval_s,
                )
            # on a fixed schedule, as a stage's own loop would be, late turns not piling up
            next_at = max(next_at + self.heartbeat_interval_s, time.monotonic())
            await asyncio.sleep(next_at - time.monotonic())

    async def receive_loop(self) -> None:
        while True:
            frames = await recv_frames(
                self._socket, timeout_s=None, peer="coordinator", awaited="control message"
            )
            try:
                message = decode_typed(frames, max_message_bytes=self._options.max_message_bytes)
            except ProtocolError:
                self.stats.dropped += 1
                continue
            await self._on_message(message)

    async def _on_message(self, message: WireMessage) -> None:
        match message:
            case HeartbeatAck():
                if self._sent_at:
                    self.stats.round_trips.append(time.monotonic() - self._sent_at.popleft())
                self.stats.acks += 1
            case Probe():
                self.stats.probes += 1
                await self._send(ProbeAck(nonce=message.nonce))
            case RegisterAgain():
                self.stats.register_again += 1
                self._sent_at.clear()
                await self._send(self._registration)
            case Refused():
                self.stats.refused = message.reason
            case Registered() | Shutdown():
                pass
            case _:
                self.stats.dropped += 1  # work requests: a fake peer takes none

    def close(self) -> None:
        self._socket.close(linger=0)


@dataclass(frozen=True)
class FakePeersSummary:
    peers: int
    heartbeats: int
    acks: int
    probes: int
    register_again: int
    round_trip_p50_s: float
    round_trip_p99_s: float
    round_trip_max_s: float
    # how late this process's own loop woke (its lag delays heartbeats: a false
    # suspicion while it is large is this process's, not the coordinator's)
    own_lag: LagSummary | None

    def to_dict(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data["own_lag"] = None if self.own_lag is None else self.own_lag.to_fields()
        return data


class FakePeers:
    """``async with FakePeers(endpoint, 300) as peers: await asyncio.sleep(10)``."""

    def __init__(
        self,
        coordinator: str,
        count: int,
        *,
        prefix: str = "fake",
        register_timeout_s: float = 60.0,
        reply_s: float = 10.0,
        seed: int = 0,
        info: dict[str, Any] | None = None,
        options: SocketOptions | None = None,
    ) -> None:
        if count < 1:
            raise FakePeerError(f"count must be >= 1, got {count}")
        self.coordinator = coordinator
        self.count = count
        self.prefix = prefix
        self.register_timeout_s = register_timeout_s
        self.reply_s = reply_s
        self._random = random.Random(seed)
        self._info = info or {
            "pid": 0,
            "cores": 1,
            "threads": 1,
            "slowdown": 1.0,
            "memory_mb": None,
            "link": {"bandwidth_mbps": None, "latency_ms": 0.0, "loss": 0.0},
            "probe_endpoint": "",
            "torch": "fake",
        }
        self._options = options or SocketOptions()
        self._context: zmq.asyncio.Context | None = None
        self.peers: list[FakePeer] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.own_lag = LoopLag(window=100_000)

    async def __aenter__(self) -> FakePeers:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Open every peer's connection and register them all (a few at a time, as
        processes starting together would), then start their heartbeats."""
        self._context = new_context()
        for index in range(self.count):
            name = f"{self.prefix}{index}"
            sock = open_socket(self._context, zmq.DEALER, self._options)
            sock.setsockopt(zmq.ROUTING_ID, f"{name}#{uuid.uuid4().hex[:12]}".encode())
            sock.connect(self.coordinator)
            self.peers.append(
                FakePeer(
                    name, sock, options=self._options, info=dict(self._info), reply_s=self.reply_s
                )
            )
        batch = 32
        for first in range(0, self.count, batch):
            await asyncio.gather(
                *(p.register(self.register_timeout_s) for p in self.peers[first : first + batch])
            )
        self._tasks.append(asyncio.create_task(self._watch_own_lag()))
        for peer in self.peers:
            phase = self._random.uniform(0.0, peer.heartbeat_interval_s)
            self._tasks.append(asyncio.create_task(peer.receive_loop()))
            self._tasks.append(asyncio.create_task(peer.heartbeat_loop(phase)))

    async def _watch_own_lag(self, every_s: float = 0.05) -> None:
        while True:
            asked_at = time.monotonic() + every_s
            await asyncio.sleep(every_s)
            self.own_lag.woke(asked_at, time.monotonic())

    def reset_stats(self) -> None:
        self.own_lag = LoopLag(window=100_000)
        for peer in self.peers:
            peer.stats = PeerStats()

    def summary(self) -> FakePeersSummary:
        trips = sorted(t for p in self.peers for t in p.stats.round_trips)

        def quantile(q: float) -> float:
            if not trips:
                return 0.0
            return trips[min(len(trips) - 1, int(q * len(trips)))]

        return FakePeersSummary(
            peers=len(self.peers),
            heartbeats=sum(p.stats.heartbeats for p in self.peers),
            acks=sum(p.stats.acks for p in self.peers),
            probes=sum(p.stats.probes for p in self.peers),
            register_again=sum(p.stats.register_again for p in self.peers),
            round_trip_p50_s=statistics.median(trips) if trips else 0.0,
            round_trip_p99_s=quantile(0.99),
            round_trip_max_s=trips[-1] if trips else 0.0,
            own_lag=self.own_lag.summary(),
        )

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        for peer in self.peers:
            peer.close()
        if self._context is not None:
            self._context.term()
            self._context = None
