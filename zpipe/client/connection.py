"""What an open client holds: its zmq context, control channel, sink and keys.

:class:`ClientConnection` is what runs use (the handshake of a session, the
sockets a stream or a training run sends on); :class:`~zpipe.client.PipelineClient`
opens and closes it.

The sink changes its receive limits as a stage's data port does: it closes its
socket and binds a fresh one to the same port (:mod:`zpipe.transport.reopen`;
re-binding one socket while a peer sent crashed libzmq). So :attr:`ClientConnection.sink`
is a different object after :meth:`ClientConnection.limit_sink` reopened it: a run
reads it through :meth:`ClientConnection.reading_sink`, which also keeps a reopen
from closing a socket a receive is waiting on.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

import zmq
import zmq.asyncio

from zpipe._errors import PipelineError, ProtocolError, TransportTimeout
from zpipe.client.control import ControlChannel
from zpipe.config import Timeouts
from zpipe.log import get_logger
from zpipe.protocol import WireMessage
from zpipe.protocol.client_control import RunEnd, RunReport
from zpipe.transport import security
from zpipe.transport.codec import Message, decode_typed
from zpipe.transport.reopen import bind_when_free, open_listener
from zpipe.transport.sockets import (
    ReceiveLimits,
    SocketOptions,
    advertised_endpoint,
    bind_endpoint,
    check_resolvable,
    decode_frames,
    new_context,
    open_socket,
)

log = get_logger("zpipe.client")

CLIENT_NAME = "client"
# how long a close waits for the report of a run it ends (see close)
_END_WAIT_S = 2.0
_warned_open = [False]


class ClientConnection:
    """An open client's sockets: the control channel, the sink (a PULL every run's last
    stage sends to) and, with keys, the keypair and the sink's allow-list."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        control: ControlChannel,
        sink: zmq.asyncio.Socket,
        sink_endpoint: str,
        *,
        timeouts: Timeouts,
        options: SocketOptions,
        keypair: security.KeyPair | None = None,
        sink_allow: security.PeerAllowList | None = None,
        authenticator: security.CurveAuthenticator | None = None,
        sink_bound: str = "",
    ) -> None:
        self.context = context
        self.control = control
        self.sink = sink
        self.sink_endpoint = sink_endpoint
        self.timeouts = timeouts
        self.options = options
        self.keypair = keypair
        self.sink_allow = sink_allow
        self.authenticator = authenticator
        # what the sink is bound to (port resolved; "": never reopened) and its limits
        # (None: a reopen did not finish, so the next limit_sink reopens whatever)
        self._sink_bound = sink_bound
        self.sink_fallback = ReceiveLimits(options.max_message_bytes, options.recv_hwm)
        self._sink_limits: ReceiveLimits | None = self.sink_fallback
        # receive loops on the sink now (reading_sink), and one reopen at a time
        self._sink_readers = 0
        self._sink_reopening = asyncio.Lock()
        # the run this client started and has not ended (RunSession), ended at close
        self.open_run: int | None = None

    @classmethod
    def open(
        cls,
        coordinator: str,
        *,
        keys_dir: Path | None,
        key_name: str,
        sink_bind: str,
        advertise_host: str | None,
        timeouts: Timeouts,
        options: SocketOptions,
    ) -> ClientConnection:
        # before any socket: a name that does not resolve would look like silence
        check_resolvable(coordinator, flag="the coordinator endpoint")
        context = new_context()
        dealer = open_socket(context, zmq.DEALER, options)
        dealer.setsockopt(zmq.ROUTING_ID, f"{CLIENT_NAME}-{uuid.uuid4().hex[:12]}".encode())
        sink = open_socket(context, zmq.PULL, options)
        keypair = sink_allow = authenticator = None
        if keys_dir is not None:
            keypair = security.load_keypair(keys_dir, key_name)
            coordinator_key = security.load_keypair_public(keys_dir, "coordinator")
            security.secure_client(dealer, keypair, coordinator_key)
            sink_allow = security.PeerAllowList()
            authenticator = security.CurveAuthenticator(context, sink_allow)
            authenticator.start()
            security.secure_server(sink, keypair)
        elif not _warned_open[0]:
            # Once per process: an embedding program opens many clients.
            _warned_open[0] = True
            security.warn_open_cluster(log, "client")
        bound = bind_endpoint(sink, sink_bind)
        sink_endpoint = advertised_endpoint(
            bound, advertise_host=advertise_host, toward=coordinator
        )
        # the channel watches the connection before it is made: it sees its handshake
        control = ControlChannel(dealer, options, timeouts)
        dealer.connect(coordinator)
        return cls(
            context,
            control,
            sink,
            sink_endpoint,
            timeouts=timeouts,
            options=options,
            keypair=keypair,
            sink_allow=sink_allow,
            authenticator=authenticator,
            sink_bound=bound,
        )

    async def close(self) -> None:
        if self.open_run is not None:
            # A run this client leaves (an error, an interrupt) would hold the
            # coordinator, which refuses other clients' runs while one is in flight:
            # ended now. Its report is awaited briefly (it comes in milliseconds while
            # the stages answer), so that a run this process starts next, on another
            # connection, cannot reach the coordinator before this end does.
            try:
                await self.control.ask(
                    RunEnd(run=self.open_run),
                    expect=(RunReport,),
                    timeout_s=min(_END_WAIT_S, self.timeouts.reply_s),
                    awaited=f"the end of run {self.open_run}",
                )
            except TransportTimeout as exc:  # gone, or stages slow to report: it goes on
                log.warning("run_not_ended", run=self.open_run, error=str(exc))
            self.open_run = None
        await self.control.close()
        self.sink.close(linger=0)
        if self.authenticator is not None:
            self.authenticator.stop()
        # A socket still open here belongs to a run the caller left by raising
        # inside its stream: the stream's async generator, which owns its PUSH, is
        # closed only at the loop's shutdown, after this, and term() would wait for
        # it for ever. What such a socket still queues belongs to that abandoned
        # run: closed unsent.
        self.context.destroy(linger=0)

    def push_to(self, endpoint: str, key: object, peer: str) -> zmq.asyncio.Socket:
        """A PUSH connected to ``peer``'s data endpoint; with keys, it must be ``key``."""
        sock = open_socket(self.context, zmq.PUSH, self.options)
        if self.keypair is not None:
            if not key:
                sock.close(linger=0)
                raise PipelineError(f"the coordinator sent no key for {peer} ({endpoint})")
            security.secure_client(sock, self.keypair, str(key).encode())
        sock.connect(endpoint)
        return sock

    async def limit_sink(self, limits: ReceiveLimits) -> None:
        """Give the sink ``limits`` (libzmq fixes them when a socket binds): unless it
        has them already, close it and bind a fresh one to the same port, with the
        same CURVE server keys (the allow-list lives in the context's authenticator,
        so it carries over). Called between ``run_ready`` and ``go``, before the run's
        sink loop starts; its last stages connect once it goes. What the old socket
        had queued is dropped (an earlier run's leftovers)."""
        async with self._sink_reopening:
            if not self._sink_bound or limits == self._sink_limits:
                return
            if self._sink_readers:
                # another run of this client receives on the sink now: closing it would
                # cancel that run's receive (run one stream at a time per client)
                raise PipelineError(
                    "the client's sink cannot take this run's receive limits while another "
                    "run of the same client is receiving on it"
                )
            self._sink_limits = None
            self.sink.close(linger=0)
            fresh = open_listener(self.context, self.options, limits, self.keypair)
            # never a closed sink, even if the bind fails (the run fails; the next
            # limit_sink reopens again, since the limits are unknown)
            self.sink = fresh
            await bind_when_free(fresh, self._sink_bound)
            self._sink_limits = limits

    @contextlib.contextmanager
    def reading_sink(self) -> Iterator[zmq.asyncio.Socket]:
        """The sink, for a receive loop that runs inside the ``with``: no reopen
        closes it meanwhile (:meth:`limit_sink` refuses)."""
        self._sink_readers += 1
        try:
            yield self.sink
        finally:
            self._sink_readers -= 1

    def allow_sink_senders(self, keys: Iterable[object]) -> None:
        """With keys: only these public keys (the run's last stages) may send to the sink."""
        if self.sink_allow is not None:
            self.sink_allow.replace([str(k).encode() for k in keys if k])

    def decode_sink_message(self, frames: Sequence[zmq.Frame]) -> Message:
        """A message that reached the sink, decoded; with keys, only from an allowed peer
        (CURVE checks keys at the handshake only, so each message is checked again)."""
        self._check_sink_sender(frames)
        return decode_frames(frames, self.options.max_message_bytes)

    def decode_sink_typed(self, frames: Sequence[zmq.Frame]) -> WireMessage:
        """:meth:`decode_sink_message` as its protocol class, the body checked once
        (the runs' sink loops read typed fields)."""
        self._check_sink_sender(frames)
        return decode_typed(frames, max_message_bytes=self.options.max_message_bytes)

    def _check_sink_sender(self, frames: Sequence[zmq.Frame]) -> None:
        if self.sink_allow is not None:
            key = security.sender_public_key(frames[0])
            if key is None or key not in self.sink_allow:
                raise ProtocolError("a message from a peer that is not an assigned last stage")


class ConnectedClient(Protocol):
    """Anything that holds an open connection (a :class:`PipelineClient`)."""

    @property
    def connection(self) -> ClientConnection: ...
