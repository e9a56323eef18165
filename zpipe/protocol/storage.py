"""The coordinator's files (zpipe.coordinator.persistence): codec messages on disk, never on
the wire.

    coordinator_state   membership, run counter and the current run; ``notices``: the
                        run's notices its client has not acknowledged
                        (zpipe.coordinator.notices), absent when it has none
    replica_file        one chunk of a replica; ``keys`` name this chunk's tensors
    copy_file           one chunk of a copy an asynchronous stage made without
                        draining; ``record`` is its ledger entry
                        (zpipe.recovery.live_copies.CopyRecord.to_dict)
"""

from __future__ import annotations

from typing import Any, ClassVar

from zpipe.protocol._schema import (
    INT,
    LIST,
    MAP,
    NUM,
    OPT_BOOL,
    OPT_MAP,
    TensorMessage,
    WireMessage,
    wire,
    wire_message,
)


@wire_message
class CoordinatorState(WireMessage):
    """``cluster_epoch`` is the body's "epoch" (the plan epoch the coordinator had reached)."""

    KIND: ClassVar[str] = "coordinator_state"
    cluster_epoch: int = wire(INT, key="epoch")
    run_counter: int = wire(INT)
    members: list[Any] = wire(LIST)
    run: dict[str, Any] | None = wire(OPT_MAP)
    saved_at: float = wire(NUM)
    # {"run", "last_seq", "kept": [{"to", "kind", "body", "epoch"}]}: see SavedNotices
    notices: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)


@wire_message
class ReplicaFile(TensorMessage):
    KIND: ClassVar[str] = "replica_file"
    run: int = wire(INT)
    step: int = wire(INT)
    plan: dict[str, Any] = wire(MAP)
    keys: list[Any] = wire(LIST)
    chunk: int = wire(INT)
    chunks: int = wire(INT)
    holders: dict[str, Any] | None = wire(OPT_MAP, default=None)
    # every unit's state is in the file (None: as ``holders`` say); written only when known
    global_copy: bool | None = wire(OPT_BOOL, key="global", default=None)


@wire_message
class CopyFile(TensorMessage):
    KIND: ClassVar[str] = "copy_file"
    record: dict[str, Any] = wire(MAP)
    keys: list[Any] = wire(LIST)
    chunk: int = wire(INT)
    chunks: int = wire(INT)


MESSAGES: tuple[type[WireMessage], ...] = (CoordinatorState, ReplicaFile, CopyFile)
