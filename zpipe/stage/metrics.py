"""Per-stage counters: where a stage's time went and what crossed its links.

A zmq send only queues: the sender's ``send_s`` stays near zero while a slow
link takes seconds to move the bytes. :class:`LinkMeter` measures the link
itself: every data message is sent with a libzmq tracker, which completes when
libzmq releases the message, that is once its last byte went into the kernel's
socket (the kernel then buffers at most its send buffer, a few MB, on top).
``link_s`` is the wall time during which the stage had bytes on their way out,
``link_delivered_bytes`` what completed; the sender waits while ``window``
messages are on their way (up to its send deadline), so a slow link makes the
sender wait (``send_s``) and, once the outbox is full, the compute loop too
(``blocked_s``): backpressure a person can see.

A tracked send shares its buffers with libzmq, and releasing them wakes pyzmq's
collector thread, which takes the GIL: on a stage that relays 64-512 KiB
messages that cost a third of its CPU per message (bench/stage_relay.py). So
while the link keeps up, a message with another right behind it may go copied
and untracked (:meth:`LinkMeter.may_copy`, :meth:`LinkMeter.copied`): it rides
on the next tracked message, which libzmq writes out after it (one connection,
in order), and is counted written when that one is. The last message of a
burst, the one that takes the window's last place and every message sent while
a tracked one is still on its way are tracked, so a slow link is timed message
by message as before, and the window still bounds every message on its way.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field, fields

import zmq

from zpipe._errors import TransportTimeout
from zpipe.stage.timeline import Timeline
from zpipe.transport.sockets import COPY_BELOW_BYTES

# messages on their way to peers at once: one being written, the rest queued behind
# it, so the link never idles between messages and a slow one is felt at once
SEND_WINDOW = 4
# how long the event loop watches a sent message itself before the waiter thread
# takes it: below it a completion is stamped at most half this late (or early); a
# slower message is stamped by the thread when libzmq releases it
LOOK_AGAIN_S = 0.002


@dataclass
class StageCounters:
    """The compute loop is always in one of three states, so for a stage that has
    started streaming ``busy_s + idle_s + blocked_s`` is its wall time since the
    first input; sending runs concurrently and is counted apart in ``send_s``.
    """

    busy_s: float = 0.0  # computing micro-batches
    idle_s: float = 0.0  # waiting for input (counted from the first input on)
    blocked_s: float = 0.0  # waiting for room to hand an output to the sender
    send_s: float = 0.0  # the sender waiting on the link or the downstream queue
    link_s: float = 0.0  # wall time with sent bytes not yet out to the peer (LinkMeter)
    link_delivered_bytes: int = 0  # bytes whose last byte left for the peer
    link_peak_in_flight: int = 0  # most messages on their way out at once
    bytes_in: int = 0
    bytes_out: int = 0
    microbatches: int = 0
    errors: int = 0  # micro-batches whose compute raised
    dropped: int = 0  # messages that failed validation
    stale: int = 0  # messages of an older plan epoch
    lost: int = 0  # messages the emulated link lost
    # training: most forwards awaiting their backward at once, and the bytes they held
    peak_live_activations: int = 0
    peak_activation_bytes: int = 0
    allreduce_s: float = 0.0  # summing gradients with the rest of the stage's group
    # training: where busy time went (busy_s is all three plus inference forwards)
    forward_s: float = 0.0
    backward_s: float = 0.0
    step_s: float = 0.0
    backwards: int = 0  # micro-batches whose backward ran here (forwards: microbatches)
    # state moved with peer stages (backup chunks sent, fetched chunks received): it
    # rides on heartbeats, and a change is progress on an answer the coordinator awaits
    peer_state_bytes: int = 0
    started_at: float = field(default_factory=time.monotonic)
    # each micro-batch's spans (sent only when asked, never with the counters)
    timeline: Timeline = field(default_factory=Timeline, repr=False, compare=False)

    @property
    def utilisation(self) -> float:
        total = self.busy_s + self.idle_s + self.blocked_s
        return self.busy_s / total if total > 0 else 0.0

    def _numbers(self) -> dict[str, float | int]:
        # not asdict: it would deep-copy the timeline at every heartbeat
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "timeline"}

    def to_dict(self) -> dict[str, float | int]:
        data = self._numbers()
        data["uptime_s"] = time.monotonic() - data.pop("started_at")
        data["utilisation"] = self.utilisation
        # the rate the links moved data while busy (0 before anything was sent)
        data["link_mbps"] = (
            self.link_delivered_bytes * 8 / 1e6 / self.link_s if self.link_s > 0 else 0.0
        )
        return data

    def reset(self, *, keep_timeline: bool = False) -> None:
        fresh = StageCounters()
        for name, value in fresh._numbers().items():
            setattr(self, name, value)
        if not keep_timeline:
            self.timeline.clear()


def _written(tracker: zmq.MessageTracker) -> bool:
    """Whether libzmq has released the tracked message, without waiting: ``done``
    reads the tracker's events' flags, where ``wait(0)`` took each event's lock and
    raised NotDone for every message still on its way (the loop looks at each
    watched message once or more per send)."""
    return tracker.done


@dataclass
class _Watched:
    """A message the event loop watches: queued at ``queued_at``, last seen on its way
    at ``looked_at``; ``messages`` counts it and the copied ones riding on it, whose
    bytes ``nbytes`` includes."""

    tracker: zmq.MessageTracker
    nbytes: int
    queued_at: float
    looked_at: float
    messages: int = 1


class LinkMeter:
    """Tracks the data messages a stage sends until libzmq has written them out.

    :meth:`room` waits (up to a deadline) for a place in the window before a send;
    :meth:`track` takes the send's tracker. The results land in ``counters``.

    A tracker offers no callback, so completions are seen in one of two ways:

    * the event loop looks (without waiting) whenever it asks for room or tracks a
      send, and at the latest ``LOOK_AGAIN_S`` after the oldest watched message was
      sent. A message found written out is stamped halfway between the look that
      saw it on its way and the one that saw it written, so ``link_s`` is off by at
      most half that gap (at most ``LOOK_AGAIN_S`` / 2 unless the loop runs late):
      this is how fast links are measured, and it costs no thread hand-off;
    * a message still on its way ``LOOK_AGAIN_S`` after it was sent, or while a send
      waits for room or a caller for the drain, goes to the waiter thread, with every
      message sent after it until none is on its way: the thread waits on each
      tracker and stamps it when libzmq released it, so slow links (the ones whose
      time matters) are timed as precisely as before and a full window frees its
      place the moment the link moves.

    A message sent copied and untracked (:meth:`may_copy`, then :meth:`copied`)
    has no tracker: it takes a place in the window and rides on the next tracked
    message, which frees its place and counts it written out with it. Its
    ``link_s`` is thus bounded by that message's, sent at most a short forward
    later (the caller promises one right behind it).
    """

    def __init__(self, counters: StageCounters, *, window: int = SEND_WINDOW) -> None:
        self._counters = counters
        self._window = window
        self._room = asyncio.Semaphore(window)
        self._overdraft = 0  # places taken past the window (room waited its deadline out)
        self._in_flight = 0
        self._drained = asyncio.Event()
        self._drained.set()
        self._counted_to = 0.0  # link_s covers the busy time up to here
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watched: deque[_Watched] = deque()  # on their way, watched by the loop
        self._look_timer: asyncio.TimerHandle | None = None
        self._handed_off = 0  # on their way, owned by the waiter thread
        # copied messages sent since the last tracked one, which they ride on
        self._riders = 0
        self._rider_bytes = 0
        self._pending: queue.SimpleQueue[tuple[zmq.MessageTracker, int, int] | None] = (
            queue.SimpleQueue()
        )
        self._waiter: threading.Thread | None = None
        self._closed = False

    async def room(self, *, timeout_s: float) -> None:
        """Wait for a place in the window, at most ``timeout_s``: past it the message
        goes anyway (zmq's own queue bound and send deadline then decide, as before the
        window), so a link too slow to move one message within the deadline is never a
        new failure."""
        if self.has_room():
            # taken without suspending: no task, timer or loop pass for the common case
            await self._room.acquire()
            return
        self._hand_off()  # the waiter frees the place the moment the link moves
        try:
            await asyncio.wait_for(self._room.acquire(), timeout_s)
        except asyncio.TimeoutError:
            self._overdraft += 1

    def has_room(self) -> bool:
        """Whether :meth:`room` would return at once (a place is free, nobody waits)."""
        if self._watched:
            self._look(time.perf_counter())
        return not self._room.locked()

    def release(self) -> None:
        """Give back the place :meth:`room` gave when nothing was sent after all."""
        if self._overdraft > 0:
            self._overdraft -= 1
        else:
            self._room.release()

    def may_copy(self, nbytes: int, *, more_behind: bool) -> bool:
        """Whether the next message, whose untracked send would copy ``nbytes`` tensor
        bytes (a tensor sent on as its received frame copies none), may go copied and
        untracked (then :meth:`copied`, not :meth:`track`). Only when the caller sends
        another message right behind it (``more_behind``: a copied one never ends a
        burst), of fewer bytes than an untracked send copies
        (:data:`~zpipe.transport.sockets.COPY_BELOW_BYTES`: larger ones are shared with
        libzmq anyway), while no tracked message is still on
        its way (the link keeps up: on a slow one every message is tracked) and a
        place stays free for the tracked message it rides on. Ask after
        :meth:`has_room`, which looks at the tracked ones."""
        return (
            more_behind
            and nbytes < COPY_BELOW_BYTES
            and not self._watched
            and self._handed_off == 0
            and self._riders + 2 <= self._window
        )

    def copied(self, nbytes: int) -> None:
        """A message just queued copied and untracked (its place in the window taken):
        written out, for the counters, when the next tracked message is."""
        if self._closed:
            self.release()
            return
        self._one_more(time.perf_counter())
        self._riders += 1
        self._rider_bytes += nbytes

    def _one_more(self, now: float) -> None:
        if self._in_flight == 0:
            self._counted_to = now
            self._drained.clear()
        self._in_flight += 1
        counters = self._counters
        counters.link_peak_in_flight = max(counters.link_peak_in_flight, self._in_flight)

    def track(self, tracker: zmq.MessageTracker, nbytes: int) -> None:
        """A message just queued with ``tracker`` (its place in the window taken); the
        copied ones sent since the last tracked message ride on it."""
        if self._closed:
            self.release()
            return
        now = time.perf_counter()
        self._one_more(now)
        messages, nbytes = 1 + self._riders, nbytes + self._rider_bytes
        self._riders = self._rider_bytes = 0
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if self._handed_off > 0:  # the waiter owns the older ones: it keeps the order
            self._to_waiter(tracker, nbytes, messages)
            return
        self._watched.append(_Watched(tracker, nbytes, now, now, messages))
        if self._look_timer is None:
            self._look_timer = self._loop.call_at(
                self._loop.time() + LOOK_AGAIN_S, self._look_or_hand_off
            )

    def _look(self, now: float) -> None:
        """Count the watched messages written out by now (each at most one look late)."""
        still: deque[_Watched] = deque()
        for sent in self._watched:
            if _written(sent.tracker):
                self._done(sent.nbytes, (sent.looked_at + now) / 2, sent.messages)
            else:
                sent.looked_at = now
                still.append(sent)
        self._watched = still
        if not still and self._look_timer is not None:
            self._look_timer.cancel()
            self._look_timer = None

    def _look_or_hand_off(self) -> None:
        self._look_timer = None
        if self._closed or not self._watched:
            return
        now = time.perf_counter()
        self._look(now)
        if not self._watched:
            return
        oldest = self._watched[0].queued_at
        if now - oldest >= LOOK_AGAIN_S:
            self._hand_off()
        else:
            assert self._loop is not None
            wait_s = oldest + LOOK_AGAIN_S - now
            self._look_timer = self._loop.call_at(
                self._loop.time() + wait_s, self._look_or_hand_off
            )

    def _hand_off(self) -> None:
        """Give every watched message to the waiter thread, oldest first."""
        if not self._watched:
            return
        self._look(time.perf_counter())
        if self._look_timer is not None:
            self._look_timer.cancel()
            self._look_timer = None
        watched, self._watched = self._watched, deque()
        for sent in watched:
            self._to_waiter(sent.tracker, sent.nbytes, sent.messages)

    def _to_waiter(self, tracker: zmq.MessageTracker, nbytes: int, messages: int = 1) -> None:
        self._handed_off += 1
        if self._waiter is None:
            self._waiter = threading.Thread(target=self._wait_all, name="zpipe-link", daemon=True)
            self._waiter.start()
        self._pending.put((tracker, nbytes, messages))

    def _wait_all(self) -> None:
        following: tuple[zmq.MessageTracker, int, int] | None = None
        while True:
            item = following if following is not None else self._pending.get()
            following = None
            if item is None:
                return
            tracker, nbytes, messages = item
            while not self._closed:
                try:
                    tracker.wait(0.5)
                    break
                except zmq.NotDone:
                    continue
            completed = [(nbytes, time.perf_counter(), messages)]
            # The messages queued behind it that are written out too go back in the
            # same wake-up of the event loop (each wake-up is a thread hand-off).
            ended = False
            while True:
                try:
                    item = self._pending.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    ended = True
                    break
                if not _written(item[0]):
                    following = item
                    break
                completed.append((item[1], time.perf_counter(), item[2]))
            assert self._loop is not None
            try:
                self._loop.call_soon_threadsafe(self._done_all, completed)
            except RuntimeError:  # the loop closed: nobody reads the counters any more
                return
            if ended:
                return

    def _done_all(self, completed: list[tuple[int, float, int]]) -> None:
        self._handed_off -= len(completed)
        for nbytes, done_at, messages in completed:
            self._done(nbytes, done_at, messages)

    def _done(self, nbytes: int, done_at: float, messages: int = 1) -> None:
        """``messages`` (a tracked one and the copied ones riding on it, ``nbytes`` in
        all) written out at ``done_at``."""
        for _ in range(messages):
            self.release()
        if self._closed:
            return
        counters = self._counters
        counters.link_delivered_bytes += nbytes
        # counted as each message completes, so a reading mid-stream is current
        counters.link_s += max(done_at - self._counted_to, 0.0)
        self._counted_to = max(self._counted_to, done_at)
        self._in_flight -= messages
        if self._in_flight == 0:
            self._drained.set()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def drained(self, *, timeout_s: float, peer: str) -> None:
        """Wait until every message sent has been written out (a benchmark's end; a
        copied message is, once the tracked one sent behind it is)."""
        self._hand_off()
        try:
            await asyncio.wait_for(self._drained.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise TransportTimeout(peer, "the link to drain", timeout_s) from None

    def close(self) -> None:
        """Stop waiting (the sockets are closed or about to be): the thread ends."""
        self._closed = True
        if self._look_timer is not None:
            self._look_timer.cancel()
            self._look_timer = None
        self._watched.clear()
        self._pending.put(None)
