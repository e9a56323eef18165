"""Measuring the links between stages: round-trip time and bandwidth.

Every stage answers probes on a socket of its own (:class:`ProbeResponder`);
the coordinator asks one stage at a time to measure its link to another
(:func:`measure_link`), so that probes never share a link or a core with each
other, and plans from the numbers.

- Round-trip time: the median of a few ping/pong exchanges of tiny messages.
- Bandwidth: bursts of payload messages, timed where they arrive. The
  receiver reports how many bytes arrived after the first message and how long
  after it the last one came, which is the link's rate without the sender's
  start-up and without the latency of the first message. Bursts grow until one
  lasts ``target_s`` at the receiver (or ``max_bytes`` is reached), so slow and
  fast links are both measured in about the same time.

An emulated link is measured through the same emulation the data path uses:
the prober's payload pays its outgoing bandwidth and latency, the responder's
pong pays its own latency, so a measurement checks the emulation end to end.
Emulated loss is left out of probes: a lost burst end would only cost a
timeout, and reception ratios are measured with many small messages instead.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import structlog
import torch
import zmq
import zmq.asyncio

from zpipe._errors import ProtocolError, TransportTimeout
from zpipe.protocol import WireMessage
from zpipe.protocol.peer import (
    Backup,
    FetchUnits,
    LinkBurst,
    LinkBurstEnd,
    LinkBurstReport,
    LinkPing,
    LinkPong,
    StateChunk,
)
from zpipe.stage.supervision import YIELD_EVERY
from zpipe.transport import security
from zpipe.transport.codec import Message, decode_typed
from zpipe.transport.conn_guard import GUARD_ATTRIBUTE, ConnectionGuard
from zpipe.transport.emulation import EmulatedLink, LinkSpec
from zpipe.transport.message_bounds import trim_heap
from zpipe.transport.ratelimit import PeerRateLimiter
from zpipe.transport.sockets import (
    SocketOptions,
    open_socket,
    recv_frames,
    send,
)

log = structlog.get_logger("zpipe.linkprobe")

# The probe socket's ZAP domain: it admits every cluster member, while the data
# socket of the same context admits only the assigned upstream.
PROBE_DOMAIN = "zpipe-probe"

# Bursts a responder remembers at once: probes run one at a time, so a few
# cover a prober that gave up on one burst and started the next.
_MAX_OPEN_BURSTS = 4

# The backlog of cut connections (wire bytes queued unread, as the port's guard
# estimates it: ConnectionGuard.cut_backlog_bytes) past which the responder reopens
# its socket to drop it unread. A probe flood's messages of tens of bytes cost libzmq
# about two and a half times their wire bytes: 4 MiB is some 10 MiB held.
PROBE_BACKLOG_FLUSH_BYTES = 4 << 20
# after a reopen, the heap is trimmed at these delays (libzmq's reaper frees the old
# socket's queue meanwhile; glibc keeps what was freed otherwise)
TRIM_AFTER_REOPEN_S = (0.3, 1.5)


@dataclass(frozen=True)
class LinkMeasurement:
    rtt_s: float
    bandwidth_bps: float
    bytes_sent: int
    took_s: float

    @property
    def bandwidth_mbps(self) -> float:
        return self.bandwidth_bps / 1e6


@dataclass
class _Burst:
    first_at: float
    last_at: float
    received: int = 1
    bytes_after_first: int = 0


_W = TypeVar("_W", bound=WireMessage)

# Requests from peers that the stage itself answers (zpipe.stage.held_copies).
PEER_REQUESTS = (Backup, FetchUnits, StateChunk)


@dataclass
class ProbeResponder:
    """Answers pings and times bursts on a ROUTER socket; one per stage."""

    socket: zmq.asyncio.Socket
    link: LinkSpec
    name: str
    send_timeout_s: float
    max_message_bytes: int
    # other stage-to-stage requests (backups, unit fetches): (the request, the sender's
    # CURVE key or None without keys) -> one reply, or a stream of them (a big fetch's
    # chunks)
    peer_handler: (
        Callable[[WireMessage, bytes | None], Awaitable[WireMessage | Iterator[WireMessage]]] | None
    ) = None
    # per-peer token buckets: a flooding peer's excess is dropped before decoding
    limiter: PeerRateLimiter = field(default_factory=PeerRateLimiter)
    # closes the socket and binds a fresh one to the same endpoint, returning it
    # (zpipe.stage.ports.StagePorts.reopen_probe_in): how a flood's backlog is dropped
    reopen: Callable[[], Awaitable[zmq.asyncio.Socket]] | None = None
    backlog_flush_bytes: int = PROBE_BACKLOG_FLUSH_BYTES
    reopened: int = 0
    _bursts: dict[tuple[bytes, int], _Burst] = field(default_factory=dict)
    _pending: set[asyncio.Task[None]] = field(default_factory=set)

    async def serve(self) -> None:
        """Serve until cancelled; a bad message is logged and dropped."""
        served = 0
        guard = self._guard()
        while True:
            frames = await recv_frames(
                self.socket, timeout_s=None, peer="any", awaited="a link probe"
            )
            arrived = time.monotonic()
            if guard is not None and self.reopen is not None:
                backlog = guard.cut_backlog_bytes(arrived)
                if backlog > self.backlog_flush_bytes:
                    await self._drop_backlog(backlog, len(guard.cuts))
                    guard = self._guard()
                    continue  # this message was the old socket's
            served += 1
            if served % YIELD_EVERY == 0:
                await asyncio.sleep(0)  # a flood never starves the heartbeats (supervision)
            if len(frames) < 2:
                continue
            routing_id = frames[0].bytes
            if guard is not None and guard.was_cut(routing_id):
                continue  # a flood's backlog, queued before the guard cut it: unread
            if not self._within_rate(routing_id, frames[1], arrived):
                continue
            try:
                message = decode_typed(frames[1:], max_message_bytes=self.max_message_bytes)
                await self._handle(routing_id, message, arrived, frames[1])
            except asyncio.CancelledError:
                raise
            except (ProtocolError, TransportTimeout, zmq.ZMQError) as exc:
                # peer=: the log's flood limit counts lines per peer, and a flooder that
                # reconnects after each cut gets a new routing id (connection=) each time
                log.warning("probe_dropped", stage=self.name, peer=_peer_address(frames[1]),
                            connection=routing_id.hex(), error=str(exc))  # fmt: skip
            except Exception as exc:  # one message never takes the probe port down
                log.error("probe_failed", stage=self.name, peer=routing_id.hex(),
                          error=f"{type(exc).__name__}: {exc}")  # fmt: skip

    def _guard(self) -> ConnectionGuard | None:
        """The socket's connection guard (zpipe.stage.ports.guard_probe_port), if any."""
        guard = getattr(self.socket, GUARD_ATTRIBUTE, None)
        return guard if isinstance(guard, ConnectionGuard) else None

    async def _drop_backlog(self, backlog: int, cuts: int) -> None:
        """Reopen the socket: what cut connections left queued goes unread."""
        assert self.reopen is not None
        started = time.monotonic()
        self.socket = await self.reopen()
        self.reopened += 1
        log.warning("probe_port_reopened", stage=self.name, backlog_bytes=backlog, cuts=cuts,
                    reopened=self.reopened, took_s=round(time.monotonic() - started, 3),
                    detail="connections cut for flooding left more queued than the port "
                    "may hold; the port was closed and bound again, dropping it")  # fmt: skip
        loop = asyncio.get_running_loop()
        for delay in TRIM_AFTER_REOPEN_S:
            loop.call_later(delay, trim_heap)

    def _within_rate(self, routing_id: bytes, first: zmq.Frame, now: float) -> bool:
        """The peer's rate limit, by its CURVE key (new connections do not give a flooder
        new buckets), else by connection; a report of the excess every few seconds."""
        peer = security.sender_public_key(first) or routing_id
        if self.limiter.allow(peer, now):
            return True
        report = self.limiter.report_due(now)
        if report is not None:
            log.warning("probe_flood_dropped", stage=self.name, dropped=report.dropped,
                        over_s=round(report.over_s, 3), worst_peer=report.worst_peer[:8].hex(),
                        worst_dropped=report.worst_dropped,
                        dropped_total=self.limiter.dropped_total)  # fmt: skip
        return False

    async def _handle(
        self,
        routing_id: bytes,
        message: WireMessage,
        arrived: float,
        first: zmq.Frame | None = None,
    ) -> None:
        match message:
            case LinkPing(nonce=nonce):
                reply = LinkPong(nonce=nonce)
                if self.link.latency_ms > 0:
                    # The pong pays this side's emulated latency, without holding up the loop.
                    task = asyncio.create_task(self._reply_later(routing_id, reply))
                    self._pending.add(task)
                    task.add_done_callback(self._pending.discard)
                else:
                    await self._reply(routing_id, reply)
            case LinkBurst(burst=number):
                key = (routing_id, number)
                burst = self._bursts.get(key)
                size = sum(t.numel() * t.element_size() for t in message.tensors)
                if burst is None:
                    if len(self._bursts) >= _MAX_OPEN_BURSTS:
                        self._bursts.pop(next(iter(self._bursts)))
                    self._bursts[key] = _Burst(first_at=arrived, last_at=arrived)
                else:
                    burst.received += 1
                    burst.bytes_after_first += size
                    burst.last_at = arrived
            case LinkBurstEnd(burst=number):
                done = self._bursts.pop((routing_id, number), None)
                report = LinkBurstReport(
                    burst=number,
                    received=done.received if done else 0,
                    bytes_after_first=done.bytes_after_first if done else 0,
                    span_s=(done.last_at - done.first_at) if done else 0.0,
                )
                await self._reply(routing_id, report)
            case Backup() | FetchUnits() | StateChunk() if self.peer_handler is not None:
                sender = security.sender_public_key(first) if first is not None else None
                answer = await self.peer_handler(message, sender)
                # Each reply has its own deadline: a long stream that keeps moving is alive.
                for part in [answer] if isinstance(answer, WireMessage) else answer:
                    await self._reply(routing_id, part)
            case _:
                raise ProtocolError(f"unexpected {message.KIND!r} on the probe socket")

    async def _reply_later(self, routing_id: bytes, reply: WireMessage) -> None:
        await asyncio.sleep(self.link.latency_ms / 1e3)
        try:
            await self._reply(routing_id, reply)
        except (TransportTimeout, zmq.ZMQError) as exc:
            log.warning("probe_reply_failed", stage=self.name, error=str(exc))

    async def _reply(self, routing_id: bytes, reply: WireMessage) -> None:
        # a fetch's stream of chunks to a reader slower than this side waits for room
        # in that one peer's queue within the deadline (zpipe.transport.sockets.send)
        await send(
            self.socket,
            reply.to_message(),
            routing_id=routing_id,
            timeout_s=self.send_timeout_s,
            peer="prober",
        )

    async def close(self) -> None:
        for task in list(self._pending):
            task.cancel()
        self._bursts.clear()


