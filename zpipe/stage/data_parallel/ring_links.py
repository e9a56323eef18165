"""The two sockets of one ring all-reduce rank: a PUSH to the next rank, a PULL from the
previous one, each message checked as it arrives.

:class:`~zpipe.stage.data_parallel.ring_allreduce.RingAllReduce` decides what moves
in which step; this module moves it: it opens the links (CurveZMQ when the group has
keys, the previous rank's key alone allowed in), sends one segment with its deadline
and pacing, and receives the one message a step expects, parsed into its protocol
class and checked by :func:`zpipe.training.ring.check_message`. Stale messages (an
older epoch or round) are dropped quietly, others that do not fit are logged and
dropped, and the deadline of the expected message never grows with them.

The receive side can be opened ahead of the links (:class:`RingPort`): a stage binds
it (port 0: any free one) when it is assigned and reports the port it holds, so no
other socket can take the port between the report and the bind, as one bound to
port 0 could take a port that was picked, closed and bound later.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import zmq
import zmq.asyncio

from zpipe._errors import ConfigError, ProtocolError, TransportTimeout
from zpipe.log import get_logger
from zpipe.protocol.data_plane import AllReduce
from zpipe.training.ring import KIND, ExpectedMessage, RingStep, check_message
from zpipe.transport import security
from zpipe.transport.codec import decode_typed
from zpipe.transport.sockets import (
    SocketOptions,
    bind_endpoint,
    open_socket,
    recv_frames,
    send,
)

log = get_logger("zpipe.allreduce")

# The ZAP domain of the ring's receive sockets, with an allow-list of its own: the
# data port's allow-list is replaced by each assignment (after the ring port is
# bound), which must not take the previous rank's key away.
RING_DOMAIN = "zpipe-ring"


def ring_allow_list(authenticator: security.CurveAuthenticator) -> security.PeerAllowList:
    """The allow-list of ``authenticator``'s ring domain, added on first use."""
    try:
        return authenticator.allow_list_of(RING_DOMAIN)
    except KeyError:
        allow = security.PeerAllowList()
        authenticator.add_domain(RING_DOMAIN, allow)
        return allow


class RingPort:
    """One rank's receive socket, bound as soon as it is made (``bind`` may name port 0).

    With ``keypair`` it is a CURVE server that admits ``prev_key`` alone, allowed
    before the bind: the previous rank connects as soon as it is told where, and
    libzmq never retries a refused handshake. ``authenticator`` is the context's one
    authenticator (the key goes to its ring domain's allow-list, and out again on
    :meth:`close`); without one, the port runs its own on ``context``.
    """

    def __init__(
        self,
        *,
        context: zmq.asyncio.Context,
        bind: str,
        options: SocketOptions,
        keypair: security.KeyPair | None = None,
        prev_key: bytes | None = None,
        prev_label: str = "the previous rank",
        authenticator: security.CurveAuthenticator | None = None,
    ) -> None:
        if keypair is not None and not prev_key:
            raise ConfigError(f"a secured ring port needs the public key of {prev_label}")
        self.prev_key = prev_key if keypair is not None else None
        self._authenticator = authenticator
        self._own_authenticator: security.CurveAuthenticator | None = None
        self._added_key: bytes | None = None
        self._pull: zmq.asyncio.Socket | None = open_socket(context, zmq.PULL, options)
        try:
            if keypair is not None:
                assert prev_key is not None
                if authenticator is None:
                    allow = security.PeerAllowList({prev_label: prev_key})
                    self._own_authenticator = security.CurveAuthenticator(context, allow)
                    self._own_authenticator.start()
                    security.secure_server(self._pull, keypair)
                else:
                    allow = ring_allow_list(authenticator)
                    if prev_key not in allow:
                        allow.allow(prev_key, prev_label)
                        self._added_key = prev_key
                    security.secure_server(self._pull, keypair, domain=RING_DOMAIN)
            self.bound_endpoint = bind_endpoint(self._pull, bind)
        except BaseException:
            self.close()
            raise

    @property
    def port(self) -> int:
        """The TCP port this rank holds."""
        return int(self.bound_endpoint.rsplit(":", 1)[1])

    @property
    def socket(self) -> zmq.asyncio.Socket | None:
        """The bound socket; None once closed."""
        return self._pull

    def close(self) -> None:
        """Close the socket and take the key back out of the allow-list; safe twice."""
        if self._pull is not None:
            self._pull.close(linger=0)
            self._pull = None
        if self._own_authenticator is not None:
            self._own_authenticator.stop()
            self._own_authenticator = None
        if self._added_key is not None and self._authenticator is not None:
            ring_allow_list(self._authenticator).discard(self._added_key)
            self._added_key = None


@dataclass
class RingCounters:
    """What one round moved and dropped, for its :class:`~zpipe.training.ring.AllReduceStats`."""

    bytes_sent: int = 0
    stale: int = 0
    rejected: int = 0


