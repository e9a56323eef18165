"""Bulk state cut into chunks and put together again; the deadlines a transfer moves. Pure.

A message that is big (a stage's weights, a replica, an assignment carrying
state) is first encoded by the codec into its frames (a header, one raw frame
per tensor). :class:`OutgoingTransfer` cuts the concatenation of those frames
into chunks of about :data:`CHUNK_BYTES`, each sent as one ``bulk_chunk``
(:mod:`zpipe.protocol.bulk`) on the bulk connection; :class:`Reassembly` checks
every chunk against what chunk 0 announced (sizes, counts, order, a cap) and
gives the frames back, which the codec then decodes and validates as it would
any message. A chunk that does not fit raises :class:`ProtocolError` and ends
its transfer: a later chunk of it is refused too, never half-used.

What one sender holds half-sent at a receiver is bounded (:class:`Inbox`): the
sizes its open transfers announced count against a budget from their first chunk,
and a transfer without a chunk for a while is dropped (issue 33, finding 5: a fake
stage left four transfers announced at 1 GiB part-sent and went silent; the
coordinator held them all until the stage was declared dead).

Progress is liveness: a peer that keeps delivering chunks is alive however long
the whole takes, so a deadline that waits on a transfer runs from its latest
progress (:func:`progress_deadline`), never from its start alone.

No sockets, no clock: tests feed chunks and times.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from zpipe._errors import ProtocolError, TransferBudgetError
from zpipe.protocol import Message
from zpipe.protocol.bulk import BulkChunk

if TYPE_CHECKING:
    import torch


# ~1 MB: at 20 Mbit/s a chunk is 0.4 s on the wire, so liveness messages on the same
# uplink wait at most about that long behind one, and progress shows that often.
CHUNK_BYTES = 1 << 20
# What a receiver accepts in one chunk (a sender may choose another size up to this).
MAX_CHUNK_BYTES = 16 << 20
# Frames of one message: the codec's header plus at most MAX_TENSORS tensors.
MAX_FRAMES = 4097
# Transfers one peer may have half-done at once (a checkpoint beside a replica, say).
MAX_OPEN_TRANSFERS = 4
# A transfer is given up this many send deadlines after its latest chunk: a sender
# that still sends puts each chunk on the wire within one (its send's own deadline),
# after waiting its turn on an uplink that another transfer's chunk may hold as long.
STALL_SEND_DEADLINES = 2


def stall_after_s(send_s: float) -> float:
    """How long a receiver keeps a transfer without a chunk, for senders whose every
    chunk's send gives up after ``send_s`` (the default of every ``stall_s``)."""
    return STALL_SEND_DEADLINES * send_s


