"""Stage <-> stage on the probe socket: link measurement, backups kept, units fetched.

::

    link_ping / link_pong          round-trip time
    link_burst (tensor payload)    one message of a bandwidth burst; ``seq`` within ``burst``
    link_burst_end                 how many the sender sent
    link_burst_report              what arrived, and over which span after the first
    backup -> backup_ok            a neighbour's snapshot to keep (chain replication)
    fetch_units -> units           units of a kept snapshot, fetched back on recovery
"""

from __future__ import annotations

from typing import Any, ClassVar

from zpipe.protocol._schema import (
    INT,
    LIST,
    NUM,
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
    Units,
)