class RingLinks:
    """One rank's links in the ring: ``start`` opens them, ``close`` closes them.

    ``port``: the receive socket bound ahead (:class:`RingPort`), which the links then
    own; without one, ``start`` binds ``bind``."""

    def __init__(
        self,
        *,
        context: zmq.asyncio.Context,
        name: str,
        rank: int,
        endpoints: Sequence[str],
        bind: str,
        port: RingPort | None = None,
        options: SocketOptions,
        keypair: security.KeyPair | None,
        peer_keys: Sequence[bytes] | None,
        authenticator: security.CurveAuthenticator | None,
        epoch: int,
        pace: Callable[[int], Awaitable[None]] | None,
    ) -> None:
        n = len(endpoints)
        self.context = context
        self.name = name
        self.rank = rank
        self.endpoints = list(endpoints)
        self.bind = bind
        self.options = options
        self.keypair = keypair
        self.peer_keys = list(peer_keys) if peer_keys is not None else None
        self.epoch = epoch
        self.prev = (rank - 1) % n
        self.next = (rank + 1) % n
        # awaited with each segment's size before it is sent: an emulated link's pacing
        self._pace = pace
        self.bound_endpoint = ""
        self._authenticator = authenticator
        self._port = port
        self._pull: zmq.asyncio.Socket | None = None
        self._push: zmq.asyncio.Socket | None = None
        self.prev_label = self.peer_label(self.prev)
        self.next_label = self.peer_label(self.next)

    def peer_label(self, rank: int) -> str:
        """How errors and log lines name a peer: its rank and endpoint."""
        return f"rank {rank} of {self.name!r} at {self.endpoints[rank]}"

    @property
    def open(self) -> bool:
        return self._pull is not None and self._push is not None

    def start(self) -> None:
        """Bind the receive socket (unless bound ahead) and connect to the next rank,
        without waiting."""
        if self._pull is not None:
            return
        prev_key = self.peer_keys[self.prev] if self.peer_keys is not None else None
        if self._port is None:
            self._port = RingPort(
                context=self.context,
                bind=self.bind,
                options=self.options,
                keypair=self.keypair,
                prev_key=prev_key,
                prev_label=self.prev_label,
                authenticator=self._authenticator,
            )
        elif self._port.prev_key != (prev_key if self.keypair is not None else None):
            # the port admits whom the assignment named; the ring names another now
            self._port.close()
            raise ProtocolError(
                f"the ring port of rank {self.rank} of {self.name!r} admits another key "
                f"than the one of {self.prev_label}"
            )
        self._pull = self._port.socket
        if self._pull is None:
            raise ProtocolError(f"the ring port of rank {self.rank} of {self.name!r} was closed")
        push = open_socket(self.context, zmq.PUSH, self.options)
        self._push = push
        if self.keypair is not None:
            assert self.peer_keys is not None
            security.secure_client(push, self.keypair, self.peer_keys[self.next])
        self.bound_endpoint = self._port.bound_endpoint
        push.connect(self.endpoints[self.next])

    def close(self, *, linger_s: float) -> None:
        """Close the sockets (the send socket lingers ``linger_s`` to deliver the last
        round's messages); safe to call twice."""
        if self._push is not None:
            self._push.close(linger=max(0, int(linger_s * 1000)))
        if self._port is not None:
            self._port.close()  # the receive socket, and its key out of the allow-list
        self._push = self._pull = None

    async def send_segment(
        self,
        step: RingStep,
        seg: int,
        tensors: tuple[torch.Tensor, ...],
        round_id: int,
        timeout: float,
    ) -> int:
        """Send one segment to the next rank; its tensor bytes."""
        assert self._push is not None
        message = AllReduce(
            round=round_id,
            step=step.step,
            chunk=step.send_chunk,
            seg=seg,
            src=self.rank,
            epoch=self.epoch,
            tensors=tensors,
        ).to_message()
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if self._pace is not None:
            await self._pace(nbytes)
        try:
            await send(self._push, message, timeout_s=timeout, peer=self.next_label)
        except TransportTimeout:
            raise TransportTimeout(
                self.next_label,
                f"room to send all-reduce round {round_id} step {step.step} ({step.phase}) "
                f"chunk {step.send_chunk} segment {seg}",
                timeout,
            ) from None
        return nbytes

    async def receive(
        self, expected: ExpectedMessage, phase: str, timeout: float, counters: RingCounters
    ) -> AllReduce:
        """The message ``expected`` describes, from the previous rank, within ``timeout``."""
        assert self._pull is not None
        loop = asyncio.get_running_loop()
        # One deadline per expected message: dropped messages do not extend it, so a
        # stream of stale or forged messages cannot keep a rank waiting forever.
        deadline = loop.time() + timeout
        peer = self.prev_label
        last_rejection = ""
        while True:
            remaining = deadline - loop.time()
            frames = None
            if remaining > 0:
                try:
                    frames = await recv_frames(
                        self._pull, timeout_s=remaining, peer=peer, awaited=KIND
                    )
                except TransportTimeout:
                    pass
            if frames is None:
                awaited = (
                    f"all-reduce round {expected.round_id} step {expected.step} ({phase}) "
                    f"chunk {expected.chunk} segment {expected.seg}"
                )
                if last_rejection:
                    awaited += (
                        f" ({counters.rejected} bad messages dropped, last: {last_rejection})"
                    )
                raise TransportTimeout(peer, awaited, timeout)
            try:
                self._check_sender_key(frames[0], peer)
                message = decode_typed(frames, max_message_bytes=self.options.max_message_bytes)
                if check_message(message, expected, peer=peer):
                    assert isinstance(message, AllReduce)  # what check_message accepts
                    return message
                counters.stale += 1
                log.debug(
                    "allreduce_stale_dropped",
                    group=self.name,
                    rank=self.rank,
                    peer=peer,
                    epoch=message.epoch,
                    round=message.round if isinstance(message, AllReduce) else None,
                    current_round=expected.round_id,
                )
            except ProtocolError as exc:
                counters.rejected += 1
                last_rejection = str(exc)
                log.warning(
                    "allreduce_message_rejected",
                    group=self.name,
                    rank=self.rank,
                    peer=peer,
                    round=expected.round_id,
                    error=last_rejection,
                )

    def _check_sender_key(self, frame: Any, peer: str) -> None:
        if self.peer_keys is None:
            return
        key = security.sender_public_key(frame)
        if key != self.peer_keys[self.prev]:
            shown = security.key_prefix(key) + "..." if key else "no CURVE key"
            raise ProtocolError(f"allreduce message for {peer} came from another key ({shown})")
