"""Stage-to-stage state on the probe sockets, in chunks when it is big.

A backup (chain replication) or a fetched snapshot can be tens of megabytes; as
one message on a 20 Mbit/s link it outlasts any per-message deadline, and
nothing shows that it is moving. So state that does not fit one chunk
(:data:`zpipe.transport.bulk.CHUNK_BYTES`) crosses as ``state_chunk`` messages
(:mod:`zpipe.protocol.peer`), the codec frames of the whole message cut and put
together again by :mod:`zpipe.transport.bulk`, which checks every chunk against
what chunk 0 announced. Each chunk has its own deadline, so a transfer that keeps
moving never times out however long it takes:

- a backup is sent one chunk per round trip (the holder acknowledges each, and
  refuses at chunk 0 a backup it would never keep);
- a fetch's answer is streamed by the holder, for a requester that offered
  ``chunk_bytes``, and read one chunk per deadline.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from types import TracebackType
from typing import TypeVar

import torch
import zmq
import zmq.asyncio

from zpipe._errors import PipelineError, ProtocolError
from zpipe.protocol import WireMessage
from zpipe.protocol.peer import Backup, BackupOk, FetchUnits, StateChunk, StateChunkOk, Units
from zpipe.transport import codec, security
from zpipe.transport.bulk import (
    CHUNK_BYTES,
    ChunkHeader,
    Inbox,
    OutgoingTransfer,
    payload_view,
)
from zpipe.transport.codec import decode_typed
from zpipe.transport.sockets import SocketOptions, open_socket, recv_frames, send

# Owners whose half-sent backups one holder keeps at once (beyond: the oldest goes).
MAX_OWNERS_IN_PROGRESS = 8

_W = TypeVar("_W", bound=WireMessage)


def encoded_size(message: WireMessage) -> tuple[list[bytes | memoryview], int]:
    """``message``'s codec frames and their total size."""
    frames = codec.encode(message.to_message())
    return frames, sum(memoryview(f).nbytes for f in frames)


