"""The coordinator's side of the stages' bulk connections: whose they are, what came. Pure.

Each registered stage gets a token in ``registered``; its bulk connection
(:mod:`zpipe.protocol.bulk`) names the stage and the token in ``bulk_open`` and in
every ``bulk_chunk``. A chunk counts for a stage only when the stage is alive, the
token is the one it was given and, with keys, the chunk's CURVE key is the
stage's: nobody else can send weights or a replica in its name. Every chunk that
counts is progress: the stage is heard from (liveness) and the waits on its replies
run on from now (:meth:`~zpipe.coordinator.flows.FlowRunner.progress`). A whole
transfer is decoded and handled as the reply it carries, as if it had come on the
stage's control connection.

What a stage leaves half-sent is bounded (:class:`~zpipe.transport.bulk.Inbox`):
its open transfers may announce no more than its budget together (once a run is
planned, from the state of the units it holds: :mod:`zpipe.coordinator.bulk_budget`;
a transfer past it is refused at its first chunk with ``bulk_refused``, and the
stage sends that message on its control connection), and a transfer without a
chunk for ``stall_s`` is dropped at the next tick (:func:`expire_stalled`), as all
of a stage's are at its death.
"""

from __future__ import annotations

from zpipe._errors import ProtocolError
from zpipe.coordinator.bulk_links import BulkLink
from zpipe.coordinator.commands import Command, GiveBackMemory, Log, Send
from zpipe.coordinator.events import BulkChunkArrived, BulkOpenAsked, StageSpoke
from zpipe.coordinator.membership import MemberState
from zpipe.coordinator.state import ControlState
from zpipe.protocol import WireMessage
from zpipe.protocol.bulk import BulkDone, BulkOpened, BulkRefused
from zpipe.protocol.lossy import LossyReplica, LossyResult
from zpipe.protocol.stage_control import AsyncCopy, BackedUp, Registered, Weights
from zpipe.transport.bulk import ChunkHeader, payload_view
from zpipe.transport.codec import decode_typed

# What a stage sends through its bulk connection: its replies that carry state.
# (an asynchronous stage's global copies and the last stage's chain copies, made
# without draining, come as ``async_copy``: zpipe.coordinator.runs.async_copies)
STAGE_BULK = (Weights, BackedUp, LossyResult, LossyReplica, AsyncCopy)


def _attributed(state: ControlState, name: str, token: str, user_key: str | None) -> BulkLink:
    """The link of stage ``name`` if this sender may speak for it; ProtocolError if not."""
    member = state.membership.get(name)
    if member is None or member.state is MemberState.DEAD:
        raise ProtocolError(f"bulk data for {name!r}, which is not a registered stage")
    link = state.bulk.get(name)
    if link is None:
        raise ProtocolError(f"stage {name!r} holds no bulk token here (register again)")
    if token != link.token:
        raise ProtocolError(f"bulk data for {name!r} with a token that is not its own")
    if state.public_keys:
        expected = state.key_of(name)
        if expected is None or user_key != expected:
            raise ProtocolError(f"bulk data for {name!r} from a key that is not {name}.key")
    return link


def retie_restored(state: ControlState, event: StageSpoke) -> list[Command]:
    """A stage restored from disk speaks for the first time: this process never gave it a
    token, so it gets one now (a ``registered`` it takes as its registration's, without
    registering again) and its state goes on its bulk connection again."""
    member = state.membership.by_routing_id(event.routing_id)
    if member is None or member.name not in state.unconfirmed or state.bulk.get(member.name):
        return []
    token = state.bulk.issue(
        member.name, state.new_token(), event.routing_id, memory_mb=member.info.get("memory_mb")
    )
    registered = Registered(
        name=member.name,
        heartbeat_interval=state.timeouts.heartbeat_interval_s,
        bulk_token=token,
    )
    return [
        Log("info", "bulk_token_renewed", {"stage": member.name}),
        Send(event.routing_id, registered, member.name, state.timeouts.reply_s),
    ]


def bulk_open(state: ControlState, event: BulkOpenAsked, now: float) -> list[Command]:
    """A stage's bulk connection says whose it is: the coordinator's bulk to it goes there."""
    name, token = event.message.name, event.message.token
    try:
        link = _attributed(state, name, token, event.user_key)
    except ProtocolError as exc:
        return [Log("warning", "bulk_refused", {"stage": name, "error": str(exc)})]
    link.route = event.routing_id
    interval = state.timeouts.heartbeat_interval_s
    return [
        Log("info", "bulk_opened", {"stage": name}),
        Send(event.routing_id, BulkOpened(name=name), name, 4 * interval),
    ]


