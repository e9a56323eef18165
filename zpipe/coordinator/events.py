"""What happens to the coordinator, as plain data: the events its controllers take.

The shell turns every received message into one of these through its dispatch
table (by message kind), and feeds the results of its timers and jobs back the
same way. Each event is handled with the time it happened (``now``, monotonic).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zpipe.transport.codec import Message


@dataclass(frozen=True)
class Registered:
    """A stage asked to register (``register``)."""

    routing_id: bytes
    user_key: str | None
    message: Message
    # ties the stage's bulk connection to it (chosen by the shell: randomness is I/O)
    bulk_token: str = ""


@dataclass(frozen=True)
class BulkOpenAsked:
    """A stage's bulk connection says whose it is (``bulk_open``)."""

    routing_id: bytes
    user_key: str | None
    message: Message


@dataclass(frozen=True)
class BulkChunkArrived:
    """One chunk of a stage's bulk transfer (``bulk_chunk``), on its bulk connection."""

    routing_id: bytes
    user_key: str | None
    message: Message


@dataclass(frozen=True)
class StageSpoke:
    """A message from a registered stage: a heartbeat, a probe's answer or a reply."""

    routing_id: bytes
    message: Message


@dataclass(frozen=True)
class ClientRequest:
    """A client's request: a run, its start, its end, a checkpoint, a replica, the cluster."""

    routing_id: bytes
    user_key: str | None
    message: Message


@dataclass(frozen=True)
class StallReported:
    """The client's results are late (``stalled``)."""

    message: Message


@dataclass(frozen=True)
class Tick:
    """Time passed: probe the silent, declare the dead."""


@dataclass(frozen=True)
class TimerFired:
    tag: int


@dataclass(frozen=True)
class JobDone:
    tag: int
    result: Any


@dataclass(frozen=True)
class JobFailed:
    tag: int
    error: Exception


@dataclass(frozen=True)
class StageDied:
    """The coordinator declared ``name`` dead (silent, or restarted): for its run."""

    name: str
    reason: str
    silent_s: float


@dataclass(frozen=True)
class RequestFailed:
    """A message to ``stage`` could not be sent (its connection is gone)."""

    stage: str
    error: Exception


Event = (
    Registered
    | BulkOpenAsked
    | BulkChunkArrived
    | StageSpoke
    | ClientRequest
    | StallReported
    | Tick
    | TimerFired
    | JobDone
    | JobFailed
    | RequestFailed
    | StageDied
)
