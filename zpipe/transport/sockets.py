"""ZeroMQ sockets with bounded queues and a deadline on every await.

Every socket zpipe opens goes through :func:`open_socket`, which sets a bounded
high-water mark, LINGER (so ``close`` never hangs on a dead peer), a maximum
message size (so an oversized message drops the connection inside libzmq
before it reaches Python) and, for ROUTER sockets, ``ROUTER_MANDATORY`` (so a
message to an unknown peer is an error, not a silent drop).

:func:`send` and :func:`recv` wrap the asyncio sends and receives with a
timeout whose error names the peer and what was awaited.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket as pysocket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from zpipe._errors import ConfigError, TransportTimeout
from zpipe.transport.codec import DEFAULT_MAX_MESSAGE_BYTES, Message, decode, encode


@dataclass(frozen=True)
class SocketOptions:
    """Queue bounds shared by every socket; small on purpose (backpressure)."""

    send_hwm: int = 16
    recv_hwm: int = 16
    linger_ms: int = 0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # ZMTP heartbeats let libzmq notice a frozen peer (SIGSTOP) on its own.
    zmtp_heartbeat_ms: int = 1000
    zmtp_heartbeat_timeout_ms: int = 5000


def new_context() -> zmq.asyncio.Context:
    """One context per process with one I/O thread: the other cores belong to compute."""
    return zmq.asyncio.Context(io_threads=1)


def open_socket(
    context: zmq.asyncio.Context, kind: int, options: SocketOptions | None = None
) -> zmq.asyncio.Socket:
    opts = options or SocketOptions()
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, opts.linger_ms)
    sock.setsockopt(zmq.SNDHWM, opts.send_hwm)
    sock.setsockopt(zmq.RCVHWM, opts.recv_hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, opts.max_message_bytes)
    sock.setsockopt(zmq.HEARTBEAT_IVL, opts.zmtp_heartbeat_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, opts.zmtp_heartbeat_timeout_ms)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    return sock


async def send(
    sock: zmq.asyncio.Socket,
    message: Message,
    *,
    timeout_s: float,
    peer: str,
    routing_id: bytes | None = None,
) -> int:
    """Send ``message`` (zero-copy for tensors); returns the bytes sent.

    Raises :class:`TransportTimeout` if the peer's queue stays full past the
    deadline, which is what a dead or stalled peer looks like to a sender.
    """
    frames: list[Any] = encode(message)
    if routing_id is not None:
        frames = [routing_id, *frames]
    nbytes = sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)
    shadow = _shadow(sock, _SEND_ONLY)
    if shadow is not None:
        # Queue it at once when there is room (the common case): an asyncio
        # future, a wait_for timer and an extra loop pass cost more than the
        # send itself for megabyte messages. A multipart message is queued whole
        # or not at all, so on EAGAIN nothing was sent and the awaited path runs.
        try:
            shadow.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return nbytes
        except zmq.Again:
            pass
    # zmq.asyncio returns a Future (typed as a plain Awaitable by pyzmq's stubs)
    pending = cast("asyncio.Future[Any]", sock.send_multipart(frames, copy=False))
    if pending.done():
        pending.result()
        return nbytes
    try:
        await asyncio.wait_for(pending, timeout_s)
    except asyncio.TimeoutError:
        raise TransportTimeout(peer, f"room to send {message.kind}", timeout_s) from None
    return nbytes


async def recv_frames(
    sock: zmq.asyncio.Socket, *, timeout_s: float | None, peer: str, awaited: str
) -> list[zmq.Frame]:
    """Receive one multipart message without copying; ``None`` waits forever.

    Only receive loops that are themselves cancelled on shutdown pass ``None``;
    a wait for a specific reply always has a deadline.
    """
    shadow = _shadow(sock, _RECEIVE_ONLY)
    if shadow is not None:
        # A message already queued is taken without a future; zmq.asyncio checks
        # the socket's events before every wait, so mixing the two is safe on
        # this (the only) thread that uses the socket.
        try:
            return cast("list[zmq.Frame]", shadow.recv_multipart(flags=zmq.NOBLOCK, copy=False))
        except zmq.Again:
            pass
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        pending = cast("asyncio.Future[list[zmq.Frame]]", sock.recv_multipart(copy=False))
        try:
            if pending.done() or deadline is None:
                return await pending  # a message was already queued: no timer needed
            return await asyncio.wait_for(pending, max(0.0, deadline - time.monotonic()))
        except zmq.Again:
            # pyzmq fails a pending receive with EAGAIN when the socket signalled input
            # that was gone when it read (seen once on a CURVE sink): wait again, with
            # the same deadline.
            await asyncio.sleep(0)
        except asyncio.TimeoutError:
            raise TransportTimeout(peer, awaited, timeout_s or 0.0) from None


# The fast paths are only for sockets that move messages one way. The zmq socket's
# file descriptor is edge-triggered: a send through the shadow socket on a socket
# that also receives (ROUTER, DEALER) can consume the edge that announces queued
# input, and the pending asyncio receive then sleeps until some later event (seen
# as a coordinator that read nothing for seconds while stages queued replies).
# zmq.asyncio's own calls re-check the socket's events after each operation.
_SEND_ONLY = frozenset({zmq.PUSH, zmq.PUB})
_RECEIVE_ONLY = frozenset({zmq.PULL, zmq.SUB})


def _shadow(sock: zmq.asyncio.Socket, kinds: frozenset[int]) -> zmq.Socket[Any] | None:
    """The synchronous socket behind a zmq.asyncio socket of one of ``kinds``, for
    non-blocking fast paths; None for any other socket."""
    shadow = getattr(sock, "_shadow_sock", None)
    if not isinstance(shadow, zmq.Socket) or shadow.type not in kinds:
        return None
    return shadow


def decode_frames(frames: Sequence[zmq.Frame], max_message_bytes: int) -> Message:
    return decode(frames, max_message_bytes=max_message_bytes)


def frames_nbytes(frames: Sequence[zmq.Frame]) -> int:
    return sum(len(f) for f in frames)


def bind_endpoint(sock: zmq.asyncio.Socket, endpoint: str) -> str:
    """Bind and return the endpoint actually bound (resolves port 0 and ``*``)."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise ConfigError(f"cannot bind {endpoint}: {exc}") from None
    bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return bound


