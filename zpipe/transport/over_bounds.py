"""What happens to a received message past its socket's bounds: the rest of it is
read and thrown away, counted and logged (see :mod:`zpipe.transport.message_bounds`
for the bounds and :func:`zpipe.transport.sockets.recv_frames` for the receive)."""

from __future__ import annotations

from typing import Any, cast

import structlog
import zmq
import zmq.asyncio

from zpipe.transport.fd_wait import ZpipeSocket
from zpipe.transport.message_bounds import (
    MessageBounds,
    OverBounds,
    discard_rest,
    give_back_freed_memory,
)

log = structlog.get_logger("zpipe.transport")


async def discard_over_bounds(
    sock: zmq.asyncio.Socket, refused: OverBounds, peer: str, *, watched: bool
) -> None:
    """Read the rest of a message past its bounds, count it and log it (rate-limited).

    ``watched``: zmq.asyncio watches the socket's descriptor (not a receive-only
    socket's fast path), so the reads may take the edge a pending send waits for
    and the socket's events are looked at between turns and after."""
    shadow = cast("zmq.Socket[Any]", sock._shadow_sock)

    def look() -> None:
        sock.get(zmq.EVENTS)  # zmq.asyncio schedules a pending send whose edge was taken

    await discard_rest(shadow, refused, between_turns=look if watched else None)
    if watched:
        look()
    if isinstance(sock, ZpipeSocket):
        sock.refused_messages += 1
    give_back_freed_memory(refused.frames, refused.nbytes)
    error = refused.error()
    log.warning(
        "dropped_message",
        peer=_sender_of(sock, refused.first, peer),
        error=str(error),
        frames=error.frames,
        bytes=error.nbytes,
    )


def _sender_of(sock: zmq.asyncio.Socket, first: Any, peer: str) -> str:
    """Who sent a refused message, for the log: a ROUTER's routing id, else the
    connection's address (libzmq's metadata), else what the caller awaited from."""
    if sock.type == zmq.ROUTER:
        routing_id = bytes(first.bytes)[:64]
        text = routing_id.decode("ascii", "replace")
        return text if text.isprintable() and "\ufffd" not in text else routing_id.hex()
    try:
        return str(first.get("Peer-Address"))
    except (zmq.ZMQError, AttributeError, KeyError, TypeError):
        return peer


def message_bounds_of(sock: zmq.asyncio.Socket) -> MessageBounds:
    """The bounds ``sock``'s received messages are held to (set with its receive
    limits by :func:`zpipe.transport.sockets.apply_receive_limits`; else a codec
    message's frames)."""
    bounds = getattr(sock, "message_bounds", None)
    if isinstance(bounds, MessageBounds):
        return bounds
    return MessageBounds.for_socket(int(sock.type))