def state_chunks(
    frames: list[bytes | memoryview], *, owner: str, transfer: int, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[StateChunk]:
    """The ``state_chunk`` messages that carry ``frames``, in order."""
    outgoing = OutgoingTransfer(transfer, frames, chunk_bytes=chunk_bytes)
    for seq, payload in enumerate(outgoing.payloads()):
        data = (
            torch.frombuffer(payload, dtype=torch.uint8)
            if payload
            else torch.empty(0, dtype=torch.uint8)  # frombuffer refuses an empty buffer
        )
        yield StateChunk(
            owner=owner,
            transfer=outgoing.transfer,
            seq=seq,
            chunks=outgoing.chunks,
            nbytes=outgoing.nbytes,
            frames=list(outgoing.frame_sizes) if seq == 0 else None,  # sizes in chunk 0 only
            tensors=(data,),
        )


class ChunkedState:
    """The chunked transfers in progress from peers, by (sender, owner).

    What one sender has half-sent here, under every owner, may announce at most
    ``cap_bytes`` together (a transfer past it is refused: its sender hears so in
    the chunk's answer); one without a chunk for ``stall_s`` is dropped at the next
    chunk that arrives from anyone (:meth:`expire`)."""

    def __init__(self, *, cap_bytes: int, stall_s: float | None = None) -> None:
        self.cap_bytes = cap_bytes
        self.stall_s = stall_s
        self._inboxes: OrderedDict[tuple[object, str], Inbox] = OrderedDict()

    def add(
        self,
        sender: object,
        chunk: StateChunk,
        *,
        max_message_bytes: int,
        now: float = 0.0,
    ) -> WireMessage | None:
        """Take one ``state_chunk`` (arrived at ``now``); the decoded message once its
        transfer is whole. ProtocolError for a chunk that does not fit (its transfer
        is dropped), :class:`TransferBudgetError` for one past the sender's budget."""
        if len(chunk.tensors) != 1:
            raise ProtocolError("a state chunk carries exactly one payload tensor")
        self.expire(now)
        key = (sender, chunk.owner)
        inbox = self._inboxes.get(key)
        if inbox is None:
            while len(self._inboxes) >= MAX_OWNERS_IN_PROGRESS:
                self._inboxes.popitem(last=False)
            inbox = self._inboxes[key] = Inbox(
                cap_bytes=self.cap_bytes, max_open=1, stall_s=self.stall_s
            )
        self._inboxes.move_to_end(key)
        elsewhere = sum(
            i.held_bytes for (s, o), i in self._inboxes.items() if s == sender and i is not inbox
        )
        header = ChunkHeader.from_body(chunk.body())
        try:
            frames = inbox.add(
                header, payload_view(chunk.tensors[0]), now=now, held_elsewhere=elsewhere
            )
        except ProtocolError:
            if not inbox.open_transfers:
                del self._inboxes[key]
            raise
        if frames is None:
            return None
        if not inbox.open_transfers:
            del self._inboxes[key]
        return decode_typed(frames, max_message_bytes=max_message_bytes)

    def expire(self, now: float) -> int:
        """Drop the transfers with no chunk for ``stall_s``; the bytes of them freed."""
        freed = 0
        for key, inbox in list(self._inboxes.items()):
            freed += sum(received for _, received in inbox.expire(now))
            if not inbox.open_transfers:
                del self._inboxes[key]
        return freed

    @property
    def held_bytes(self) -> int:
        """What the open transfers announced, all together."""
        return sum(i.held_bytes for i in self._inboxes.values())

    def drop(self, sender: object, owner: str) -> None:
        self._inboxes.pop((sender, owner), None)


class PeerLink:
    """One DEALER connection to a peer stage's probe socket, for a conversation of
    several messages (a chunked backup or fetch); every send and receive has its
    deadline."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        *,
        peer: str,
        endpoint: str,
        server_key: str | None,
        keypair: security.KeyPair | None,
        options: SocketOptions,
        timeout_s: float,
        moved: Callable[[int], None] | None = None,
    ) -> None:
        self.peer = peer
        self.timeout_s = timeout_s
        # told the bytes of each chunk that crossed (the stage's progress counter)
        self._moved = moved or (lambda nbytes: None)
        self._options = options
        # No ZMTP heartbeats: the peer is another stage, which could fill this socket and
        # hang up (libzmq 4.3.5 then aborts; see zpipe.transport.sockets); the replies'
        # deadlines find a silent peer.
        self._sock = open_socket(context, zmq.DEALER, options, zmtp_heartbeat=False)
        try:
            if keypair is not None:
                if server_key is None:
                    raise ProtocolError(f"no public key for {peer!r}")
                security.secure_client(self._sock, keypair, server_key.encode())
            self._sock.connect(endpoint)
        except BaseException:
            self._sock.close(linger=0)
            raise

    async def __aenter__(self) -> PeerLink:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._sock.close(linger=0)

    async def send(self, message: WireMessage) -> None:
        await send(self._sock, message.to_message(), timeout_s=self.timeout_s, peer=self.peer)

    async def receive(self, *expect: type[WireMessage]) -> WireMessage:
        awaited = " or ".join(cls.KIND for cls in expect)
        frames = await recv_frames(
            self._sock, timeout_s=self.timeout_s, peer=self.peer, awaited=awaited
        )
        reply = decode_typed(frames, max_message_bytes=self._options.max_message_bytes)
        if not isinstance(reply, expect):
            raise ProtocolError(f"{self.peer!r} answered {reply.KIND!r}, expected {awaited}")
        return reply

    async def request(self, message: WireMessage, *expect: type[WireMessage]) -> WireMessage:
        await self.send(message)
        return await self.receive(*expect)

    async def send_backup(
        self,
        backup: Backup,
        *,
        pace: Callable[[int], Awaitable[None]],
        transfer: int,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> BackupOk:
        """Send ``backup``; the holder's ``backup_ok``. In one message when it fits a
        chunk, else one chunk per round trip (each paced and with its own deadline)."""
        frames, nbytes = encoded_size(backup)
        if nbytes <= chunk_bytes:
            await pace(nbytes)
            return _of(BackupOk, await self.request(backup, BackupOk))
        chunks = list(
            state_chunks(frames, owner=backup.owner, transfer=transfer, chunk_bytes=chunk_bytes)
        )
        for chunk in chunks[:-1]:
            await pace(chunk.tensors[0].numel())
            taken = _of(StateChunkOk, await self.request(chunk, StateChunkOk))
            if taken.error:
                raise PipelineError(f"{self.peer} refused the backup: {taken.error}")
            self._moved(chunk.tensors[0].numel())
        await pace(chunks[-1].tensors[0].numel())
        answer = await self.request(chunks[-1], BackupOk, StateChunkOk)
        if isinstance(answer, StateChunkOk):
            raise PipelineError(f"{self.peer} refused the backup: {answer.error}")
        self._moved(chunks[-1].tensors[0].numel())
        return _of(BackupOk, answer)

    async def fetch(self, request: FetchUnits) -> Units:
        """Send a ``fetch_units`` request; the ``units`` answer, put together from
        ``state_chunk`` messages when the holder streams it (each read has its own
        deadline, so a big answer on a slow link is fine while it moves)."""
        reply = await self.request(request, Units, StateChunk)
        if isinstance(reply, Units):
            return reply
        state = ChunkedState(cap_bytes=self._options.max_message_bytes)
        while True:
            chunk = _of(StateChunk, reply)
            whole = state.add(self.peer, chunk, max_message_bytes=self._options.max_message_bytes)
            self._moved(chunk.tensors[0].numel())
            if whole is not None:
                if not isinstance(whole, Units):
                    raise ProtocolError(f"{self.peer!r} streamed {whole.KIND!r}, not units")
                return whole
            reply = await self.receive(StateChunk)


def _of(cls: type[_W], message: WireMessage) -> _W:
    """``message`` as the one class :meth:`PeerLink.receive` allowed (for the type checker)."""
    assert isinstance(message, cls)
    return message
