"""Waiting on a zpipe one-way socket without zmq.asyncio's futures.

zmq.asyncio's receive builds a future, a done-callback and an event record per
message and reads the socket's events five or six times per wait (about 25-55
us of one core per message here, ``bench/roundtrip_parts.py``).
:func:`recv_when_readable` waits on the socket's file descriptor itself and
then takes the message non-blocking. The descriptor only says the socket has
news; a non-blocking receive that finds nothing, or a read of the socket's events
that shows no message, has processed that news (which clears the descriptor),
so each wait is registered right after one, with nothing touching the socket in
between (one thread, no await): no wake-up can be lost. The reader stays on
the descriptor while receives wait one after another and comes off the first
time the descriptor has news that nobody waits for; zmq.asyncio can still take
the socket over later (:func:`zpipe.transport.sockets.recv_frames` then uses
zmq.asyncio for it, whose reader replaces this one), and closing a
:class:`ZpipeSocket` cancels the wait, as it cancels zmq.asyncio's own pending
receives.

:func:`send_when_writable` does the same for a send-only socket whose queue is
full: it reads the socket's events (which processes its pending commands and
clears the descriptor) before each wait, so the descriptor announces the room
made after that. zmq.asyncio's
send would instead register its own reader on the descriptor for the socket's
whole life, and run its event handler (several reads of the socket's events)
on every later wake-up of the descriptor.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

import zmq
import zmq.asyncio

from zpipe._errors import TransportTimeout
from zpipe.transport.message_bounds import MessageBounds, OverBounds, take_rest

# pyzmq's own send of one frame (its Cython backend). ``Socket.send_multipart`` wraps
# it in two Python layers that check every part's type and build each part's flags
# with enum operators: about 3 us of the 8 a 64 KiB message costs to send and
# receive in one process (bench/transport.py's by-thread figures). The frames sent
# here come from the codec: bytes, memoryviews and zmq.Frames, every one a buffer.
_send_one = zmq.backend.Socket.send
_NOBLOCK = int(zmq.NOBLOCK)
# pyzmq's backend read of an option: the sugar layer's ``get`` adds a Python call
_get_option = zmq.backend.Socket.get
# pyzmq's backend receive of one frame, called unbound: ``shadow.recv`` looks the
# method up on the instance, and every attribute of a pyzmq socket goes through
# the slow hook of a class with ``__getattr__`` (pyzmq's option attributes), about
# 450-600 instructions a look-up (callgrind, bench/_transport_counts.py)
_recv_one = zmq.backend.Socket.recv
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK_SNDMORE = int(zmq.NOBLOCK | zmq.SNDMORE)

# The fast paths are only for sockets that move messages one way. The zmq socket's
# file descriptor is edge-triggered: a send through the shadow socket on a socket
# that also receives (ROUTER, DEALER) can consume the edge that announces queued
# input, and the pending asyncio receive then sleeps until some later event (seen
# as a coordinator that read nothing for seconds while stages queued replies).
# zmq.asyncio's own calls re-check the socket's events after each operation.
SEND_ONLY_KINDS = frozenset({zmq.PUSH, zmq.PUB})
RECEIVE_ONLY_KINDS = frozenset({zmq.PULL, zmq.SUB})


def take_queued(
    shadow: zmq.Socket[Any], bounds: MessageBounds, *, look_first: bool = False
) -> list[zmq.Frame] | OverBounds | None:
    """The message already queued on ``shadow`` (within ``bounds``, see
    :func:`~zpipe.transport.message_bounds.take_rest`), or None when none is: a
    stream's receive that finds its next message waiting needs no coroutine, future
    or wait.

    ``look_first``: read the socket's events before receiving, for a caller that
    expects to find nothing (one whose last receive had to wait). Either way the
    socket has processed its news when this returns None, which clears its
    descriptor, so a wait registered next cannot miss a message. A receive that
    finds nothing raises ``zmq.Again``, which pyzmq builds in Python (about 28,000
    instructions here, callgrind); reading the events costs about 8,500, and one
    that finds a message pays both, hence the choice."""
    # typing.cast is a call at run time: kept off the per-message paths
    if look_first and not _get_option(shadow, _EVENTS) & _POLLIN:  # type: ignore[operator]
        return None
    try:
        first = _recv_one(shadow, _NOBLOCK, False)
    except zmq.Again:
        return None
    return take_rest(shadow, first, bounds)


def send_whole_nowait(
    shadow: zmq.Socket[Any], frames: list[Any], *, copy: bool, track: bool
) -> zmq.MessageTracker | None:
    """Queue ``frames`` as one multipart message without blocking, as
    ``shadow.send_multipart(frames, flags=zmq.NOBLOCK, ...)`` does: ``zmq.Again``
    when there is no room, and then nothing was queued (libzmq checks room at a
    message's first frame only, so the later frames of a message never fail it).
    Returns the last frame's tracker (None when copied), as pyzmq's does."""
    last = len(frames) - 1
    for i in range(last):
        _send_one(shadow, frames[i], _NOBLOCK_SNDMORE, copy, track)
    tracker: zmq.MessageTracker | None = _send_one(shadow, frames[last], _NOBLOCK, copy, track)
    return tracker


class DescriptorReader:
    """A socket's reader on its descriptor and the receives it wakes.

    Kept off the socket itself: every attribute written on a pyzmq socket runs
    pyzmq's ``__setattr__`` (Python code that looks for a socket option of that
    name), and the receive path writes these per message.
    """

    __slots__ = ("fd", "loop", "on", "waited_last", "waiters")

    def __init__(self, fd: int) -> None:
        # the socket's descriptor, read once: ``sock.FD`` is no attribute but an
        # option read by name (pyzmq's ``__getattr__``), and a reader that comes
        # off and back on per message would pay it twice per message
        self.fd = fd
        self.loop: asyncio.AbstractEventLoop | None = None
        # whether the reader is on ``loop``; it stays on between waits (see _wake)
        self.on = False
        self.waiters: set[asyncio.Future[None]] = set()
        # whether the last receive had to wait: the next one then looks at the
        # socket's events before it receives (see take_queued)
        self.waited_last = False


class ZpipeSocket(zmq.asyncio.Socket):
    """A ``zmq.asyncio`` socket that also knows the receives :func:`recv_when_readable`
    waits for by itself: one reader on the descriptor wakes them all, and closing the
    socket cancels them, as ``zmq.asyncio`` cancels its own pending receives."""

    # what one received message may hold (zpipe.transport.message_bounds); None: the
    # codec's defaults for the socket's kind
    message_bounds: MessageBounds | None = None
    # messages past those bounds, read and discarded since the socket opened
    refused_messages: int = 0
    _zpipe_reader: DescriptorReader | None = None
    # The connection guard of a listener's socket (zpipe.transport.conn_guard sets
    # it on the instance). A class default makes the receive path's look for it a
    # plain attribute read: without one, every received message fell through to
    # pyzmq's ``__getattr__``, which looks for a socket option of that name and
    # raises AttributeError (about 3 us of CPU per message here).
    _zpipe_connection_guard: Any = None
    # The synchronous shadow of a send-only (PUSH, PUB) or a receive-only (PULL, SUB)
    # socket, else None: found once, when the socket opens (its kind never changes),
    # not per message (see zpipe.transport.sockets._shadow for why only those kinds).
    send_only_shadow: zmq.Socket[Any] | None = None
    receive_only_shadow: zmq.Socket[Any] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # pyzmq's stubs type the base as Socket[bytes]
        super().__init__(*args, **kwargs)  # type: ignore[misc]
        shadow = cast("zmq.Socket[Any]", self._shadow_sock)
        if shadow.type in SEND_ONLY_KINDS:
            self.send_only_shadow = shadow
        elif shadow.type in RECEIVE_ONLY_KINDS:
            self.receive_only_shadow = shadow

    @property
    def descriptor_reader(self) -> DescriptorReader:
        reader = self._zpipe_reader
        if reader is None:
            reader = self._zpipe_reader = DescriptorReader(cast(int, self.FD))
        return reader

    def wait_started(self, loop: asyncio.AbstractEventLoop, waiter: asyncio.Future[None]) -> None:
        reader = self.descriptor_reader
        if not reader.on or reader.loop is not loop:
            if reader.on:
                self._remove_reader(reader)  # still on a loop of the past
            reader.loop = loop
            reader.on = True
            loop.add_reader(reader.fd, self._wake_waiters)
        reader.waiters.add(waiter)

    def wait_ended(self, waiter: asyncio.Future[None]) -> None:
        reader = self._zpipe_reader
        if reader is not None:
            reader.waiters.discard(waiter)

    def _wake_waiters(self) -> None:
        reader = self._zpipe_reader
        if reader is None:
            return
        waiters = reader.waiters
        if not waiters:
            # The descriptor has news and nobody waits: the reader comes off now (a
            # descriptor nobody reads stays readable, and the reader would run on
            # every pass of the loop). It stays on while receives wait one after
            # another, so a receive loop neither adds nor removes it per message
            # (a poll handle and system calls under uvloop), nor schedules a look
            # for an idle reader per message (a callback and a loop pass).
            self._remove_reader(reader)
            return
        for waiter in waiters:  # _wake, inlined: this runs on every waited receive
            if not waiter.done():
                waiter.set_result(None)

    def _remove_reader(self, reader: DescriptorReader) -> None:
        reader.on = False
        # zmq.asyncio may have taken the socket over meanwhile: the reader on the
        # descriptor is then its own, which it needs
        if reader.loop is not None and getattr(self, "_current_loop", None) is None:
            try:
                reader.loop.remove_reader(reader.fd)
            except (OSError, ValueError, RuntimeError, zmq.ZMQError):  # loop or socket gone
                pass

    def close(self, linger: int | None = None) -> None:
        reader = self._zpipe_reader
        if reader is not None:
            if reader.on:
                self._remove_reader(reader)
            waiters, reader.waiters = reader.waiters, set()
            for waiter in waiters:
                if not waiter.done():
                    try:
                        waiter.cancel()
                    except RuntimeError:  # its loop is already closed (teardown)
                        pass
        super().close(linger=linger)


async def recv_when_readable(
    sock: ZpipeSocket,
    shadow: zmq.Socket[Any],
    timeout_s: float | None,
    peer: str,
    awaited: str,
    bounds: MessageBounds,
) -> list[zmq.Frame] | OverBounds:
    """Receive one multipart message on ``sock`` (receive-only, not watched by
    zmq.asyncio) by waiting on its descriptor, frame by frame within ``bounds``
    (:func:`zpipe.transport.message_bounds.take_rest`); TransportTimeout past
    ``timeout_s``.

    For a caller whose look for a queued message (:func:`take_queued`) just found
    none, with nothing touching the socket since."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    reader = sock._zpipe_reader or sock.descriptor_reader
    reader.waited_last = True
    while True:
        # _readable's wait, inlined: a coroutine less to create and to resume
        # through on every waited receive (the common case of a round trip), and
        # the reader's bookkeeping too where it is already on this loop
        woken: asyncio.Future[None] = loop.create_future()
        timer = None if deadline is None else loop.call_at(deadline, _wake, woken)
        if reader.on and reader.loop is loop:
            waiters = reader.waiters
            waiters.add(woken)
        else:
            sock.wait_started(loop, woken)
            waiters = reader.waiters
        try:
            await woken
        finally:
            # the set close() left behind when it cancelled the wait: discard is harmless
            waiters.discard(woken)
            if timer is not None:
                timer.cancel()
        try:
            first = _recv_one(shadow, _NOBLOCK, False)
        except zmq.Again:
            # news that was not a message (a peer connected, say): wait again
            if deadline is not None and loop.time() >= deadline:
                raise TransportTimeout(peer, awaited, timeout_s or 0.0) from None
        else:
            return take_rest(shadow, first, bounds)


