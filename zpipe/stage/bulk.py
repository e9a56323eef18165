"""A stage's bulk connection to its coordinator: state out in chunks, assignments in.

The stage's control connection carries heartbeats and probes and nothing big;
this one carries its weights and backups to the coordinator, and assignments
with tensors from it, each as a stream of ``bulk_chunk`` messages
(:mod:`zpipe.protocol.bulk`, :mod:`zpipe.transport.bulk`).

It is used once the coordinator gave a token in ``registered`` (an older
coordinator gives none: the state then goes on the control connection, as
before). A transfer the coordinator refuses (it restarted and no longer knows
the token) is handed back to be sent on the control connection instead; a
restarted coordinator sends a new token when the stage first speaks to it.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass

import zmq
import zmq.asyncio

from zpipe._errors import ProtocolError
from zpipe.log import get_logger
from zpipe.protocol import WireMessage
from zpipe.protocol.bulk import BulkChunk, BulkDone, BulkOpen, BulkOpened, BulkRefused
from zpipe.transport.bulk import (
    ChunkHeader,
    Inbox,
    OutgoingTransfer,
    payload_view,
    stall_after_s,
)
from zpipe.transport.codec import Message, decode_typed, encode
from zpipe.transport.emulation import UplinkConnection
from zpipe.transport.message_bounds import trim_heap
from zpipe.transport.sockets import send

log = get_logger("zpipe.stage")

# Transfers sent and not yet confirmed, kept to resend should the coordinator refuse one.
_UNSETTLED_KEPT = 4


@dataclass(frozen=True)
class Received:
    """What one message on the bulk connection came to: nothing to do, a whole message
    from the coordinator to handle as a control message, or a refused one of ours to
    send on the control connection."""

    message: WireMessage | None = None
    resend: Message | None = None


class StageBulk:
    def __init__(
        self,
        *,
        name: str,
        socket: zmq.asyncio.Socket,
        uplink: UplinkConnection,
        send_timeout_s: float,
        max_message_bytes: int,
    ) -> None:
        self.name = name
        self._socket = socket
        self._uplink = uplink
        self._send_timeout_s = send_timeout_s
        self._max_message_bytes = max_message_bytes
        # what the coordinator left half-sent goes after two send deadlines without a
        # chunk (looked at as each message arrives on this connection)
        self._inbox = Inbox(cap_bytes=max_message_bytes, stall_s=stall_after_s(send_timeout_s))
        self._token: str | None = None
        self._next_transfer = 0
        # transfer -> (its message, the token it was sent with)
        self._unsettled: OrderedDict[int, tuple[Message, str]] = OrderedDict()
        self.opened = False

    @property
    def usable(self) -> bool:
        """Whether the coordinator takes bulk state from this stage (it gave a token)."""
        return self._token is not None

    def registered(self, token: str | None) -> bool:
        """The coordinator (re)registered this stage: True if the connection must say
        whose it is (:meth:`open`)."""
        self._token = token
        self.opened = False
        self._inbox.clear()
        return token is not None

    async def open(self) -> None:
        if self._token is None:
            return
        await self._send(BulkOpen(name=self.name, token=self._token).to_message(), 64)

    async def send(self, message: Message) -> int:
        """Send ``message`` as chunks; returns its bytes. Each chunk has its own deadline,
        so a slow link that moves bytes never times out."""
        token = self._token
        assert token is not None, "send bulk state only when usable"
        self._next_transfer += 1
        transfer = OutgoingTransfer(self._next_transfer, encode(message))
        self._unsettled[transfer.transfer] = (message, token)
        while len(self._unsettled) > _UNSETTLED_KEPT:
            self._unsettled.popitem(last=False)
        for chunk in transfer.messages(name=self.name, token=token):
            if transfer.transfer not in self._unsettled:
                break  # refused meanwhile: it goes on the control connection
            await self._send(chunk, chunk.tensors[0].numel() + 128)
            # a turn for the loop between chunks: an activation or a heartbeat queued
            # meanwhile is not held up behind the whole transfer
            await asyncio.sleep(0)
        log.debug(
            "bulk_sent",
            stage=self.name,
            kind=message.kind,
            bytes=transfer.nbytes,
            chunks=transfer.chunks,
        )
        return transfer.nbytes

    async def _send(self, message: Message, nbytes: int) -> None:
        async def go() -> int:
            return await send(
                self._socket, message, timeout_s=self._send_timeout_s, peer="coordinator"
            )

        await self._uplink.send(nbytes, go)

    def received(self, message: WireMessage) -> Received:
        """One message on the bulk connection; :class:`ProtocolError` if it is bad."""
        match message:
            case BulkOpened():
                self.opened = True
                return Received()
            case BulkDone(transfer=transfer):
                self._unsettled.pop(transfer, None)
                return Received()
            case BulkRefused(transfer=transfer, reason=reason):
                return self._refused(transfer, reason)
            case BulkChunk():
                return self._chunk(message)
        raise ProtocolError(f"unexpected {message.KIND!r} on the bulk connection")

    def _refused(self, transfer: int, reason: str) -> Received:
        refused = self._unsettled.pop(transfer, None)
        log.warning(
            "bulk_refused",
            stage=self.name,
            transfer=transfer,
            reason=reason,
            resent=refused is not None,
        )
        if refused is None:
            return Received()
        resend, token = refused
        if token == self._token:
            # this coordinator takes no bulk state from us until we register again
            self._token = None
        return Received(resend=resend)

    def _chunk(self, chunk: BulkChunk) -> Received:
        if chunk.name != self.name or chunk.token != self._token:
            raise ProtocolError("a bulk chunk for another stage or registration")
        if len(chunk.tensors) != 1:
            raise ProtocolError("a bulk chunk carries one payload of bytes")
        header = ChunkHeader.from_body(chunk.body())
        now = time.monotonic()
        if self._inbox.expire(now):
            trim_heap()
        frames = self._inbox.add(header, payload_view(chunk.tensors[0]), now=now)
        if frames is None:
            return Received()
        # the whole message, parsed once here like every other from the coordinator
        # (its body checked once, by the codec)
        return Received(message=decode_typed(frames, max_message_bytes=self._max_message_bytes))