def bulk_chunk(
    state: ControlState, event: BulkChunkArrived, now: float
) -> tuple[list[Command], StageSpoke | None]:
    """One chunk: progress of its stage and, once its transfer is whole, the reply it
    carries (to handle as a message on the stage's control connection)."""
    message = event.message
    name, token = message.name, message.token
    reply_s = state.timeouts.reply_s
    try:
        # the transport's own checks of a chunk's counts (they are its framing)
        header = ChunkHeader.from_body(message.body())
    except ProtocolError as exc:
        fields = {"peer": name, "kind": "bulk_chunk", "error": str(exc)}
        return [Log("warning", "dropped_message", fields)], None
    try:
        link = _attributed(state, name, token, event.user_key)
        if len(message.tensors) != 1:
            raise ProtocolError(f"a bulk chunk carries one payload, not {len(message.tensors)}")
        if header.seq == 0:  # announced: judged against what this stage may send now
            link.inbox.budget_bytes = _budget(state, name)
        frames = link.inbox.add(header, payload_view(message.tensors[0]), now=now)
        whole = None if frames is None else _stage_reply(frames, name, state.bulk.cap_bytes)
    except ProtocolError as exc:
        out: list[Command] = [
            Log(
                "warning",
                "dropped_message",
                {
                    "peer": name,
                    "kind": "bulk_chunk",
                    "transfer": header.transfer,
                    "error": str(exc),
                },
            )
        ]
        if state.bulk.refuse_once(event.routing_id, header.transfer):
            refused = BulkRefused(transfer=header.transfer, reason=str(exc))
            out.append(Send(event.routing_id, refused, name, reply_s))
        # a refused chunk's frame (up to 16 MiB, from libzmq's heap) is freed now
        out += freed(sum(t.numel() * t.element_size() for t in message.tensors))
        return out, None
    # progress is liveness: the stage is heard from, and waits on it run on from now
    state.membership.heard_from(name, now)
    out = state.flows.progress(name, now)
    if whole is None:
        return out, None
    out.append(Send(event.routing_id, BulkDone(transfer=header.transfer), name))
    return out, StageSpoke(link.control_route, whole)


def _budget(state: ControlState, name: str) -> int:
    """Stage ``name``'s bulk budget under the current run's plan (issue 33, finding 5:
    a fake stage's four transfers announced at 1 GiB each)."""
    run = getattr(state.current, "run", None)
    state.bulk.plan(run, getattr(getattr(run, "request", None), "model", None))
    member = state.membership.get(name)
    return state.bulk.budget_of(name, None if member is None else member.info.get("memory_mb"))


def _stage_reply(frames: list[memoryview], name: str, cap_bytes: int) -> WireMessage:
    """The reply a whole transfer carries, parsed (as the shell parses a message)."""
    message = decode_typed(frames, max_message_bytes=cap_bytes)
    if not isinstance(message, STAGE_BULK):
        raise ProtocolError(f"{message.KIND!r} is not state a stage sends in bulk")
    if message.name != name:
        raise ProtocolError(f"{name!r} sent state in the name of {message.name!r}")
    return message


# Dropped transfers (or refused chunks) of this many bytes or more have their memory
# handed back (a bytearray grown chunk by chunk, a frame libzmq received, sit in
# glibc's heaps, which keep freed pages): the shell trims once for a burst of asks.
GIVE_BACK_BYTES = 8 << 20


def expire_stalled(state: ControlState, now: float) -> list[Command]:
    """Drop the stages' transfers that had no chunk for ``stall_s`` (issue 33, finding
    5: a stage that opens transfers and goes silent held them until its death)."""
    expired = state.bulk.expire(now)
    if not expired:
        return []
    out: list[Command] = [
        Log(
            "warning",
            "bulk_transfer_expired",
            {
                "stage": e.name,
                "transfer": e.transfer,
                "received": e.received,
                "stall_s": state.bulk.stall_s,
            },
        )
        for e in expired
    ]
    return [*out, *freed(sum(e.received for e in expired))]


def freed(nbytes: int) -> list[Command]:
    """Hand ``nbytes`` of dropped transfers back to the system, when worth a trim."""
    return [GiveBackMemory(nbytes)] if nbytes >= GIVE_BACK_BYTES else []
