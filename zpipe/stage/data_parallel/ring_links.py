"""The two sockets of one ring all-reduce rank: a PUSH to the next rank, a PULL from the
previous one, each message checked as it arrives.

:class:`~zpipe.stage.data_parallel.ring_allreduce.RingAllReduce` decides what moves
in which step; this module moves it: it opens the links (CurveZMQ when the group has
keys, the previous rank's key alone allowed in), sends one segment with its deadline
and pacing, and receives the one message a step expects, parsed into its protocol
class and checked by :func:`zpipe.training.ring.check_message`. Stale messages (an
older epoch or round) are dropped quietly, others that do not fit are logged and
dropped, and the deadline of the expected message never grows with them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import zmq
import zmq.asyncio

from zpipe._errors import ProtocolError, TransportTimeout
from zpipe.log import get_logger
from zpipe.protocol import REGISTRY
from zpipe.protocol.data_plane import AllReduce
from zpipe.training.ring import KIND, ExpectedMessage, RingStep, check_message
from zpipe.transport import security
from zpipe.transport.sockets import (
    SocketOptions,
    bind_endpoint,
    decode_frames,
    open_socket,
    recv_frames,
    send,
)

log = get_logger("zpipe.allreduce")


@dataclass
class RingCounters:
    """What one round moved and dropped, for its :class:`~zpipe.training.ring.AllReduceStats`."""

    bytes_sent: int = 0
    stale: int = 0
    rejected: int = 0


class RingLinks:
    """One rank's links in the ring: ``start`` opens them, ``close`` closes them."""

    def __init__(
        self,
        *,
        context: zmq.asyncio.Context,
        name: str,
        rank: int,
        endpoints: Sequence[str],
        bind: str,
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
        self._own_authenticator: security.CurveAuthenticator | None = None
        self._added_key: bytes | None = None
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
        """Bind the receive socket and connect to the next rank (without waiting)."""
        if self._pull is not None:
            return
        pull = open_socket(self.context, zmq.PULL, self.options)
        push = open_socket(self.context, zmq.PUSH, self.options)
        self._pull, self._push = pull, push
        if self.keypair is not None:
            assert self.peer_keys is not None
            prev_key = self.peer_keys[self.prev]
            if self._authenticator is None:
                allow = security.PeerAllowList({self.prev_label: prev_key})
                self._own_authenticator = security.CurveAuthenticator(self.context, allow)
                self._own_authenticator.start()
            elif prev_key not in self._authenticator.allow_list:
                self._authenticator.allow_list.allow(prev_key, self.prev_label)
                self._added_key = prev_key
            security.secure_server(pull, self.keypair)
            security.secure_client(push, self.keypair, self.peer_keys[self.next])
        self.bound_endpoint = bind_endpoint(pull, self.bind)
        push.connect(self.endpoints[self.next])

    def close(self, *, linger_s: float) -> None:
        """Close the sockets (the send socket lingers ``linger_s`` to deliver the last
        round's messages); safe to call twice."""
        if self._push is not None:
            self._push.close(linger=max(0, int(linger_s * 1000)))
        if self._pull is not None:
            self._pull.close(linger=0)
        self._push = self._pull = None
        if self._own_authenticator is not None:
            self._own_authenticator.stop()
            self._own_authenticator = None
        if self._added_key is not None and self._authenticator is not None:
            self._authenticator.allow_list.discard(self._added_key)
            self._added_key = None

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
                message = REGISTRY.parse(decode_frames(frames, self.options.max_message_bytes))
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
