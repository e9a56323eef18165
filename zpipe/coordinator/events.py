"""What happens to the coordinator, as plain data: the events its controllers take.

The shell parses every received message into its protocol class once
(:data:`zpipe.protocol.REGISTRY`) and turns it into one of these by its class
(:func:`event_of`), and feeds the results of its timers and jobs back the same
way. Each event is handled with the time it happened (``now``, monotonic).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from zpipe.protocol import WireMessage
from zpipe.protocol.bulk import BulkChunk, BulkOpen
from zpipe.protocol.client_control import (
    ClusterRequest,
    NoticeAck,
    Replicate,
    RunEnd,
    RunGo,
    RunRequest,
    Stalled,
)
from zpipe.protocol.generation import GenRunRequest
from zpipe.protocol.lossy import LossyRunRequest
from zpipe.protocol.repartition import Repartition
from zpipe.protocol.stage_control import Register, WeightsRequest


@dataclass(frozen=True)
class RegisterAsked:
    """A stage asked to register (``register``)."""

    routing_id: bytes
    user_key: str | None
    message: Register
    # ties the stage's bulk connection to it (chosen by the shell: randomness is I/O)
    bulk_token: str = ""


@dataclass(frozen=True)
class BulkOpenAsked:
    """A stage's bulk connection says whose it is (``bulk_open``)."""

    routing_id: bytes
    user_key: str | None
    message: BulkOpen


@dataclass(frozen=True)
class BulkChunkArrived:
    """One chunk of a stage's bulk transfer (``bulk_chunk``), on its bulk connection."""

    routing_id: bytes
    user_key: str | None
    message: BulkChunk


@dataclass(frozen=True)
class StageSpoke:
    """A message from a registered stage: a heartbeat, a probe's answer or a reply."""

    routing_id: bytes
    message: WireMessage


# What a client asks: a run, its start, its end, a checkpoint, a replica, the cluster.
ClientMessage = (
    RunRequest
    | RunGo
    | RunEnd
    | ClusterRequest
    | WeightsRequest
    | Replicate
    | NoticeAck
    | LossyRunRequest
    | Repartition
    | GenRunRequest
)
CLIENT_MESSAGES: tuple[type[WireMessage], ...] = (
    RunRequest,
    RunGo,
    RunEnd,
    ClusterRequest,
    WeightsRequest,
    Replicate,
    NoticeAck,
    LossyRunRequest,
    Repartition,
    GenRunRequest,
)


@dataclass(frozen=True)
class ClientRequest:
    """A client's request: a run, its start, its end, a checkpoint, a replica, the cluster."""

    routing_id: bytes
    user_key: str | None
    message: ClientMessage


@dataclass(frozen=True)
class StallReported:
    """The client's results are late (``stalled``)."""

    message: Stalled


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
    """A message to ``stage`` could not be sent (its connection is gone, or no room in
    time); ``routing_id``: the connection it was sent on (None: not known)."""

    stage: str
    error: Exception
    routing_id: bytes | None = None


Event = (
    RegisterAsked
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


def event_of(routing_id: bytes, user_key: str | None, message: WireMessage) -> Event:
    """The event a received (parsed) message becomes, by its class; any other class is
    a stage's message that the core judges (and drops, if unexpected)."""
    match message:
        case Register():
            # a fresh token for each registration ties the stage's bulk connection to it
            token = secrets.token_urlsafe(16)
            return RegisterAsked(routing_id, user_key, message, bulk_token=token)
        case BulkOpen():
            return BulkOpenAsked(routing_id, user_key, message)
        case BulkChunk():
            return BulkChunkArrived(routing_id, user_key, message)
        case Stalled():
            return StallReported(message)
        case _ if isinstance(message, CLIENT_MESSAGES):
            return ClientRequest(routing_id, user_key, message)  # type: ignore[arg-type]
        case _:
            return StageSpoke(routing_id, message)
