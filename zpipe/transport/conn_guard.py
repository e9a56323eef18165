"""Cut a connection that makes libzmq hold more than its budget (the I/O shell of
:mod:`zpipe.transport.conn_budget`).

For one listening socket: a monitor names each accepted connection's descriptor
(``EVENT_ACCEPTED``) and each dropped one; the receive path reports every message
it takes (:func:`zpipe.transport.sockets.recv_frames` calls :meth:`ConnectionGuard.saw`,
which reads the frame's source descriptor, ``zmq.SRCFD``); a timer on the event loop
reads each connection's ``tcpi_bytes_received`` (``TCP_INFO``, Linux >= 4.1: one
``getsockopt`` per connection) and, for the process rule, the resident memory
(``/proc/self/statm``). A connection to cut is shut down (``shutdown(SHUT_RDWR)`` on
libzmq's own descriptor, never closed here): libzmq sees the connection drop, throws
away the unfinished message it held and frees it; the heap is trimmed a little later
(glibc keeps freed pages otherwise). The peer may reconnect, and is cut again.

Where ``TCP_INFO`` is missing (another system, or an old kernel), the guard logs
it once and does nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket as pysocket
import struct
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog
import zmq
import zmq.asyncio

from zpipe.transport.conn_budget import (
    CURVE_FRAME_WRAPPING,
    ConnectionHolding,
    Cut,
    GuardBudget,
    MemoryGrowth,
    connections_to_cut,
    discarded_wire_bytes,
    message_wire_bytes,
    quiet,
)
from zpipe.transport.message_bounds import OverBounds, trim_heap

log = structlog.get_logger("zpipe.transport")

# struct tcp_info: tcpi_bytes_received is the u64 at this offset (Linux >= 4.1)
TCPI_BYTES_RECEIVED_OFFSET = 128
TCP_INFO_LENGTH = 256
# the process rule looks this often (a read of /proc/self/statm); libzmq allocates a
# few hundred MB a second under a flood, so a look every 50 ms overshoots by tens of MB
RSS_LOOK_S = 0.05
# the per-connection rule looks this often at every connection (a getsockopt each): a
# port with few connections (a data port) can look often; one with hundreds (the
# coordinator's) less, its per-connection budget being a backstop. Loopback moves
# about 2 GB/s: what arrives between two looks is what a cut comes late by.
CONNECTION_LOOK_S = 0.25
FEW_CONNECTIONS_LOOK_S = 0.05
# after a cut, what libzmq freed is handed back to the system at these delays (its
# I/O thread frees the pipe, and the receive loop drains the messages already queued)
TRIM_AFTER_CUT_S = (0.3, 1.5)
# after a cut for memory, the process rule waits this long before the next one (the
# memory of the last cut takes a while to leave the resident set)
MEMORY_CUT_PAUSE_S = 0.25
# After a cut, the complete messages libzmq had queued for that connection stay queued
# (and resident) until the application reads them: a socket not read meanwhile (a data
# port while its stage computes) would look quiet once the connection is gone, and the
# process rule would take the grown memory as its new baseline, so that a peer which
# reconnects and floods again is never cut. The baseline stays until the application
# has taken as many bytes as the cut connections held, or this long after the last cut
# (what was held may have been an unfinished message, freed by the cut and never read).
CUT_HOLD_S = 5.0
# the socket attribute the receive path finds its guard under
GUARD_ATTRIBUTE = "_zpipe_connection_guard"
# A ROUTER's cut connections, by routing id, that the guard remembers (the newest):
# their complete messages stay queued after the cut, and a reader that drops them
# unread (:meth:`ConnectionGuard.was_cut`) drains a flood's backlog many times faster
# than one that decodes and refuses each. A connection's first few routing ids are
# kept (one unless its descriptor was reused while its predecessor's were queued).
CUT_ROUTING_IDS = 4096
ROUTING_IDS_PER_CONNECTION = 4
_MONITOR_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED

T = TypeVar("T")
# each guard's monitor endpoint is its own, also after a socket is reopened
_monitor_numbers = itertools.count()


def _on_fd(fd: int, use: Callable[[pysocket.socket], T]) -> T:
    """Apply ``use`` to a Python socket over libzmq's descriptor ``fd``, without
    taking it over (detached after: libzmq still owns and closes it)."""
    sock = pysocket.socket(fileno=fd)
    try:
        return use(sock)
    finally:
        sock.detach()


def bytes_received(fd: int) -> int | None:
    """``tcpi_bytes_received`` of the TCP socket ``fd``; None if it cannot be read."""
    try:
        info = _on_fd(
            fd, lambda s: s.getsockopt(pysocket.IPPROTO_TCP, pysocket.TCP_INFO, TCP_INFO_LENGTH)
        )
    except (OSError, AttributeError):
        return None
    if len(info) < TCPI_BYTES_RECEIVED_OFFSET + 8:
        return None
    return int(struct.unpack_from("=Q", info, TCPI_BYTES_RECEIVED_OFFSET)[0])


def peer_of(fd: int) -> str:
    try:
        address = _on_fd(fd, lambda s: s.getpeername())
    except OSError:
        return "?"
    return f"{address[0]}:{address[1]}" if isinstance(address, tuple) else str(address)


def cut_connection(fd: int) -> bool:
    """Shut the TCP connection ``fd`` down both ways; libzmq then drops it."""
    try:
        _on_fd(fd, lambda s: s.shutdown(pysocket.SHUT_RDWR))
    except OSError:
        return False
    return True


def resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class _Connection:
    fd: int
    peer: str
    opened: float
    taken: int = 0  # wire bytes of the messages the application took from it
    taken_messages: int = 0  # and how many (the small-message rule's mean)
    received: int = 0  # tcpi_bytes_received when last looked at
    refused_messages: int = 0
    # a ROUTER's: the routing ids its messages came with (at most ROUTING_IDS_PER_CONNECTION)
    routing_ids: set[bytes] = field(default_factory=set)


class ConnectionGuard:
    """The guard of one listening zmq socket (a ROUTER or a PULL over TCP).

    ``start()`` inside the running event loop, before peers connect; ``stop()``
    before the socket closes. ``cuts``: the connections cut since start."""

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        budget: GuardBudget,
        *,
        label: str,
        connection_look_s: float = CONNECTION_LOOK_S,
    ) -> None:
        self._sock = sock
        self.budget = budget
        self._connection_look_s = connection_look_s
        self._label = label
        # a ROUTER's first frame is the routing id libzmq adds: not on the wire
        self._skip_first = sock.type == zmq.ROUTER
        self._wrapping = CURVE_FRAME_WRAPPING if sock.get(zmq.CURVE_SERVER) else 0
        self._connections: dict[int, _Connection] = {}
        self._monitor: zmq.Socket[Any] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._last_connection_look = 0.0
        self._memory_pause_until = 0.0
        # the process rule's baseline: the resident memory when no connection held
        # much, and the bytes all connections received since
        self._quiet_rss: int | None = None
        self._received_since_quiet = 0
        # wire bytes the cut connections held that the application has not taken since
        # (CUT_HOLD_S), and when that hold ends at the latest
        self._cut_unread = 0
        self._cut_hold_until = 0.0
        self.cuts: list[Cut] = []
        # the routing ids of a ROUTER's cut connections, oldest first (was_cut)
        self._cut_routing_ids: OrderedDict[bytes, None] = OrderedDict()
        self.enabled = sys.platform.startswith("linux")

    def start(self) -> None:
        if not self.enabled or self._monitor is not None:
            return
        endpoint = f"inproc://zpipe-guard-{os.getpid()}-{next(_monitor_numbers)}"
        self._sock.monitor(endpoint, _MONITOR_EVENTS)
        # a plain socket on the same context: drained without a future in the timer
        monitor: zmq.Socket[Any] = zmq.Context.shadow(self._sock.context.underlying).socket(
            zmq.PAIR
        )
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.connect(endpoint)
        self._monitor = monitor
        self._quiet_rss = resident_bytes()
        # the attribute the receive path reports taken messages to (sockets.recv_frames);
        # pyzmq's own __setattr__ would take it for a socket option
        object.__setattr__(self._sock, GUARD_ATTRIBUTE, self)
        self._schedule()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        self._sock.__dict__.pop(GUARD_ATTRIBUTE, None)

    # ------------------------------------------------------------ receive path

    def saw(self, got: list[zmq.Frame] | OverBounds) -> None:
        """Count a message the application took (or read and discarded) against the
        connection it came from."""
        if isinstance(got, OverBounds):
            first, wire = got.first, self._discarded_wire(got)
        else:
            if not got:
                return
            first = got[0]
            frames = got[1:] if self._skip_first else got
            wire = message_wire_bytes((len(f) for f in frames), self._wrapping)
        try:
            fd = int(first.get(zmq.SRCFD))
        except (zmq.ZMQError, AttributeError, TypeError, ValueError):
            return
        conn = self._connections.get(fd)
        if conn is None:  # accepted before the monitor's event was read
            conn = self._connections[fd] = _Connection(fd, peer_of(fd), time.monotonic())
        conn.taken += wire
        conn.taken_messages += 1
        if self._skip_first and len(conn.routing_ids) < ROUTING_IDS_PER_CONNECTION:
            conn.routing_ids.add(bytes(first.bytes if isinstance(first, zmq.Frame) else first))
        self._cut_unread = max(0, self._cut_unread - wire)
        if isinstance(got, OverBounds):
            conn.refused_messages += 1

    def was_cut(self, routing_id: bytes) -> bool:
        """Whether a ROUTER's message with ``routing_id`` came from a connection this
        guard cut (one of the last :data:`CUT_ROUTING_IDS`): what it still had queued
        may be dropped unread. libzmq gives each connection a routing id of its own
        (a peer that names itself cannot take one in use)."""
        return routing_id in self._cut_routing_ids

    def cut_backlog_bytes(self, now: float) -> int:
        """Wire bytes the connections cut in the last :data:`CUT_HOLD_S` held when cut
        and the application has not taken since (an estimate: every message taken
        counts against it): what they still have queued, unread."""
        return self._cut_unread if now < self._cut_hold_until else 0

    def _discarded_wire(self, refused: OverBounds) -> int:
        frames, nbytes = refused.frames, refused.nbytes
        if self._skip_first:  # the routing id was counted among them
            frames, nbytes = frames - 1, nbytes - len(refused.first)
        return discarded_wire_bytes(frames, nbytes, self._wrapping)

    # ------------------------------------------------------------ the timer

    def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        every = self._connection_look_s
        if self.budget.rss_growth_bytes is not None:
            every = min(every, RSS_LOOK_S)
        self._timer = loop.call_later(every, self._tick)

    def _tick(self) -> None:
        try:
            self.look(time.monotonic())
        except Exception:  # the guard must never stop the process serving
            log.exception("connection_guard_failed", port=self._label)
        if self._monitor is not None:
            self._schedule()

    def look(self, now: float) -> list[Cut]:
        """Read the monitor's events, and the connections when a rule is due; cut
        what the budget says. The cuts made."""
        self._read_events(now)
        growth_limit = self.budget.rss_growth_bytes
        rss = resident_bytes() if growth_limit is not None else None
        grown = (
            rss is not None
            and growth_limit is not None
            and self._quiet_rss is not None
            and rss - self._quiet_rss > growth_limit
            and now >= self._memory_pause_until
        )
        if not grown and now - self._last_connection_look < self._connection_look_s:
            return []
        self._last_connection_look = now
        holdings = self._holdings(now)
        memory = None
        if rss is not None:
            if quiet(holdings, self.budget) and not self._holding_cut_messages(now):
                self._quiet_rss, self._received_since_quiet = rss, 0
            elif grown and self._quiet_rss is not None:
                memory = MemoryGrowth(rss - self._quiet_rss, self._received_since_quiet)
        cuts = connections_to_cut(holdings, self.budget, memory)
        for cut in cuts:
            self._cut(cut, rss)
            if cut.reason == "memory":
                self._memory_pause_until = now + MEMORY_CUT_PAUSE_S
        return cuts

    def _holding_cut_messages(self, now: float) -> bool:
        """Whether messages of cut connections may still be queued unread (CUT_HOLD_S)."""
        if now >= self._cut_hold_until:
            self._cut_unread = 0
        return self._cut_unread >= self.budget.min_held_to_cut

    def _holdings(self, now: float) -> list[ConnectionHolding]:
        out = []
        for conn in list(self._connections.values()):
            received = bytes_received(conn.fd)
            if received is None:
                continue
            self._received_since_quiet += max(0, received - conn.received)
            conn.received = received
            held = max(0, received - conn.taken - self.budget.slack(now - conn.opened))
            out.append(
                ConnectionHolding(
                    conn.fd, conn.peer, held, conn.refused_messages, conn.taken,
                    conn.taken_messages,
                )
            )  # fmt: skip
        return out

    def _cut(self, cut: Cut, rss: int | None) -> None:
        if not cut_connection(cut.fd):
            return
        self.cuts.append(cut)
        conn = self._connections.get(cut.fd)
        for routing_id in conn.routing_ids if conn is not None else ():
            self._cut_routing_ids[routing_id] = None
        while len(self._cut_routing_ids) > CUT_ROUTING_IDS:
            self._cut_routing_ids.popitem(last=False)
        self._cut_unread += cut.held
        self._cut_hold_until = time.monotonic() + CUT_HOLD_S
        # peer=: the flood limit keeps a few lines per address (zpipe.log_limits)
        log.warning(
            "connection_cut",
            peer=cut.peer,
            port=self._label,
            reason=cut.reason,
            held_bytes=cut.held,
            budget_bytes=self.budget.per_connection_bytes,
            rss_bytes=rss,
            rss_quiet_bytes=self._quiet_rss,
            detail="a peer's unfinished or unread messages passed the port's memory budget",
        )
        loop = asyncio.get_running_loop()
        for delay in TRIM_AFTER_CUT_S:
            loop.call_later(delay, trim_heap)

    def _read_events(self, now: float) -> None:
        monitor = self._monitor
        if monitor is None:
            return
        while True:
            try:
                parts = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(parts) < 2 or len(parts[0]) < 6:
                continue
            event, fd = struct.unpack("=hi", parts[0][:6])
            if event == zmq.EVENT_ACCEPTED:
                # setdefault: a message of it may have been counted already (saw)
                self._connections.setdefault(fd, _Connection(fd, peer_of(fd), now))
            else:
                self._connections.pop(fd, None)
