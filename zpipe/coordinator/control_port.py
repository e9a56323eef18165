"""The coordinator's control port: its listening socket and what it admits.

One ROUTER socket serves stages and clients alike. This module opens it with its
limits (the largest frame, no receive high-water mark, routing-id handover), with
--keys its CurveZMQ keys, allow-list and key roles, and the guard that cuts a
connection holding too much. Its receive loop admits each message (the peer's rate
limit, its key's role), parses it into its protocol class once and hands it on as an
event (:mod:`zpipe.coordinator.events`); what the event means is the coordinator's
(:mod:`zpipe.coordinator.server`). One bad message, or a bug it triggers, is logged
with its peer and dropped: the receive loop never dies of it.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Protocol

import zmq
import zmq.asyncio

from zpipe._errors import ProtocolError, RoleError
from zpipe.coordinator.events import Event, event_of
from zpipe.coordinator.registration import printable
from zpipe.log import get_logger
from zpipe.transport import security
from zpipe.transport.codec import decode_typed
from zpipe.transport.conn_budget import control_port_budget
from zpipe.transport.conn_guard import ConnectionGuard
from zpipe.transport.ratelimit import PeerRateLimiter
from zpipe.transport.roles import KeyRoles
from zpipe.transport.sockets import (
    CURVE_FRAME_OVERHEAD,
    ReceiveLimits,
    SocketOptions,
    bind_endpoint,
    new_context,
    open_socket,
    recv_frames,
)

# the coordinator's logger: the port's lines are the coordinator's
log = get_logger("zpipe.coordinator")

# The receive loop gives the event loop a turn after this many messages in a row.
# zmq.asyncio hands back a message already queued without suspending, so a burst
# (300 stages registering at once, their repeats, a heartbeat round after a pause)
# otherwise held the loop for all of it: timers, ticks and pending sends waited
# 0.37 s behind 300 registrations (1.1 s under load).
RECEIVE_TURN_EVERY = 8

# The largest frame the ROUTER takes (its MAXMSGSIZE; libzmq drops the connection of
# a peer that announces a larger one before allocating it). Bulk state travels in
# chunks of at most 16 MiB (zpipe.transport.bulk.MAX_CHUNK_BYTES), but tensors still
# arrive whole on control connections: a stage's state resent there when a restarted
# coordinator refused its bulk transfer, and an EdgePipe client's layer matrices and
# input batches in lossy_run_request. One tensor of a model zpipe ships is at most
# gpt2-small's token embedding, 147 MiB (50257 x 768 float32); 256 MiB leaves room
# for that and an MNIST-sized float64 input block. It was the 2 GiB of every socket:
# 8 connections each part-way through a 2 GiB frame held 1.8 GB (issue 33, finding
# 7); a connection now holds at most this much of an unfinished frame. Raise it
# (CoordinatorConfig.max_frame_bytes) for a model with a larger single tensor.
COORDINATOR_MAX_FRAME_BYTES = 256 << 20

# The ROUTER's RCVHWM: none (0). libzmq 4.3.5 aborts the whole process (SIGABRT,
# "Assertion failed: !_io_error (src/stream_engine_base.cpp:310)") when a connection
# whose input it stopped at the high-water mark breaks (the peer went: a killed stage, a
# stage whose ZMTP heartbeats gave up on a paused coordinator), and the application then
# reads that connection's queue: restarting its input decodes what was left of the last
# read, and a ZMTP PING there (stages and clients send one a second) is answered on the
# broken connection. 16 heartbeats unread (5 s of a stopped or starved coordinator at
# 0.3 s intervals) were enough; any peer could also do it at will. Without a high-water
# mark a connection's input is never stopped. The mark bounded little (16 messages of
# up to max_frame_bytes each, and a million frames a message): what a connection may
# queue has to be bounded by its bytes, and cutting such a connection is safe only
# when its input was never stopped.
COORDINATOR_RECV_HWM = 0


class OnEvent(Protocol):
    """What the port hands each admitted message to: its event, and the peer's
    routing id (the coordinator's ``_feed``)."""

    def __call__(self, event: Event, *, peer: bytes) -> None: ...


class ControlPort:
    """The coordinator's ROUTER socket: opened by :meth:`open`, its connections
    guarded from :meth:`start_guard`, read by :meth:`receive_loop`, closed (with the
    zmq context, which it owns) by :meth:`close`.

    ``public_keys`` is filled with the cluster's keys when it opens with a keys
    directory (the coordinator's state and link measurer share the dict)."""

    def __init__(
        self,
        *,
        options: SocketOptions,
        max_frame_bytes: int,
        keys_dir: Path | None,
        public_keys: dict[str, bytes],
        on_event: OnEvent,
    ) -> None:
        self._options = options
        self._max_frame_bytes = max_frame_bytes
        self._keys_dir = keys_dir
        self._public_keys = public_keys
        self._on_event = on_event
        self.context = new_context()
        self.router: zmq.asyncio.Socket | None = None
        self._guard: ConnectionGuard | None = None
        self._authenticator: security.CurveAuthenticator | None = None
        # With --keys: what each key's role lets it send (roles.txt; a key it does not
        # list may send nothing; without the file, each key's name implies its role).
        self._roles: KeyRoles | None = None
        # Per-peer token buckets (by CURVE key, else by connection), as at a stage's
        # probe port: a flooding peer's excess is dropped before it is decoded.
        self.limiter = PeerRateLimiter()

    def open(self, bind: str) -> str:
        """Open the ROUTER (with --keys, its CurveZMQ security) and bind it to
        ``bind``; the endpoint it bound."""
        keys_dir = self._keys_dir
        opts = self._options
        # CURVE wraps each frame in 33 bytes more, and libzmq checks the wrapped size
        frame_limit = min(self._max_frame_bytes, opts.max_message_bytes)
        limits = ReceiveLimits(frame_limit + CURVE_FRAME_OVERHEAD, opts.recv_hwm)
        router = open_socket(self.context, zmq.ROUTER, opts, limits=limits)
        self.router = router
        router.setsockopt(zmq.RCVHWM, COORDINATOR_RECV_HWM)  # before the bind
        # A peer that reconnects (its ZMTP heartbeats dropped the connection to a paused or
        # cut-off coordinator) takes over its routing id at once; without this, the new
        # connection stays unread while the stale one is not yet torn down (seen: 30 s).
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if keys_dir is not None:
            keypair = security.load_keypair(keys_dir, "coordinator")
            self._public_keys.update(security.load_public_keys(keys_dir))
            self._roles = KeyRoles.from_dir(keys_dir)
            if self._roles.without_role():
                log.warning(
                    "keys_without_role",
                    keys=self._roles.without_role(),
                    detail="roles.txt does not list these keys: they may send nothing",
                    fix="add 'NAME ROLE' lines, or python -m zpipe keys --role ROLE NAME",
                )
            allow = security.PeerAllowList()
            allow.replace(key for name, key in self._public_keys.items() if name != "coordinator")
            self._authenticator = security.CurveAuthenticator(self.context, allow)
            self._authenticator.start()
            security.secure_server(router, keypair)
        else:
            security.warn_open_cluster(log, "coordinator")
        endpoint = bind_endpoint(router, bind)
        # what each connection makes libzmq hold, cut past its budget (issue 33)
        self._guard = ConnectionGuard(router, control_port_budget(frame_limit), label="coordinator")
        return endpoint

    def start_guard(self) -> None:
        """Start watching the connections (inside the running loop, before peers come)."""
        if self._guard is not None:
            self._guard.start()

    def close(self) -> None:
        if self._guard is not None:
            self._guard.stop()
        if self.router is not None:
            self.router.close(linger=0)
        if self._authenticator is not None:
            self._authenticator.stop()
        self.context.term()

    async def receive_loop(self) -> None:
        assert self.router is not None
        max_bytes = self._options.max_message_bytes
        # only a CURVE socket's messages carry a key (asking an open one raises, at a
        # cost per message that showed in a profile of 300 stages' heartbeats)
        secure = self._authenticator is not None
        received = 0
        while True:
            received += 1
            if received % RECEIVE_TURN_EVERY == 0:
                await asyncio.sleep(0)  # the others' turn: see RECEIVE_TURN_EVERY
            frames = await recv_frames(
                self.router, timeout_s=None, peer="any", awaited="control message"
            )
            if len(frames) < 2:
                log.warning("dropped_message", error="no routing id or header")
                continue
            routing_id = frames[0].bytes
            if not self._within_rate(routing_id, frames[1], secure):
                continue
            try:
                user_key = _curve_user_id(frames[1]) if secure else None
                # parsed once, its body checked once: past this point everything sees
                # protocol classes
                typed = decode_typed(frames[1:], max_message_bytes=max_bytes)
                self._check_role(typed.KIND, user_key)
                self._on_event(event_of(routing_id, user_key, typed), peer=routing_id)
            except ProtocolError as exc:
                log.warning("dropped_message", peer=printable(routing_id), error=str(exc))
            except RoleError as exc:
                log.warning("role_refused", peer=printable(routing_id), error=str(exc))
            except Exception as exc:  # one message must never end the loop
                log.error(
                    "message_failed", peer=printable(routing_id), error=repr(exc), exc_info=True
                )

    def _within_rate(self, routing_id: bytes, first: zmq.Frame, secure: bool) -> bool:
        """The peer's rate limit, by its CURVE key (new connections give a flooder no
        new buckets), else by connection; a report of the excess every few seconds."""
        peer = (security.sender_public_key(first) if secure else None) or routing_id
        now = time.monotonic()
        if self.limiter.allow(peer, now):
            return True
        report = self.limiter.report_due(now)
        if report is not None:
            log.warning(
                "coordinator_flood_dropped",
                dropped=report.dropped,
                over_s=round(report.over_s, 3),
                worst_peer=printable(report.worst_peer),
                worst_dropped=report.worst_dropped,
                dropped_total=self.limiter.dropped_total,
            )
        return False

    def _check_role(self, kind: str, user_key: str | None) -> None:
        """Raise RoleError when the sender's key may not send ``kind`` (a stage key
        starting a run, a client key registering as a stage)."""
        if self._roles is None or user_key is None:
            return  # an open cluster: no keys, no roles
        self._roles.check(kind, user_key)


def _curve_user_id(frame: zmq.Frame) -> str | None:
    """The CURVE public key the authenticator saw for this message, if any."""
    key = security.sender_public_key(frame)
    return key.decode() if key is not None else None
