"""Waiting on a zpipe one-way socket without zmq.asyncio's futures.

zmq.asyncio's receive builds a future, a done-callback and an event record per
message and reads the socket's events five or six times per wait (about 25-55
us of one core per message here, ``bench/roundtrip_parts.py``).
:func:`recv_when_readable` waits on the socket's file descriptor itself and
then takes the message non-blocking. The descriptor only says the socket has
news; a non-blocking receive that finds nothing has processed that news (which
clears the descriptor), so each wait is registered right after such a receive,
with nothing touching the socket in between (one thread, no await): no wake-up
can be lost. The reader lives only during the wait, so zmq.asyncio can still
take the socket over later (:func:`zpipe.transport.sockets.recv_frames` then
uses zmq.asyncio for it), and closing a :class:`ZpipeSocket` cancels the wait,
as it cancels zmq.asyncio's own pending receives.

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
_NOBLOCK_SNDMORE = int(zmq.NOBLOCK | zmq.SNDMORE)


def take_queued(
    shadow: zmq.Socket[Any], bounds: MessageBounds
) -> list[zmq.Frame] | OverBounds | None:
    """The message already queued on ``shadow`` (within ``bounds``, see
    :func:`~zpipe.transport.message_bounds.take_rest`), or None when none is: a
    stream's receive that finds its next message waiting needs no coroutine, future
    or wait."""
    try:
        first = shadow.recv(_NOBLOCK, False)
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
    return cast("zmq.MessageTracker | None", _send_one(shadow, frames[last], _NOBLOCK, copy, track))


class ZpipeSocket(zmq.asyncio.Socket):
    """A ``zmq.asyncio`` socket that also knows the receives :func:`recv_when_readable`
    waits for by itself: one reader on the descriptor wakes them all, and closing the
    socket cancels them, as ``zmq.asyncio`` cancels its own pending receives."""

    # what one received message may hold (zpipe.transport.message_bounds); None: the
    # codec's defaults for the socket's kind
    message_bounds: MessageBounds | None = None
    # messages past those bounds, read and discarded since the socket opened
    refused_messages: int = 0
    # None: no reader on the descriptor; a set (maybe empty): the reader is on
    _zpipe_waiters: set[asyncio.Future[None]] | None = None
    _zpipe_loop: asyncio.AbstractEventLoop | None = None
    _zpipe_removal_due = False

    def wait_started(self, loop: asyncio.AbstractEventLoop, waiter: asyncio.Future[None]) -> None:
        if self._zpipe_waiters is None:
            self._zpipe_waiters = set()
            self._zpipe_loop = loop
            loop.add_reader(self.FD, self._wake_waiters)
        self._zpipe_waiters.add(waiter)

    def wait_ended(self, loop: asyncio.AbstractEventLoop, waiter: asyncio.Future[None]) -> None:
        if self._zpipe_waiters is None:
            return  # closed meanwhile: close() removed the reader
        self._zpipe_waiters.discard(waiter)
        if not self._zpipe_waiters and not self._zpipe_removal_due:
            # Off the descriptor later, not now: a receive loop that wakes, takes
            # its message and finds the queue empty waits again within the same
            # pass, and keeps the reader (adding and removing it costs uvloop a poll
            # handle and several system calls per message). An idle reader runs at
            # most one pass. (A wake by the descriptor has scheduled this already.)
            self._schedule_removal(loop)

    def _schedule_removal(self, loop: asyncio.AbstractEventLoop) -> None:
        self._zpipe_removal_due = True
        loop.call_soon(self._remove_reader_if_idle)

    def _remove_reader_if_idle(self) -> None:
        self._zpipe_removal_due = False
        if self._zpipe_waiters is None or self._zpipe_waiters:
            return  # closed meanwhile, or waited on again
        self._zpipe_waiters = None
        # zmq.asyncio may have taken the socket over meanwhile: the reader on the
        # descriptor is then its own, which it needs
        if self._zpipe_loop is not None and getattr(self, "_current_loop", None) is None:
            try:
                self._zpipe_loop.remove_reader(self.FD)
            except (OSError, ValueError, zmq.ZMQError):  # the socket is closing
                pass

    def _wake_waiters(self) -> None:
        waiters = self._zpipe_waiters
        if not waiters:
            return
        for waiter in waiters:
            _wake(waiter)
        if not self._zpipe_removal_due and self._zpipe_loop is not None:
            # The look for an idle reader goes behind the woken tasks, into the same
            # pass of the loop: a receive loop has waited again by then, and the
            # look finds it. Scheduled from wait_ended instead, inside the task's
            # step, it ran a pass later: one more pass of the loop, with a poll of
            # its descriptors, after every message a waiting receive took.
            self._schedule_removal(self._zpipe_loop)

    def close(self, linger: int | None = None) -> None:
        waiters, self._zpipe_waiters = self._zpipe_waiters, None
        loop = self._zpipe_loop
        if waiters is not None and loop is not None:
            try:
                loop.remove_reader(self.FD)
            except (OSError, ValueError, RuntimeError, zmq.ZMQError):  # loop or socket gone
                pass
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
    ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    while True:
        await _readable(loop, sock, deadline)
        try:
            first = shadow.recv(flags=zmq.NOBLOCK, copy=False)
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
        sock.wait_ended(loop, woken)
        if timer is not None:
            timer.cancel()


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)
