"""Stage <-> stage on the probe socket: link measurement, backups kept, units fetched.

::

    link_ping / link_pong          round-trip time
    link_burst (tensor payload)    one message of a bandwidth burst; ``seq`` within ``burst``
    link_burst_end                 how many the sender sent
    link_burst_report              what arrived, and over which span after the first
    backup -> backup_ok            a neighbour's snapshot to keep (chain replication)
    fetch_units -> units           units of a kept snapshot, fetched back on recovery

State bigger than one chunk (:data:`zpipe.transport.bulk.CHUNK_BYTES`) crosses as
``state_chunk`` messages, the codec frames of the whole message cut as the
coordinator's bulk state is (:mod:`zpipe.transport.bulk`), so that no single
message outlasts a deadline on a slow link and every chunk is progress::

    state_chunk -> state_chunk_ok ... state_chunk -> backup_ok    a big backup, one
                                                                   chunk per round trip
    fetch_units (chunk_bytes) -> state_chunk ... state_chunk      a big fetch's answer,
                                                                   streamed (then decoded
                                                                   as ``units``)

A backup's sender chunks only a backup that does not fit one chunk; a fetch's
answer is chunked only for a requester that offered ``chunk_bytes``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from zpipe.protocol._schema import (
    INT,
    LIST,
    NUM,
    OPT_BOOL,
    OPT_INT,
    OPT_LIST,
    STR,
    TensorMessage,
    WireMessage,
    wire,
    wire_message,
)


@wire_message
class LinkPing(WireMessage):
    KIND: ClassVar[str] = "link_ping"
    nonce: int = wire(INT)


@wire_message
class LinkPong(WireMessage):
    KIND: ClassVar[str] = "link_pong"
    nonce: int = wire(INT)


@wire_message
class LinkBurst(TensorMessage):
    KIND: ClassVar[str] = "link_burst"
    burst: int = wire(INT)
    seq: int = wire(INT)


@wire_message
class LinkBurstEnd(WireMessage):
    KIND: ClassVar[str] = "link_burst_end"
    burst: int = wire(INT)
    sent: int = wire(INT)


@wire_message
class LinkBurstReport(WireMessage):
    KIND: ClassVar[str] = "link_burst_report"
    burst: int = wire(INT)
    received: int = wire(INT)
    bytes_after_first: int = wire(INT)
    span_s: float = wire(NUM)


@wire_message
class Backup(TensorMessage):
    """``owner``'s state after round ``step``, its tensors named by ``keys``."""

    KIND: ClassVar[str] = "backup"
    run: int = wire(INT)
    step: int = wire(INT)
    owner: str = wire(STR)
    keys: list[Any] = wire(LIST)
    # a chain copy made while the pipeline trains on (step: mini-batches applied), kept
    # apart from the snapshots of flushes (zpipe.recovery.live_copies)
    live: bool | None = wire(OPT_BOOL, default=None, omit_if_none=True)


@wire_message
class BackupOk(WireMessage):
    KIND: ClassVar[str] = "backup_ok"
    run: int = wire(INT)
    step: int = wire(INT)
    error: str = wire(STR)


@wire_message
class FetchUnits(WireMessage):
    KIND: ClassVar[str] = "fetch_units"
    owner: str = wire(STR)
    run: int = wire(INT)
    step: int = wire(INT)
    start: int = wire(INT)
    end: int = wire(INT)
    # offered by a requester that takes the answer as state_chunk messages of at most
    # this many bytes each (added within version 1; absent: one ``units`` message)
    chunk_bytes: int | None = wire(OPT_INT, default=None, omit_if_none=True)


@wire_message
class StateChunk(TensorMessage):
    """Chunk ``seq`` of ``chunks`` of transfer ``transfer`` (the sender's counter) of
    ``owner``'s state, one uint8 payload tensor; the transfer is ``bytes`` long and is
    the codec frames of one ``backup`` or ``units`` message, of the sizes ``frames``
    (in chunk 0 only)."""

    KIND: ClassVar[str] = "state_chunk"
    owner: str = wire(STR)
    transfer: int = wire(INT)
    seq: int = wire(INT)
    chunks: int = wire(INT)
    nbytes: int = wire(INT, key="bytes")
    frames: list[Any] | None = wire(OPT_LIST, default=None, omit_if_none=True)


@wire_message
class StateChunkOk(WireMessage):
    """A backup's chunk taken (``error`` empty) or its transfer refused and dropped."""

    KIND: ClassVar[str] = "state_chunk_ok"
    transfer: int = wire(INT)
    seq: int = wire(INT)
    error: str = wire(STR)


@wire_message
class Units(TensorMessage):
    KIND: ClassVar[str] = "units"
    keys: list[Any] = wire(LIST)
    error: str = wire(STR)


MESSAGES: tuple[type[WireMessage], ...] = (
    LinkPing,
    LinkPong,
    LinkBurst,
    LinkBurstEnd,
    LinkBurstReport,
    Backup,
    BackupOk,
    FetchUnits,
    StateChunk,
    StateChunkOk,
    Units,
)
