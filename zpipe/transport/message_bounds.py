"""One multipart message taken frame by frame, within a bound on its frames and bytes.

libzmq checks ``MAXMSGSIZE`` per frame and counts ``RCVHWM`` in whole messages,
so nothing in libzmq bounds how many frames one message has. pyzmq's
``recv_multipart`` made a ``zmq.Frame`` for every one of them (about 180 bytes of
Python heap each, measured): a message of a million one-byte frames, 3 MB on
the wire, became some 180 MB of objects before the codec refused it for its
frame count (issue 33, finding 1). Here the frames of a message are taken one
at a time (:func:`take_rest`); past the socket's :class:`MessageBounds` none
is kept, and :func:`discard_rest` reads and drops the rest of that message,
giving the event loop a turn every :data:`DRAIN_TURN_FRAMES` frames so that
heartbeats and timers go on. The receive then reports a
:class:`~zpipe._errors.MessageLimitError` (:meth:`OverBounds.error`) and goes on
with the next message.

What no application bounds: libzmq hands a multipart message to its reader
only once the last frame has arrived, and holds every frame until then (a 64-byte
``msg_t`` for a frame of up to 33 bytes; a larger one its bytes plus a small
header), up to ``RCVHWM`` whole messages per connection. A million one-byte
frames are about 64 MB inside libzmq, per message, before Python sees the first
frame; only keys (CURVE allow-lists, which refuse unknown peers at the
handshake) and the address checks of the data ports bound who can send them.

The functions take the synchronous socket (pyzmq's shadow of a zmq.asyncio
socket): every frame after the first is already queued (a message is delivered
whole), so none of them waits.
"""

from __future__ import annotations

import asyncio
import ctypes
from dataclasses import dataclass
from typing import Any, Protocol

import zmq

from zpipe._errors import MessageLimitError
from zpipe.transport.codec import DEFAULT_MAX_MESSAGE_BYTES, MAX_TENSORS

# What the codec accepts: a header and at most MAX_TENSORS tensor frames. Every
# zpipe port carries codec messages (bulk state travels as chunks of one tensor
# each), so no legal message has more.
CODEC_FRAMES = MAX_TENSORS + 1
# Frames a refused message is discarded in between turns of the event loop: a few
# milliseconds of one core (1-5 us a frame here, loaded).
DRAIN_TURN_FRAMES = 4096
# zmq.NOBLOCK is an enum member, a global and an attribute looked up per frame
_NOBLOCK = int(zmq.NOBLOCK)


# A refused message of this many frames had libzmq allocate them all (its queue's
# chunks, 64 bytes a frame); read and freed, glibc kept those pages in the process:
# a coordinator stayed at 542 MB of RSS (idle 242) after 6 messages of a million
# frames had been discarded. malloc_trim hands them back, after each such message:
# it costs far less than reading the 65,536 frames did.
TRIM_AFTER_FRAMES = 1 << 16
# ...and so did a refused message of many large frames: three messages of 8,000 frames
# of 60 kB (each frame below the mmap threshold, so on the heap) took a stage's data
# port from 335 to 1,684 MB of RSS, and it kept 1,667 MB after the sender left.
TRIM_AFTER_BYTES = 64 << 20


def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, found among the symbols this process already has
    loaded (``ctypes.util.find_library`` would start ``ldconfig``), or None."""
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except (OSError, TypeError):
        return None


def give_back_freed_memory(frames: int, nbytes: int = 0) -> bool:
    """After a refused message of ``frames`` frames and ``nbytes`` bytes: return the C
    heap's free pages to the system (glibc's ``malloc_trim``; elsewhere nothing).
    Whether it ran."""
    if frames < TRIM_AFTER_FRAMES and nbytes < TRIM_AFTER_BYTES:
        return False
    return trim_heap()


def trim_heap() -> bool:
    """Return the C heap's free pages to the system (glibc's ``malloc_trim``;
    elsewhere nothing): after a big buffer was dropped. Whether it ran."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class FrameSource(Protocol):
    """The part of a synchronous zmq socket that taking a message uses."""

    def recv(self, flags: int = ..., copy: bool = ..., track: bool = ...) -> Any: ...


@dataclass(frozen=True)
class MessageBounds:
    """The most frames and bytes one received message may have on a socket."""

    max_frames: int
    max_bytes: int

    def __post_init__(self) -> None:
        if self.max_frames < 1 or self.max_bytes < 0:
            raise ValueError(
                f"message bounds need max_frames >= 1 and max_bytes >= 0, got "
                f"{self.max_frames}, {self.max_bytes}"
            )

    @classmethod
    def for_socket(cls, kind: int, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> MessageBounds:
        """A codec message's frames, plus the routing id a ROUTER puts in front."""
        return cls(CODEC_FRAMES + (1 if kind == zmq.ROUTER else 0), max_bytes)


@dataclass
class OverBounds:
    """A message past its bound: its first frame (a ROUTER's routing id, else the
    header: who sent it), what was seen of it and whether frames of it remain."""

    first: Any
    frames: int
    nbytes: int
    more: bool
    bounds: MessageBounds

    def error(self) -> MessageLimitError:
        if self.frames > self.bounds.max_frames:
            what = f"more than {self.bounds.max_frames} frames"
        else:
            what = f"more than {self.bounds.max_bytes} bytes"
        return MessageLimitError(
            f"a message of {what} ({self.frames} frames, {self.nbytes} bytes read): "
            "no legal message on this port has that many; discarded",
            frames=self.frames,
            nbytes=self.nbytes,
        )


def take_rest(shadow: FrameSource, first: Any, bounds: MessageBounds) -> list[Any] | OverBounds:
    """The frames of the message whose ``first`` frame was just received, or a
    :class:`OverBounds` once it passes ``bounds`` (the frames read are then dropped;
    :func:`discard_rest` reads the others)."""
    frames = [first]
    nbytes = len(first)
    frame = first
    # Frame.more is the flag libzmq set on this frame: no call into the socket, where
    # recv_multipart asks RCVMORE for every frame
    while frame.more:
        frame = shadow.recv(_NOBLOCK, False)  # flags, copy: positional, an int flag
        nbytes += len(frame)
        frames.append(frame)
        if len(frames) > bounds.max_frames or nbytes > bounds.max_bytes:
            return OverBounds(first, len(frames), nbytes, frame.more, bounds)
    if nbytes > bounds.max_bytes:  # a single frame over the byte bound
        return OverBounds(first, len(frames), nbytes, False, bounds)
    return frames


def discard_some(shadow: FrameSource, refused: OverBounds, limit: int = DRAIN_TURN_FRAMES) -> None:
    """Read and drop up to ``limit`` more frames of ``refused``'s message, counting them."""
    for _ in range(limit):
        if not refused.more:
            return
        frame = shadow.recv(zmq.NOBLOCK, copy=False)
        refused.frames += 1
        refused.nbytes += len(frame)
        refused.more = frame.more


async def discard_rest(
    shadow: FrameSource, refused: OverBounds, *, between_turns: Any = None
) -> None:
    """Read and drop the rest of ``refused``'s message, a turn of the event loop
    every :data:`DRAIN_TURN_FRAMES` frames. ``between_turns`` (if given) is called
    before each turn: a zmq.asyncio socket re-checks its events there, since these
    reads may have taken the edge of its descriptor that a pending send waits for."""
    while refused.more:
        discard_some(shadow, refused)
        if refused.more:
            if between_turns is not None:
                between_turns()
            await asyncio.sleep(0)