def _peer_address(frame: zmq.Frame) -> str:
    """The sender's address (libzmq's ``Peer-Address`` metadata), or "?"."""
    try:
        return str(frame.get("Peer-Address"))
    except (zmq.ZMQError, TypeError, ValueError):
        return "?"


@dataclass(frozen=True)
class ProbeSettings:
    pings: int = 5
    # A burst is long enough once it lasts this long where it arrives.
    target_s: float = 0.15
    min_chunk_bytes: int = 64 * 1024
    max_chunk_bytes: int = 2**20
    first_burst_bytes: int = 256 * 1024
    max_bytes: int = 32 * 2**20
    max_bursts: int = 5


async def measure_link(
    *,
    context: zmq.asyncio.Context,
    endpoint: str,
    target: str,
    link: LinkSpec,
    socket_options: SocketOptions,
    timeout_s: float,
    keypair: security.KeyPair | None = None,
    server_key: bytes | None = None,
    settings: ProbeSettings | None = None,
) -> LinkMeasurement:
    """Measure the link from this process to ``target``'s probe socket at ``endpoint``.

    Every wait has a deadline of ``timeout_s``; a target that does not answer
    raises :class:`TransportTimeout` naming it.
    """
    cfg = settings or ProbeSettings()
    started = time.monotonic()
    # No ZMTP heartbeats: the peer is another stage, which could fill this socket and
    # hang up (libzmq 4.3.5 then aborts; see zpipe.transport.sockets); the reply's
    # deadline finds a silent peer.
    sock = open_socket(context, zmq.DEALER, socket_options, zmtp_heartbeat=False)
    if keypair is not None:
        if server_key is None:
            raise ProtocolError(f"no public key for {target!r}'s probe socket")
        security.secure_client(sock, keypair, server_key)
    sock.connect(endpoint)
    emulated = EmulatedLink(replace(link, loss=0.0), _sender(sock, target, timeout_s))
    try:
        rtt = await _round_trips(sock, emulated, target, cfg.pings, timeout_s, socket_options)
        bandwidth, sent = await _bandwidth(sock, emulated, target, cfg, timeout_s, socket_options)
    finally:
        await emulated.close()
        sock.close(linger=0)
    return LinkMeasurement(
        rtt_s=rtt, bandwidth_bps=bandwidth, bytes_sent=sent, took_s=time.monotonic() - started
    )