async def send_when_writable(
    sock: ZpipeSocket,
    shadow: zmq.Socket[Any],
    frames: list[Any],
    *,
    copy: bool,
    track: bool,
    timeout_s: float,
    peer: str,
    awaited: str,
) -> zmq.MessageTracker | None:
    """Queue ``frames`` on ``sock`` (send-only, not watched by zmq.asyncio) once it
    has room, waiting on its descriptor; TransportTimeout past ``timeout_s``.

    For a caller whose non-blocking send of ``frames`` just failed with EAGAIN."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        # Reading the events processes every command the socket has pending, which
        # clears its descriptor: a failed send alone may skip them (libzmq throttles
        # that processing), and the descriptor would then stay readable and the
        # wait below return at once, again and again (seen: 34 passes per wait).
        if cast(int, shadow.getsockopt(zmq.EVENTS)) & zmq.POLLOUT:
            try:
                return send_whole_nowait(shadow, frames, copy=copy, track=track)
            except zmq.Again:
                pass  # room for less than a message: wait for more
        if loop.time() >= deadline:
            raise TransportTimeout(peer, awaited, timeout_s)
        await _readable(loop, sock, deadline)


async def _readable(
    loop: asyncio.AbstractEventLoop, sock: ZpipeSocket, deadline: float | None
) -> None:
    """Until ``sock``'s descriptor is readable or the loop's clock passes ``deadline``;
    cancelled when ``sock`` closes."""
    woken: asyncio.Future[None] = loop.create_future()
    timer = None if deadline is None else loop.call_at(deadline, _wake, woken)
    sock.wait_started(loop, woken)
    try:
        await woken
    finally:
        sock.wait_ended(woken)
        if timer is not None:
            timer.cancel()


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)
