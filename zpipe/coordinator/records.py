"""What the coordinator keeps across a restart, as plain records: no file I/O here.

The pure core (:mod:`zpipe.coordinator.core`) makes these and takes them back
(:meth:`~zpipe.coordinator.core.CoordinatorCore.saved_state`,
:meth:`~zpipe.coordinator.core.CoordinatorCore.restore`); the shell's state store
(:mod:`zpipe.coordinator.persistence`) writes and reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SavedMember:
    """What a restarted coordinator needs to know of a stage before it speaks again."""

    name: str
    routing_id: bytes
    data_endpoint: str
    info: Mapping[str, Any]
    public_key: str | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "routing_id": self.routing_id,
            "data_endpoint": self.data_endpoint,
            "info": dict(self.info),
            "public_key": self.public_key,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SavedMember:
        return cls(
            name=str(data["name"]),
            routing_id=bytes(data["routing_id"]),
            data_endpoint=str(data["data_endpoint"]),
            info=dict(data["info"]),
            public_key=None if data.get("public_key") is None else str(data["public_key"]),
        )


@dataclass(frozen=True)
class SavedNotices:
    """The current run's notices the client has not acknowledged (each ``(client
    routing id, StageFailed | RunReplanned)``), and the last number the run gave one:
    a restarted coordinator sends them again, and numbers its next notices after
    them (the client drops a number it has seen, so a number given twice would
    hide the second notice)."""

    run: int
    last_seq: int
    kept: tuple[tuple[bytes, Any], ...] = ()


@dataclass(frozen=True)
class SavedState:
    """Counters, members and the current run (a plain map the coordinator defines)."""

    epoch: int
    run_counter: int
    members: tuple[SavedMember, ...]
    run: Mapping[str, Any] | None
    saved_at: float = 0.0
    notices: SavedNotices | None = None


@dataclass(frozen=True)
class SavedReplica:
    run: int
    step: int
    plan: Mapping[str, Any]
    state: dict[str, torch.Tensor]
    # chain replication: who holds each device's backup (the snapshots are at stages)
    holders: Mapping[str, str] = field(default_factory=dict)
    # every unit's state is here (None: as the holders say; see runs.KeptReplica)
    global_copy: bool | None = None

    @property
    def complete(self) -> bool:
        return not self.holders if self.global_copy is None else self.global_copy
