"""ZeroMQ sockets with bounded queues and a deadline on every await.

Every socket zpipe opens goes through :func:`open_socket`, which sets a bounded
high-water mark, LINGER (so ``close`` never hangs on a dead peer), a maximum
message size (so an oversized message drops the connection inside libzmq
before it reaches Python), TCP keepalive and, for ROUTER sockets,
``ROUTER_MANDATORY`` (so a message to an unknown peer is an error, not a silent
drop).

ZMTP heartbeats (``HEARTBEAT_IVL``) only on DEALER sockets: libzmq 4.3.5 aborts
the whole process (``Assertion failed: !_io_error
(src/stream_engine_base.cpp:310)``, upstream issue 4841) when a socket with
heartbeats has its input stopped at the receive high-water mark and the peer
disconnects. Any bound PULL or ROUTER can be filled by whoever reaches its
port (a data port before its assignment, a probe or coordinator port while its
loop is busy), so they never get heartbeats; zpipe's own heartbeats find a
frozen stage and TCP keepalive a vanished host. That is not enough on its own: the
PINGs a *peer's* heartbeats send trigger the same abort (the stopped input holds one
undecoded, and answering it writes to the dead connection), so the coordinator's
ROUTER has no receive mark at all (``coordinator/control_port.py``), nor has a stage's data
port (``stage/ports.py``: the run's windows hold its senders back, its guard bounds
its memory). DEALERs connect to a peer this process chose (the coordinator, the
fl-server) and are read all the time, and the client's, the fl-client's and the
stage's control channels rely on the heartbeats to drop the connection to a frozen
server. They have no receive mark either (:data:`HEARTBEAT_RECV_HWM`): libzmq 4.3.5
also aborts (``Assertion failed: _input_stopped (src/stream_engine_base.cpp:396)``,
upstream issues 3937 and 4767) when a heartbeating socket's input was stopped at its
mark and its heartbeat then timed out; a loop starved for a heartbeat timeout while
its server queued more than a mark's worth of messages was enough.

Bounded memory: libzmq checks ``MAXMSGSIZE`` per frame, before allocating it,
and counts ``RCVHWM`` in whole messages per connection, so one connection
queues at most about ``RCVHWM x MAXMSGSIZE`` bytes of single-frame messages.
:class:`ReceiveLimits` and :func:`apply_receive_limits` set both: small ones
(:meth:`ReceiveLimits.before_plan`) on a data socket until its assignment, and
the plan's (:meth:`ReceiveLimits.for_largest_message`) once it is known. Both
options are copied when the socket binds (into the listener, whose accepted
connections inherit them), so a bound socket takes new limits only by being
closed and replaced by a fresh one bound to the same port
(:mod:`zpipe.transport.reopen`, which says why not by re-binding it: that
segfaulted libzmq 4.3.5's I/O thread while a connected peer sent); a stage's
data port and the client's sink do so before the plan's peers are told to
connect, and only when the limits change. What no libzmq option bounds: the
frame count of one multipart message (each frame under ``MAXMSGSIZE``) and the
number of connections. :func:`recv_frames` bounds what Python keeps of one
message: it takes the frames one by one and keeps none past the socket's
:class:`~zpipe.transport.message_bounds.MessageBounds` (the codec's frame count;
the bytes one connection may queue, :meth:`ReceiveLimits.message_bounds`), then
discards the rest. libzmq itself still holds every frame of a message until its
last one arrives (:mod:`zpipe.transport.message_bounds` says how much); only
CURVE allow-lists (``--keys``), which refuse unknown peers at the handshake, and
the data ports' address checks bound who can send that.

:func:`send` and :func:`recv_frames` wrap the asyncio sends and receives with a
timeout whose error names the peer and what was awaited. Untracked sends copy
tensor buffers under :data:`COPY_BELOW_BYTES` and send a received frame on by
reference; ``recv_frames`` on a receive-only :class:`ZpipeSocket`, and ``send`` on
a full send-only one, wait on the socket's descriptor itself (the wire-format page,
docs/reference/wire-format.md: "Copied sends and forwarded frames").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import zmq
import zmq.asyncio

from zpipe._errors import ConfigError, TransportTimeout
from zpipe.transport.codec import (
    DEFAULT_MAX_MESSAGE_BYTES,
    MAX_HEADER_BYTES,
    Message,
    decode,
    encode,
)
from zpipe.transport.endpoints import (  # noqa: F401  (re-exported: callers import them here)
    advertised_endpoint,
    check_resolvable,
    this_host_addresses,
    validate_endpoint,
)
from zpipe.transport.fd_wait import (
    RECEIVE_ONLY_KINDS,
    SEND_ONLY_KINDS,
    DescriptorReader,
    ZpipeSocket,
    recv_when_readable,
    send_when_writable,
    send_whole_nowait,
    take_queued,
)
from zpipe.transport.message_bounds import MessageBounds, OverBounds, take_rest
from zpipe.transport.over_bounds import discard_over_bounds, message_bounds_of


@dataclass(frozen=True)
class SocketOptions:
    """Queue bounds shared by every socket; small on purpose (backpressure)."""

    send_hwm: int = 16
    recv_hwm: int = 16
    linger_ms: int = 0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # ZMTP heartbeats let libzmq notice a frozen peer (SIGSTOP) on its own; set only
    # on ZMTP_HEARTBEAT_KINDS (see the module notes); 0 turns them off everywhere.
    zmtp_heartbeat_ms: int = 1000
    zmtp_heartbeat_timeout_ms: int = 5000
    # TCP keepalive on every socket: finds a vanished host (power, network) on an
    # idle connection, without the libzmq abort heartbeats can cause.
    tcp_keepalive_idle_s: int = 30
    tcp_keepalive_interval_s: int = 10
    tcp_keepalive_count: int = 3


# Sockets that connect to a chosen peer and are read continuously (see the module notes).
ZMTP_HEARTBEAT_KINDS = frozenset({zmq.DEALER})
# The receive mark of a socket with ZMTP heartbeats: none (0), so its input is never
# stopped and libzmq's _input_stopped abort cannot happen (see the module notes). Such
# a socket's one peer is a server the process chose; what queues is what it sent.
# None: the options' mark (the old behaviour, for tests that show the abort).
HEARTBEAT_RECV_HWM: int | None = 0

# Before a plan names a data socket's peers and message sizes: nothing but small
# messages may queue there (a data message before assignment is dropped anyway).
PRE_PLAN_MAX_MESSAGE_BYTES = 64 << 10
PRE_PLAN_RECV_HWM = 4
# What one connection of a data socket may queue once a plan is known.
DEFAULT_QUEUED_BYTES_PER_PEER = 256 << 20
# Room for the msgpack header frame: the codec refuses larger ones anyway.
HEADER_FRAME_ALLOWANCE = MAX_HEADER_BYTES
# CurveZMQ carries each frame in a MESSAGE command ("\x07MESSAGE", an 8-byte nonce,
# a 16-byte MAC and a flags byte: 33 bytes more than the frame), and libzmq checks
# MAXMSGSIZE against that wire size: a limit of exactly the largest frame silently
# dropped that frame on CURVE links (the receiver closes the connection; the run
# waited out its deadline). Limits allow for it on every link.
CURVE_FRAME_OVERHEAD = 33


@dataclass(frozen=True)
class ReceiveLimits:
    """``MAXMSGSIZE`` (per frame) and ``RCVHWM`` (messages per connection) of a socket."""

    max_message_bytes: int
    recv_hwm: int

    def __post_init__(self) -> None:
        if self.max_message_bytes < 1 or self.recv_hwm < 1:
            raise ConfigError(
                f"receive limits must be positive, got max_message_bytes="
                f"{self.max_message_bytes}, recv_hwm={self.recv_hwm}"
            )

    @property
    def queued_bytes_per_peer(self) -> int:
        """The most bytes of single-frame messages one connection can queue."""
        return self.max_message_bytes * self.recv_hwm

    def message_bounds(self, kind: int) -> MessageBounds:
        """What one received message may hold on a socket of ``kind``: a codec
        message's frames, and no more bytes than one connection may queue (never
        less than one frame's limit, never more than the codec's whole-message limit)."""
        nbytes = max(self.queued_bytes_per_peer, self.max_message_bytes)
        return MessageBounds.for_socket(kind, min(nbytes, DEFAULT_MAX_MESSAGE_BYTES))

    @classmethod
    def before_plan(cls) -> ReceiveLimits:
        return cls(PRE_PLAN_MAX_MESSAGE_BYTES, PRE_PLAN_RECV_HWM)

    @classmethod
    def for_largest_message(
        cls,
        largest_frame_bytes: int,
        *,
        queued_bytes_per_peer: int = DEFAULT_QUEUED_BYTES_PER_PEER,
        max_hwm: int = 16,
        min_hwm: int = 2,
    ) -> ReceiveLimits:
        """Limits for a plan whose largest tensor frame is ``largest_frame_bytes``.

        Take the largest activation or gradient *any* cut of the model can produce
        at the run's largest micro-batch (a re-plan moves the cut, and an existing
        connection keeps the limit it was made with). The queue holds as many such
        messages as fit in ``queued_bytes_per_peer``, between ``min_hwm`` (so that
        a pipeline still overlaps transfer and compute) and ``max_hwm``.
        """
        if largest_frame_bytes < 0:
            raise ConfigError(f"a message size cannot be negative, got {largest_frame_bytes}")
        if not 1 <= min_hwm <= max_hwm:
            raise ConfigError(f"need 1 <= min_hwm <= max_hwm, got {min_hwm}, {max_hwm}")
        max_bytes = max(largest_frame_bytes + CURVE_FRAME_OVERHEAD, HEADER_FRAME_ALLOWANCE)
        hwm = min(max(queued_bytes_per_peer // max_bytes, min_hwm), max_hwm)
        return cls(max_bytes, hwm)


def apply_receive_limits(sock: zmq.Socket[Any], limits: ReceiveLimits) -> None:
    """Set ``MAXMSGSIZE`` and ``RCVHWM`` for endpoints bound or connected *after* this call.

    libzmq copies the options into a listener when the socket binds, and every
    connection that listener accepts gets the listener's copy: a bound socket is
    reopened to change them (:mod:`zpipe.transport.reopen`).
    """
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes)
    sock.setsockopt(zmq.RCVHWM, limits.recv_hwm)
    if isinstance(sock, ZpipeSocket):
        # unlike the two options, these apply at once, to every connection
        sock.message_bounds = limits.message_bounds(int(sock.type))


def new_context() -> zmq.asyncio.Context:
    """One context per process with one I/O thread: the other cores belong to compute."""
    return zmq.asyncio.Context(io_threads=1)


def open_socket(
    context: zmq.asyncio.Context,
    kind: int,
    options: SocketOptions | None = None,
    *,
    limits: ReceiveLimits | None = None,
    zmtp_heartbeat: bool | None = None,
) -> zmq.asyncio.Socket:
    """A socket with zpipe's options; ``limits`` override the options' receive limits
    (e.g. ``ReceiveLimits.before_plan()`` for a data socket); ``zmtp_heartbeat``
    overrides the default by kind (ZMTP_HEARTBEAT_KINDS; never on a socket whose
    input can sit unread, see the module notes)."""
    opts = options or SocketOptions()
    sock = context.socket(kind, socket_class=ZpipeSocket)
    sock.setsockopt(zmq.LINGER, opts.linger_ms)
    sock.setsockopt(zmq.SNDHWM, opts.send_hwm)
    apply_receive_limits(sock, limits or ReceiveLimits(opts.max_message_bytes, opts.recv_hwm))
    heartbeat = kind in ZMTP_HEARTBEAT_KINDS if zmtp_heartbeat is None else zmtp_heartbeat
    if heartbeat and opts.zmtp_heartbeat_ms > 0:
        sock.setsockopt(zmq.HEARTBEAT_IVL, opts.zmtp_heartbeat_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, opts.zmtp_heartbeat_timeout_ms)
        if HEARTBEAT_RECV_HWM is not None:
            sock.setsockopt(zmq.RCVHWM, HEARTBEAT_RECV_HWM)  # before it connects
    if opts.tcp_keepalive_idle_s > 0:
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, opts.tcp_keepalive_idle_s)
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, opts.tcp_keepalive_interval_s)
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, opts.tcp_keepalive_count)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    return sock


# How often a send to one full peer queue of a ROUTER looks again for room.
_ROOM_POLL_S = 0.005

# An untracked send copies tensor buffers smaller than this into libzmq's own
# message (one memcpy) instead of sharing them. A shared Python buffer costs a
# wake-up of pyzmq's garbage-collector thread, which takes the GIL, when libzmq
# releases it; a message libzmq owns it frees itself. Measured on a loaded 2-core
# machine (bench/transport.py --paths raw,zpipe,zpipe_shared, bench/send_copy.py;
# docs/reference/wire-format.md, "Copied sends and forwarded frames"): up to 1 MiB
# copying saved about one context switch per message and CPU per round trip, at even CPU per message
# in a stream; from 2 MiB it cost CPU and messages/s. On the same machine idle
# (load 1-2) copying gave 1.10-1.13x the messages/s up to 256 KiB, 0.95x at 512
# KiB (round trip 0.89x) and 0.82x at 1 MiB, where the memcpy is the limit: the
# threshold sits between the two. pyzmq copies under 64 KiB anyway.
COPY_BELOW_BYTES = 1 << 19  # 512 KiB


async def send(
    sock: zmq.asyncio.Socket,
    message: Message,
    *,
    timeout_s: float,
    peer: str,
    routing_id: bytes | None = None,
    on_queued: Callable[[zmq.MessageTracker, int], None] | None = None,
    copy_below: int = COPY_BELOW_BYTES,
) -> int:
    """Send ``message`` (zero-copy for large tensors); returns the bytes sent.

    Raises :class:`TransportTimeout` if the peer's queue stays full past the
    deadline, which is what a dead or stalled peer looks like to a sender.
    With ``on_queued``, the message is sent with a tracker, which is handed over
    with its size once queued (it completes when libzmq has written the message
    out; see :class:`zpipe.stage.metrics.LinkMeter`). Without, tensor buffers
    under ``copy_below`` bytes are copied (see :data:`COPY_BELOW_BYTES`).
    """
    track = on_queued is not None
    frames, copy, nbytes = _outgoing(encode(message), track=track, copy_below=copy_below)
    if routing_id is not None:
        frames = [routing_id, *frames]
        nbytes += len(routing_id)
    if _queue_now(sock, frames, on_queued, copy=copy, nbytes=nbytes):
        return nbytes
    if routing_id is None and _waits_on_descriptor(sock, _SEND_ONLY):
        tracker = await send_when_writable(
            cast(ZpipeSocket, sock),
            cast("zmq.Socket[Any]", _shadow(sock, _SEND_ONLY)),
            frames,
            copy=copy,
            track=track,
            timeout_s=timeout_s,
            peer=peer,
            awaited=f"room to send {message.kind}",
        )
        if on_queued is not None and tracker is not None:
            on_queued(tracker, nbytes)
        return nbytes
    deadline = time.monotonic() + timeout_s
    while True:
        # zmq.asyncio returns a Future (typed as a plain Awaitable by pyzmq's stubs)
        pending = cast("asyncio.Future[Any]", sock.send_multipart(frames, copy=copy, track=track))
        try:
            if not pending.done():
                await asyncio.wait_for(pending, max(deadline - time.monotonic(), 0.0))
            tracker = pending.result()
            break
        except asyncio.TimeoutError:
            raise TransportTimeout(peer, f"room to send {message.kind}", timeout_s) from None
        except zmq.Again:
            # A ROUTER with ROUTER_MANDATORY says EAGAIN (nothing queued) when this one
            # peer's queue is full, while others have room, so the socket still polls
            # writable: look again for room until the deadline, as for any send. (A
            # stream of state chunks to a reader slower than this side hit it.)
            if routing_id is None or time.monotonic() >= deadline:
                raise TransportTimeout(peer, f"room to send {message.kind}", timeout_s) from None
            await asyncio.sleep(_ROOM_POLL_S)
    if on_queued is not None:
        on_queued(tracker, nbytes)
    return nbytes


def send_nowait(
    sock: zmq.asyncio.Socket,
    message: Message,
    *,
    on_queued: Callable[[zmq.MessageTracker, int], None] | None = None,
    copy_below: int = COPY_BELOW_BYTES,
) -> int | None:
    """Queue ``message`` on a send-only socket (PUSH, PUB) without waiting: the bytes
    queued, or None when nothing was sent (no room, or a socket that also receives).

    For a caller that has something better to do than wait (hand the message to
    its send task instead); :func:`send` is the one with a deadline.
    """
    track = on_queued is not None
    frames, copy, nbytes = _outgoing(encode(message), track=track, copy_below=copy_below)
    return nbytes if _queue_now(sock, frames, on_queued, copy=copy, nbytes=nbytes) else None


def _outgoing(frames: list[Any], *, track: bool, copy_below: int) -> tuple[list[Any], bool, int]:
    """The frames to send, the ``copy`` flag to send them with and their bytes.

    Untracked: ``copy=True``, which copies bytes and buffers (no garbage-collector
    wake-up) and sends a ``zmq.Frame`` by reference (a received frame sent on, see
    :func:`zpipe.transport.codec.encode`); buffers of ``copy_below`` bytes or more
    (and of 64 KiB or more: 0 is pyzmq's own choice) are wrapped in zero-copy
    frames first. Tracked: as before, ``copy=False`` with every part a buffer: a
    copied part's tracker is done at once, which would hide the link time the
    meter measures, and pyzmq refuses to track a received frame.
    """
    share_from = max(copy_below, zmq.COPY_THRESHOLD)
    out = []
    total = 0
    for frame in frames:  # one pass, no per-frame calls: this runs for every message
        nbytes = frame.nbytes if isinstance(frame, memoryview) else len(frame)
        if isinstance(frame, zmq.Frame):
            if track:
                frame = frame.buffer
        elif nbytes >= share_from and not track:
            frame = zmq.Frame(frame, copy=False)
        total += nbytes
        out.append(frame)
    return out, not track, total


def _queue_now(
    sock: zmq.asyncio.Socket,
    frames: list[Any],
    on_queued: Callable[[zmq.MessageTracker, int], None] | None,
    *,
    copy: bool,
    nbytes: int,
) -> bool:
    """Queue ``frames`` (``nbytes`` bytes) through the synchronous shadow of a
    send-only socket when there is room (the common case): an asyncio future, a
    wait_for timer and an extra loop pass cost more than the send itself. A
    multipart message is queued whole or not at all: False when nothing was sent."""
    shadow = sock.send_only_shadow if type(sock) is ZpipeSocket else _shadow(sock, _SEND_ONLY)
    if shadow is None:
        return False
    try:
        tracker = send_whole_nowait(shadow, frames, copy=copy, track=on_queued is not None)
    except zmq.Again:
        return False
    if on_queued is not None and tracker is not None:
        on_queued(tracker, nbytes)
    return True


async def recv_frames(
    sock: zmq.asyncio.Socket, *, timeout_s: float | None, peer: str, awaited: str
) -> list[zmq.Frame]:
    """Receive one multipart message without copying; ``None`` waits forever.

    Only receive loops that are themselves cancelled on shutdown pass ``None``;
    a wait for a specific reply always has a deadline.

    The message is taken frame by frame within the socket's bounds
    (:func:`~zpipe.transport.over_bounds.message_bounds_of`): one past them is read
    to its end and discarded, counted (``refused_messages``), logged as
    ``dropped_message`` (rate-limited per peer) with its
    :class:`~zpipe._errors.MessageLimitError`, and the wait goes on for the next
    message under the same deadline, so every receive loop keeps serving.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    # looked up once per call, not per pass: a receive is a few hundred bytecodes,
    # and these lookups were a tenth of them (bench/_transport_counts.py --opcodes)
    zpipe_sock: ZpipeSocket | None
    if type(sock) is ZpipeSocket:  # attributes, not calls: this runs per message
        zpipe_sock = sock
        shadow = sock.receive_only_shadow
        reader: DescriptorReader | None = sock._zpipe_reader or sock.descriptor_reader
        bounds = sock.message_bounds or message_bounds_of(sock)
    else:
        zpipe_sock = sock if isinstance(sock, ZpipeSocket) else None
        shadow = _shadow(sock, _RECEIVE_ONLY)
        reader = None if zpipe_sock is None else zpipe_sock.descriptor_reader
        bounds = message_bounds_of(sock)
    while True:
        got = None  # a message already queued is taken without a future or a coroutine
        if shadow is not None:
            if reader is None:
                got = take_queued(shadow, bounds)
            elif (got := take_queued(shadow, bounds, look_first=reader.waited_last)) is not None:
                reader.waited_last = False
            elif zpipe_sock is not None and zpipe_sock._current_loop is None:
                # straight to the descriptor wait (zmq.asyncio has not taken the
                # socket over): one coroutine less per waited receive than through
                # _recv_bounded, nothing touching the socket since take_queued
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                got = await recv_when_readable(zpipe_sock, shadow, left, peer, awaited, bounds)
        if got is None:
            got = await _recv_bounded(sock, shadow, bounds, deadline, timeout_s, peer, awaited)
        # a listener's connection guard counts what each connection's messages took
        guard = getattr(sock, "_zpipe_connection_guard", None)
        if not isinstance(got, OverBounds):
            if guard is not None:
                guard.saw(got)
            return got
        await discard_over_bounds(sock, got, peer, watched=shadow is None)
        if guard is not None:
            guard.saw(got)
        bounds = message_bounds_of(sock)  # new receive limits may have come meanwhile


async def _recv_bounded(
    sock: zmq.asyncio.Socket,
    shadow: zmq.Socket[Any] | None,
    bounds: MessageBounds,
    deadline: float | None,
    timeout_s: float | None,
    peer: str,
    awaited: str,
) -> list[zmq.Frame] | OverBounds:
    if shadow is not None and getattr(sock, "_current_loop", None) is None:
        if isinstance(sock, ZpipeSocket):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return await recv_when_readable(sock, shadow, left, peer, awaited, bounds)
    while True:
        # The first frame through zmq.asyncio (its future, its re-check of events);
        # the rest are queued with it (a message is delivered whole): taken below.
        pending = cast("asyncio.Future[zmq.Frame]", sock.recv(copy=False))
        try:
            if pending.done() or deadline is None:
                first = await pending  # a message was already queued: no timer needed
            else:
                first = await asyncio.wait_for(pending, max(0.0, deadline - time.monotonic()))
        except zmq.Again:
            # pyzmq fails a pending receive with EAGAIN when the socket signalled input
            # gone when it read (seen once on a CURVE sink): wait again, same deadline.
            await asyncio.sleep(0)
            continue
        except asyncio.TimeoutError:
            raise TransportTimeout(peer, awaited, timeout_s or 0.0) from None
        if not first.more:
            return [first]
        # The rest through the synchronous socket, as zmq.asyncio's own non-blocking
        # receive does, then one look at the events through zmq.asyncio: those reads
        # may have taken the edge of the descriptor that a pending send on this
        # socket (a ROUTER's, a DEALER's) waits for, and this look schedules it.
        got = take_rest(cast("zmq.Socket[Any]", sock._shadow_sock), first, bounds)
        sock.get(zmq.EVENTS)
        return got


# The fast paths are only for sockets that move messages one way (the notes at
# zpipe.transport.fd_wait.SEND_ONLY_KINDS say why).
_SEND_ONLY = SEND_ONLY_KINDS
_RECEIVE_ONLY = RECEIVE_ONLY_KINDS


def _shadow(sock: zmq.asyncio.Socket, kinds: frozenset[int]) -> zmq.Socket[Any] | None:
    """The synchronous socket behind a zmq.asyncio socket of one of ``kinds``, for
    non-blocking fast paths; None for any other socket."""
    if type(sock) is ZpipeSocket:  # found when it opened: no lookups per message
        if kinds is _SEND_ONLY:
            return sock.send_only_shadow
        if kinds is _RECEIVE_ONLY:
            return sock.receive_only_shadow
    shadow = getattr(sock, "_shadow_sock", None)
    if not isinstance(shadow, zmq.Socket) or shadow.type not in kinds:
        return None
    return shadow


def _waits_on_descriptor(sock: zmq.asyncio.Socket, kinds: frozenset[int]) -> bool:
    """Whether a wait on ``sock`` (one of ``kinds``) can use :mod:`zpipe.transport.fd_wait`:
    a :class:`ZpipeSocket` that zmq.asyncio has not taken over (it would then watch
    the descriptor itself)."""
    return (
        isinstance(sock, ZpipeSocket)
        and getattr(sock, "_current_loop", None) is None
        and _shadow(sock, kinds) is not None
    )


def decode_frames(frames: Sequence[zmq.Frame], max_message_bytes: int) -> Message:
    return decode(frames, max_message_bytes=max_message_bytes)


def frames_nbytes(frames: Sequence[zmq.Frame]) -> int:
    return sum(map(len, frames))  # no generator: this runs for every message received


def bind_endpoint(sock: zmq.asyncio.Socket, endpoint: str) -> str:
    """Bind and return the endpoint actually bound (resolves port 0 and ``*``)."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EADDRINUSE:
            raise ConfigError(
                f"cannot bind {endpoint}: Address already in use (another process listens "
                "there): stop it, or choose another port (port 0 takes any free one)"
            ) from None
        raise ConfigError(f"cannot bind {endpoint}: {exc}") from None
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