def _sender(sock: zmq.asyncio.Socket, target: str, timeout_s: float) -> Any:
    async def deliver(item: object) -> None:
        assert isinstance(item, Message)
        await send(sock, item, timeout_s=timeout_s, peer=target)

    return deliver


async def _expect(
    sock: zmq.asyncio.Socket,
    cls: type[_W],
    number: Callable[[_W], int],
    value: int,
    *,
    target: str,
    timeout_s: float,
    options: SocketOptions,
) -> _W:
    """The next ``cls`` reply whose ``number`` (its nonce, its burst) is ``value``;
    stale replies are skipped."""
    awaited = f"{cls.KIND} {value}"
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransportTimeout(target, awaited, timeout_s)
        frames = await recv_frames(sock, timeout_s=left, peer=target, awaited=awaited)
        reply = decode_typed(frames, max_message_bytes=options.max_message_bytes)
        if isinstance(reply, cls) and number(reply) == value:
            return reply


async def _round_trips(
    sock: zmq.asyncio.Socket,
    link: EmulatedLink,
    target: str,
    pings: int,
    timeout_s: float,
    options: SocketOptions,
) -> float:
    samples = []
    # The first exchange also pays the TCP and CURVE handshakes: not a link property.
    for nonce in range(pings + 1):
        sent_at = time.monotonic()
        await link.submit(LinkPing(nonce=nonce).to_message(), 64)
        await _expect(
            sock,
            LinkPong,
            lambda pong: pong.nonce,
            nonce,
            target=target,
            timeout_s=timeout_s,
            options=options,
        )
        if nonce > 0:
            samples.append(time.monotonic() - sent_at)
    return statistics.median(samples) if samples else 0.0


