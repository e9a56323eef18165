"""What happens to the coordinator, as plain data: the events its controllers take.

The shell turns every received message into one of these through its dispatch
table (by message kind), and feeds the results of its timers and jobs back the
same way. Each event is handled with the time it happened (``now``, monotonic).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
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


EventOf = Callable[[bytes, "str | None", Message], Event]


def _client_request(routing_id: bytes, user_key: str | None, message: Message) -> Event:
    return ClientRequest(routing_id, user_key, message)


def _registered(routing_id: bytes, user_key: str | None, message: Message) -> Event:
    # a fresh token for each registration ties the stage's bulk connection to it
    return Registered(routing_id, user_key, message, bulk_token=secrets.token_urlsafe(16))


# Every kind a peer may send, and the event it becomes; any other kind is a stage's
# message that the core judges (and drops, if unexpected).
DISPATCH: dict[str, EventOf] = {
    "register": _registered,
    "bulk_open": lambda routing_id, user_key, message: BulkOpenAsked(routing_id, user_key, message),
    "bulk_chunk": lambda routing_id, user_key, message: BulkChunkArrived(
        routing_id, user_key, message
    ),
    "stalled": lambda _routing_id, _user_key, message: StallReported(message),
    **{
        kind: _client_request
        for kind in (
            "run_request",
            "run_go",
            "run_end",
            "cluster_request",
            "weights_request",
            "replicate",
            "notice_ack",
            "lossy_run_request",
            "repartition",
        )
    },
}


def _stage_message(routing_id: bytes, _user_key: str | None, message: Message) -> Event:
    return StageSpoke(routing_id, message)


def event_of_kind(kind: str) -> EventOf:
    """How a received message of ``kind`` becomes an event."""
    return DISPATCH.get(kind, _stage_message)