def advertised_endpoint(bound: str, *, advertise_host: str | None, toward: str | None) -> str:
    """The address peers should connect to for a socket bound at ``bound``.

    A socket bound on 0.0.0.0 is reachable at the address this host uses to
    reach ``toward`` (the coordinator); found with a UDP "connect", which sends
    nothing.
    """
    parts = urlsplit(bound)
    if parts.scheme != "tcp":
        return bound
    host, port = parts.hostname or "", parts.port
    if advertise_host:
        host = advertise_host
    elif host in ("0.0.0.0", "::", ""):
        host = _local_address_toward(toward)
    if ":" in host:
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def _local_address_toward(endpoint: str | None) -> str:
    if not endpoint:
        return "127.0.0.1"
    parts = urlsplit(endpoint)
    target = parts.hostname
    if not target or parts.scheme != "tcp":
        return "127.0.0.1"
    try:
        if ipaddress.ip_address(target).is_loopback:
            return "127.0.0.1"
    except ValueError:
        pass  # a host name: resolve it through the routing table below
    probe = pysocket.socket(pysocket.AF_INET, pysocket.SOCK_DGRAM)
    try:
        probe.connect((target, parts.port or 9))
        return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()


def validate_endpoint(endpoint: str, *, flag: str) -> str:
    """Check a user-given endpoint early, so a typo fails with the flag's name."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("tcp", "ipc", "inproc"):
        raise ConfigError(f"{flag}: {endpoint!r} must look like tcp://HOST:PORT")
    if parts.scheme == "tcp":
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None:
            raise ConfigError(f"{flag}: {endpoint!r} must look like tcp://HOST:PORT")
    return endpoint