async def _bandwidth(
    sock: zmq.asyncio.Socket,
    link: EmulatedLink,
    target: str,
    cfg: ProbeSettings,
    timeout_s: float,
    options: SocketOptions,
) -> tuple[float, int]:
    chunk, burst_bytes = cfg.min_chunk_bytes, cfg.first_burst_bytes
    total_sent, best = 0, 0.0
    for burst in range(cfg.max_bursts):
        count = max(2, -(-burst_bytes // chunk))
        payload = torch.zeros(chunk, dtype=torch.uint8)
        for seq in range(count):
            message = LinkBurst(burst=burst, seq=seq, tensors=(payload,))
            await link.submit(message.to_message(), chunk)
        await link.submit(LinkBurstEnd(burst=burst, sent=count).to_message(), 64)
        total_sent += count * chunk
        report = await _expect(
            sock,
            LinkBurstReport,
            lambda report: report.burst,
            burst,
            target=target,
            timeout_s=timeout_s,
            options=options,
        )
        span = float(report.span_s)
        after_first = report.bytes_after_first
        if span > 0 and after_first > 0:
            best = after_first * 8.0 / span
        if span >= cfg.target_s or burst_bytes >= cfg.max_bytes:
            break
        if best > 0:
            rate = best / 8.0  # bytes per second
            # Messages that each stay on the wire for ~10 ms: a sender's timer
            # overshoot (a fraction of a millisecond) then costs little of the rate.
            chunk = int(min(cfg.max_chunk_bytes, max(cfg.min_chunk_bytes, rate * 0.01)))
            burst_bytes = int(min(cfg.max_bytes, max(2 * chunk, rate * cfg.target_s * 1.3)))
        else:
            burst_bytes = min(cfg.max_bytes, 16 * burst_bytes)
    if best <= 0:
        raise ProtocolError(f"{target} reported no usable burst timing")
    return best, total_sent
