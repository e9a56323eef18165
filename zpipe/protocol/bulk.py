"""Stage <-> coordinator bulk state on its own connection, apart from liveness.

Heartbeats, probes and their acks must never wait behind megabytes of weights on
a slow uplink. So each stage opens a second DEALER (its *bulk* connection) to the
coordinator's ROUTER, and state that is big (``weights``, ``backed_up`` from a
stage; ``assign`` with tensors to a stage) crosses it as a stream of
``bulk_chunk`` messages: the sender encodes the whole message with the codec
and cuts its frames into chunks; the receiver reassembles and decodes them
(:mod:`zpipe.transport.bulk`) and handles the message as if it had come on the
control connection. Every chunk is progress, and progress counts as liveness::

    coordinator -> stage   registered (bulk_token)             control connection
    stage -> coordinator   bulk_open (name, token)             bulk connection
    coordinator -> stage   bulk_opened                         bulk connection
    either way             bulk_chunk ... bulk_chunk           bulk connection
    coordinator -> stage   bulk_done | bulk_refused            bulk connection

The token (from ``registered``) ties a bulk connection to the stage that owns the
control connection: without keys, a peer that does not know it cannot send state
in a stage's name; with keys, the chunk's CURVE key must be the stage's too.
``bulk_refused``: the coordinator cannot attribute a transfer (it restarted and
lost the token, say); the stage sends that message on its control connection.
"""

from __future__ import annotations

from typing import ClassVar

from zpipe.protocol._schema import (
    INT,
    OPT_LIST,
    STR,
    TensorMessage,
    WireMessage,
    wire,
    wire_message,
)


@wire_message
class BulkOpen(WireMessage):
    """Sent on a stage's bulk connection: the route the coordinator's bulk goes to."""

    KIND: ClassVar[str] = "bulk_open"
    name: str = wire(STR)
    token: str = wire(STR)


@wire_message
class BulkOpened(WireMessage):
    KIND: ClassVar[str] = "bulk_opened"
    name: str = wire(STR)


@wire_message
class BulkChunk(TensorMessage):
    """Chunk ``seq`` of ``chunks`` of transfer ``transfer`` (the sender's counter), one
    uint8 tensor of payload; the transfer is ``bytes`` long in all and is the codec
    frames of one message, of the sizes ``frames`` (in chunk 0 only)."""

    KIND: ClassVar[str] = "bulk_chunk"
    name: str = wire(STR)
    token: str = wire(STR)
    transfer: int = wire(INT)
    seq: int = wire(INT)
    chunks: int = wire(INT)
    nbytes: int = wire(INT, key="bytes")
    frames: list[int] | None = wire(OPT_LIST, default=None, omit_if_none=True)


@wire_message
class BulkDone(WireMessage):
    """The transfer arrived whole and was decoded (the sender may forget it)."""

    KIND: ClassVar[str] = "bulk_done"
    transfer: int = wire(INT)


@wire_message
class BulkRefused(WireMessage):
    """The transfer was not taken: send its message on the control connection."""

    KIND: ClassVar[str] = "bulk_refused"
    transfer: int = wire(INT)
    reason: str = wire(STR)


MESSAGES: tuple[type[WireMessage], ...] = (BulkOpen, BulkOpened, BulkChunk, BulkDone, BulkRefused)