def chunk_count(nbytes: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Chunks of ``chunk_bytes`` that carry ``nbytes`` (an empty transfer is one chunk)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    return max(1, -(-nbytes // chunk_bytes))


def _byte_view(frame: bytes | memoryview) -> memoryview:
    view = memoryview(frame)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class OutgoingTransfer:
    """One encoded message, cut into chunks in order; each chunk's header fields."""

    def __init__(
        self,
        transfer: int,
        frames: Sequence[bytes | memoryview],
        *,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        if not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [1, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
        if not 1 <= len(frames) <= MAX_FRAMES:
            raise ValueError(f"a transfer carries 1 to {MAX_FRAMES} frames, got {len(frames)}")
        self.transfer = transfer
        self._views = [_byte_view(f) for f in frames]
        self.frame_sizes = tuple(v.nbytes for v in self._views)
        self.nbytes = sum(self.frame_sizes)
        self.chunk_bytes = chunk_bytes
        self.chunks = chunk_count(self.nbytes, chunk_bytes)

    def header(self, seq: int) -> dict[str, object]:
        """The ``bulk_chunk`` fields of chunk ``seq`` (sizes only in chunk 0)."""
        fields: dict[str, object] = {
            "transfer": self.transfer,
            "seq": seq,
            "chunks": self.chunks,
            "bytes": self.nbytes,
        }
        if seq == 0:
            fields["frames"] = list(self.frame_sizes)
        return fields

    def payloads(self) -> Iterator[bytearray]:
        """Each chunk's bytes, in order (one chunk's worth copied at a time)."""
        pending: list[memoryview] = []
        size = 0
        for view in self._views:
            offset = 0
            while offset < view.nbytes:
                take = min(self.chunk_bytes - size, view.nbytes - offset)
                pending.append(view[offset : offset + take])
                size += take
                offset += take
                if size == self.chunk_bytes:
                    yield bytearray().join(pending)
                    pending, size = [], 0
        if size or self.nbytes == 0:
            yield bytearray().join(pending)

    def messages(self, *, name: str, token: str) -> Iterator[Message]:
        """The ``bulk_chunk`` messages of this transfer, in order, from or for ``name``."""
        import torch  # once per transfer: a coordinator serving membership never needs it

        for seq, payload in enumerate(self.payloads()):
            data = (
                torch.frombuffer(payload, dtype=torch.uint8)
                if payload
                else torch.empty(0, dtype=torch.uint8)  # frombuffer refuses an empty buffer
            )
            yield BulkChunk(
                name=name,
                token=token,
                transfer=self.transfer,
                seq=seq,
                chunks=self.chunks,
                nbytes=self.nbytes,
                frames=list(self.frame_sizes) if seq == 0 else None,
                tensors=(data,),
            ).to_message()


@dataclass(frozen=True)
class ChunkHeader:
    """What a received ``bulk_chunk`` says of itself (its body, less who sent it)."""

    transfer: int
    seq: int
    chunks: int
    nbytes: int
    frames: tuple[int, ...] | None = None

    @classmethod
    def from_body(cls, body: dict[str, object]) -> ChunkHeader:
        counts: list[int] = []
        for key in ("transfer", "seq", "chunks", "bytes"):
            value = body.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ProtocolError(f"bulk_chunk: {key} must be an integer >= 0, got {value!r}")
            counts.append(value)
        frames = body.get("frames")
        sizes: tuple[int, ...] | None = None
        if frames is not None:
            if not isinstance(frames, list) or not 1 <= len(frames) <= MAX_FRAMES:
                raise ProtocolError(f"bulk_chunk: frames must list 1 to {MAX_FRAMES} sizes")
            if not all(isinstance(f, int) and not isinstance(f, bool) and f >= 0 for f in frames):
                raise ProtocolError("bulk_chunk: every frame size must be an integer >= 0")
            sizes = tuple(frames)
        transfer, seq, chunks, nbytes = counts
        return cls(transfer, seq, chunks, nbytes, sizes)


def payload_view(payload: torch.Tensor) -> memoryview:
    """The bytes of a received chunk's payload (a flat uint8 tensor), without a copy."""
    import torch  # a tensor came, so torch is imported: this binds the name, per chunk

    if payload.dim() != 1 or payload.dtype != torch.uint8:
        raise ProtocolError("a bulk chunk's payload is a flat byte tensor")
    return memoryview(payload.numpy())  # type: ignore[arg-type]


class Reassembly:
    """One transfer being received: chunk 0 announces it, the rest must fit it."""

    def __init__(self, first: ChunkHeader, *, cap_bytes: int) -> None:
        if first.seq != 0:
            raise ProtocolError(
                f"transfer {first.transfer}: chunk {first.seq} before chunk 0 (nothing announced)"
            )
        if first.frames is None:
            raise ProtocolError(f"transfer {first.transfer}: chunk 0 names no frame sizes")
        if first.nbytes > cap_bytes:
            raise ProtocolError(
                f"transfer {first.transfer}: {first.nbytes} bytes exceed the limit of {cap_bytes}"
            )
        if sum(first.frames) != first.nbytes:
            raise ProtocolError(
                f"transfer {first.transfer}: frames of {sum(first.frames)} bytes in all, "
                f"but {first.nbytes} announced"
            )
        fewest = chunk_count(first.nbytes, MAX_CHUNK_BYTES)
        most = max(1, first.nbytes)  # every chunk but an empty transfer's carries a byte
        if not fewest <= first.chunks <= most:
            raise ProtocolError(
                f"transfer {first.transfer}: {first.chunks} chunks cannot carry "
                f"{first.nbytes} bytes (between {fewest} and {most})"
            )
        self.header = first
        # grown as chunks come, never allocated from what a peer announces: memory
        # follows the bytes a peer actually sent
        self._buffer = bytearray()
        self.received_bytes = 0
        self.next_seq = 0

    @property
    def complete(self) -> bool:
        return self.next_seq == self.header.chunks

    def add(self, header: ChunkHeader, payload: memoryview | bytes) -> bool:
        """Take chunk ``header.seq``; True once the transfer is whole."""
        first, transfer = self.header, self.header.transfer
        if header.transfer != transfer:
            raise ProtocolError(f"chunk of transfer {header.transfer} given to {transfer}")
        if self.complete:
            raise ProtocolError(f"transfer {transfer}: chunk {header.seq} after the last")
        if header.seq != self.next_seq:
            raise ProtocolError(
                f"transfer {transfer}: chunk {header.seq} where {self.next_seq} was due"
            )
        if header.chunks != first.chunks or header.nbytes != first.nbytes:
            raise ProtocolError(f"transfer {transfer}: chunk {header.seq} changes its totals")
        if header.seq and header.frames is not None:
            raise ProtocolError(f"transfer {transfer}: frame sizes again in chunk {header.seq}")
        size = memoryview(payload).nbytes
        left = first.nbytes - self.received_bytes
        last = header.seq == first.chunks - 1
        if size > MAX_CHUNK_BYTES or size > left or (size == 0 and first.nbytes > 0):
            raise ProtocolError(
                f"transfer {transfer}: chunk {header.seq} of {size} bytes "
                f"({left} of {first.nbytes} left)"
            )
        if last and size != left:
            raise ProtocolError(
                f"transfer {transfer}: the last chunk leaves {left - size} bytes missing"
            )
        if not last and left - size < first.chunks - 1 - header.seq:
            raise ProtocolError(
                f"transfer {transfer}: too few bytes left for the {first.chunks} chunks announced"
            )
        self._buffer += payload
        self.received_bytes += size
        self.next_seq += 1
        return self.complete

    def frames(self) -> list[memoryview]:
        """The frames of the whole transfer (views of one buffer, no copies)."""
        if not self.complete:
            raise ProtocolError(f"transfer {self.header.transfer} is not complete")
        assert self.header.frames is not None  # checked in __init__
        view = memoryview(self._buffer)
        out, offset = [], 0
        for size in self.header.frames:
            out.append(view[offset : offset + size])
            offset += size
        return out


class Inbox:
    """The transfers one peer has in progress, by transfer id, within two bounds:

    - ``budget_bytes``: what the open transfers announced, all together (a sender's
      budget; ``cap_bytes``, one message's most, unless given). Announced sizes count
      from chunk 0, before their bytes come, so a sender that opens transfers and
      leaves them half-sent holds at most this much here, however many it opens: a
      transfer past it is refused (:class:`TransferBudgetError`).
    - ``stall_s``: a transfer without a chunk for this long is dropped by
      :meth:`expire` (its sender gave up on it, or is gone and not yet declared
      dead), and its memory freed. None: kept until the sender's next transfers
      push it out, or :meth:`clear`.

    Times are given (``now``), never read: tests drive the clock.
    """

    def __init__(
        self,
        *,
        cap_bytes: int,
        max_open: int = MAX_OPEN_TRANSFERS,
        budget_bytes: int | None = None,
        stall_s: float | None = None,
    ) -> None:
        if stall_s is not None and not stall_s > 0:
            raise ValueError(f"stall_s must be > 0 seconds, got {stall_s}")
        self.cap_bytes = cap_bytes
        self.max_open = max_open
        self.budget_bytes = cap_bytes if budget_bytes is None else budget_bytes
        self.stall_s = stall_s
        self._open: dict[int, Reassembly] = {}
        self._progress: dict[int, float] = {}  # transfer -> the time of its latest chunk
        self.abandoned = 0  # transfers dropped half-done to make room for newer ones
        self.refused = 0  # transfers refused at chunk 0, past the budget
        self.expired = 0  # transfers dropped for want of a chunk within stall_s

    @property
    def open_transfers(self) -> int:
        return len(self._open)

    @property
    def held_bytes(self) -> int:
        """What the open transfers announced, all together (what the budget counts)."""
        return sum(r.header.nbytes for r in self._open.values())

    @property
    def received_bytes(self) -> int:
        """The bytes of open transfers that arrived (what this inbox holds now)."""
        return sum(r.received_bytes for r in self._open.values())

    def add(
        self,
        header: ChunkHeader,
        payload: memoryview | bytes,
        *,
        now: float = 0.0,
        held_elsewhere: int = 0,
    ) -> list[memoryview] | None:
        """Take one chunk (arrived at ``now``); the frames of its transfer once whole,
        else None.

        A chunk 0 for a transfer id in progress starts it over (the sender gave up
        on it and tried again); one beyond ``max_open`` transfers in progress drops
        the oldest; one whose announced size, with the open transfers' and
        ``held_elsewhere`` (what the same sender holds in other inboxes), is past
        ``budget_bytes`` is refused. A bad chunk ends its transfer and raises.
        """
        if header.seq == 0:
            self._drop(header.transfer)
            started = Reassembly(header, cap_bytes=self.cap_bytes)
            # the oldest were abandoned (their sender was cancelled mid-way): they go,
            # so that what a peer leaves half-sent never blocks what it sends next
            making_room = list(self._open)[: max(0, len(self._open) - self.max_open + 1)]
            held = held_elsewhere + sum(
                r.header.nbytes for t, r in self._open.items() if t not in making_room
            )
            if held + header.nbytes > self.budget_bytes:
                self.refused += 1
                raise TransferBudgetError(
                    f"transfer {header.transfer}: {header.nbytes} bytes announced with "
                    f"{held} held in this sender's open transfers, past its budget of "
                    f"{self.budget_bytes}",
                    announced=header.nbytes,
                    held=held,
                    budget=self.budget_bytes,
                )
            for transfer in making_room:
                self.abandoned += 1
                self._drop(transfer)
            self._open[header.transfer] = started
        reassembly = self._open.get(header.transfer)
        if reassembly is None:
            raise ProtocolError(f"chunk {header.seq} of transfer {header.transfer}, never begun")
        try:
            whole = reassembly.add(header, payload)
        except ProtocolError:
            self._drop(header.transfer)
            raise
        if not whole:
            self._progress[header.transfer] = now
            return None
        self._drop(header.transfer)
        return reassembly.frames()

    def expire(self, now: float) -> list[tuple[int, int]]:
        """Drop the transfers with no chunk for ``stall_s`` by ``now``: each one's id
        and the bytes of it that had arrived (now freed)."""
        if self.stall_s is None:
            return []
        stale = [t for t, at in self._progress.items() if now - at >= self.stall_s]
        out = []
        for transfer in stale:
            out.append((transfer, self._open[transfer].received_bytes))
            self._drop(transfer)
        self.expired += len(out)
        return out

    def _drop(self, transfer: int) -> None:
        self._open.pop(transfer, None)
        self._progress.pop(transfer, None)

    def clear(self) -> None:
        self._open.clear()
        self._progress.clear()


def progress_deadline(started: float, timeout_s: float, last_progress: float | None) -> float:
    """When a wait that began at ``started`` gives up: ``timeout_s`` after it began or
    after the latest progress of what it waits for, whichever is later. A transfer
    that keeps moving bytes keeps its wait alive, however long the whole takes."""
    latest = started if last_progress is None else max(started, last_progress)
    return latest + timeout_s
