"""Bulk state apart from liveness: chunking, reassembly, attribution, deadlines. Pure.

The multi-process test (a gather over a slow uplink) is in test_bulk_cluster.py.
"""

from __future__ import annotations

import asyncio
import tracemalloc
from dataclasses import replace
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests._support.coordinator_harness import Harness
from zpipe._errors import ProtocolError, TransportTimeout
from zpipe.config import Timeouts
from zpipe.coordinator.bulk import GIVE_BACK_BYTES, freed
from zpipe.coordinator.bulk_links import BulkLinks
from zpipe.coordinator.commands import AwaitReplies, GiveBackMemory, Send, StartTimer
from zpipe.coordinator.core import CoordinatorCore
from zpipe.coordinator.events import (
    BulkChunkArrived,
    BulkOpenAsked,
    RegisterAsked,
    StageSpoke,
    Tick,
)
from zpipe.coordinator.flows import FlowRunner
from zpipe.coordinator.membership import Membership
from zpipe.coordinator.records import SavedMember, SavedState
from zpipe.coordinator.state import ControlState
from zpipe.protocol.bulk import BulkChunk, BulkDone, BulkOpen, BulkRefused
from zpipe.protocol.stage_control import Heartbeat, Register, Weights
from zpipe.stage.bulk import StageBulk
from zpipe.transport.bulk import (
    MAX_CHUNK_BYTES,
    ChunkHeader,
    Inbox,
    OutgoingTransfer,
    Reassembly,
    chunk_count,
    progress_deadline,
)
from zpipe.transport.codec import Message, decode, encode
from zpipe.transport.emulation import LinkSpec, SharedUplink

# ------------------------------------------------------------ chunks and reassembly


def _chunks(transfer: OutgoingTransfer) -> list[tuple[ChunkHeader, bytes]]:
    return [
        (ChunkHeader.from_body(transfer.header(seq)), bytes(payload))
        for seq, payload in enumerate(transfer.payloads())
    ]


def _whole(frames: list[bytes], chunk_bytes: int) -> list[bytes]:
    transfer = OutgoingTransfer(7, frames, chunk_bytes=chunk_bytes)
    inbox = Inbox(cap_bytes=1 << 30)
    out = None
    for header, payload in _chunks(transfer):
        assert out is None, "whole before its last chunk"
        out = inbox.add(header, payload)
    assert out is not None and inbox.open_transfers == 0
    return [bytes(f) for f in out]


@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=6),
    chunk_bytes=st.integers(1, 256),
)
def test_any_frames_cut_into_any_chunk_size_come_back_exactly(
    sizes: list[int], chunk_bytes: int
) -> None:
    frames = [bytes((i * 7 + j) % 256 for j in range(n)) for i, n in enumerate(sizes)]
    transfer = OutgoingTransfer(1, frames, chunk_bytes=chunk_bytes)
    payloads = list(transfer.payloads())
    assert len(payloads) == transfer.chunks == chunk_count(sum(sizes), chunk_bytes)
    assert all(len(p) == chunk_bytes for p in payloads[:-1])
    assert _whole(frames, chunk_bytes) == frames


def test_a_weights_message_crosses_in_chunks_and_decodes_to_the_same_tensors() -> None:
    tensors = (torch.randn(300, 70), torch.arange(5, dtype=torch.int64), torch.zeros(0))
    body = {"run": 1, "name": "b", "step": 2, "keys": ["w", "i", "e"], "error": ""}
    message = Message("weights", body, epoch=3, tensors=tensors)
    frames = _whole([bytes(f) for f in encode(message)], 4096)
    got = decode(frames)
    assert (got.kind, dict(got.body), got.epoch) == ("weights", body, 3)
    for want, have in zip(tensors, got.tensors, strict=True):
        assert have.dtype == want.dtype and torch.equal(have, want)


def _first(nbytes: int = 10, chunks: int = 2, frames: tuple[int, ...] = (4, 6)) -> ChunkHeader:
    return ChunkHeader(1, 0, chunks, nbytes, frames)


@pytest.mark.parametrize(
    ("first", "problem"),
    [
        (ChunkHeader(1, 1, 2, 10, None), "before chunk 0"),
        (ChunkHeader(1, 0, 2, 10, None), "names no frame sizes"),
        (_first(frames=(4, 5)), "frames of 9 bytes"),
        (_first(nbytes=101, frames=(1, 100)), "exceed the limit of 100"),
        (_first(chunks=11), "11 chunks cannot carry 10 bytes"),
        (_first(chunks=0), "0 chunks cannot carry"),
    ],
)
def test_a_transfer_that_announces_what_cannot_be_is_refused(
    first: ChunkHeader, problem: str
) -> None:
    with pytest.raises(ProtocolError, match=problem):
        Reassembly(first, cap_bytes=100)


def test_more_chunks_than_the_largest_chunk_allows_are_required() -> None:
    nbytes = 3 * MAX_CHUNK_BYTES
    with pytest.raises(ProtocolError, match="2 chunks cannot carry"):
        Reassembly(ChunkHeader(1, 0, 2, nbytes, (nbytes,)), cap_bytes=nbytes)


@pytest.mark.parametrize(
    ("chunks", "problem"),
    [
        ([(ChunkHeader(1, 1, 2, 10), b"x" * 5)], "chunk 1 where 0 was due"),
        ([(_first(), b"x" * 5), (ChunkHeader(1, 0, 2, 10), b"y")], "where 1 was due"),
        ([(_first(), b"x" * 5), (ChunkHeader(1, 1, 3, 10), b"y" * 5)], "changes its totals"),
        ([(_first(), b"x" * 5), (ChunkHeader(1, 1, 2, 10), b"y" * 4)], "leaves 1 bytes missing"),
        ([(_first(), b"x" * 11)], "11 bytes"),
        ([(_first(), b"")], "0 bytes"),
        ([(_first(), b"x" * 10)], "too few bytes left"),
        ([(_first(), b"x" * 5), (ChunkHeader(1, 1, 2, 10, (4, 6)), b"y" * 5)], "sizes again"),
        ([(ChunkHeader(2, 0, 2, 10, (4, 6)), b"x" * 5)], "given to 1"),
    ],
)
def test_chunks_out_of_order_or_of_the_wrong_size_are_refused(
    chunks: list[tuple[ChunkHeader, bytes]], problem: str
) -> None:
    reassembly = Reassembly(_first(), cap_bytes=100)
    with pytest.raises(ProtocolError, match=problem):
        for header, payload in chunks:
            reassembly.add(header, payload)


def test_what_a_peer_announces_allocates_nothing_until_its_bytes_arrive() -> None:
    gigabyte = 1 << 30
    tracemalloc.start()
    try:
        reassembly = Reassembly(ChunkHeader(1, 0, 1024, gigabyte, (gigabyte,)), cap_bytes=2 << 30)
        reassembly.add(ChunkHeader(1, 0, 1024, gigabyte), b"x" * 1000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_a_bad_chunk_ends_its_transfer_and_later_chunks_of_it_are_refused() -> None:
    inbox = Inbox(cap_bytes=100)
    inbox.add(ChunkHeader(1, 0, 3, 12, (12,)), b"a" * 4)
    with pytest.raises(ProtocolError, match="chunk 2 where 1 was due"):
        inbox.add(ChunkHeader(1, 2, 3, 12), b"c" * 4)
    with pytest.raises(ProtocolError, match="never begun"):
        inbox.add(ChunkHeader(1, 1, 3, 12), b"b" * 4)
    # the sender may start it over
    inbox.add(ChunkHeader(1, 0, 1, 2, (2,)), b"ok")


def test_interleaved_transfers_are_kept_apart_and_the_oldest_half_done_gives_way() -> None:
    inbox = Inbox(cap_bytes=100, max_open=2)
    assert inbox.add(ChunkHeader(1, 0, 2, 4, (4,)), b"ab") is None
    assert inbox.add(ChunkHeader(2, 0, 2, 4, (4,)), b"xy") is None
    (second,) = inbox.add(ChunkHeader(2, 1, 2, 4), b"zw") or []
    (first,) = inbox.add(ChunkHeader(1, 1, 2, 4), b"cd") or []
    assert (bytes(first), bytes(second)) == (b"abcd", b"xyzw")
    # a sender cancelled mid-transfer leaves it half-done: the oldest makes room
    for transfer in (3, 4, 5):
        assert inbox.add(ChunkHeader(transfer, 0, 2, 2, (2,)), b"h") is None
    assert inbox.open_transfers == 2 and inbox.abandoned == 1
    with pytest.raises(ProtocolError, match="never begun"):
        inbox.add(ChunkHeader(3, 1, 2, 2), b"i")


@pytest.mark.parametrize(
    "body",
    [
        {"transfer": -1, "seq": 0, "chunks": 1, "bytes": 0},
        {"transfer": 1, "seq": True, "chunks": 1, "bytes": 0},
        {"transfer": 1, "seq": 0, "chunks": 1, "bytes": 0, "frames": [1, -1]},
        {"transfer": 1, "seq": 0, "chunks": 1, "bytes": 0, "frames": []},
        {"transfer": 1, "seq": 0, "chunks": 1, "bytes": 0, "frames": ["1"]},
    ],
)
def test_chunk_headers_with_bad_numbers_are_refused(body: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError, match="bulk_chunk"):
        ChunkHeader.from_body(body)


# ------------------------------------------------------------ deadlines


def test_a_deadline_runs_from_the_latest_progress_not_the_start() -> None:
    assert progress_deadline(10.0, 5.0, None) == 15.0
    assert progress_deadline(10.0, 5.0, 8.0) == 15.0  # progress before the wait: none
    assert progress_deadline(10.0, 5.0, 40.0) == 45.0


def test_a_wait_on_a_transfer_that_keeps_moving_never_times_out() -> None:
    runner = FlowRunner()
    seen: list[Any] = []

    def gathering():  # type: ignore[no-untyped-def]
        try:
            seen.append((yield AwaitReplies(("a", "b"), Weights, 5.0, "weights")))
        except TransportTimeout as exc:
            seen.append(exc)

    (timer,) = runner.start(gathering(), 0.0)
    assert isinstance(timer, StartTimer) and timer.delay_s == 5.0
    now = 0.0
    for _ in range(20):  # 60 s of a transfer from b, a chunk every 3 s
        now += 3.0
        runner.progress("b", now)
        due = runner.timer(timer.tag, now) if now >= 5.0 else []
        if due:
            (timer,) = due
            assert isinstance(timer, StartTimer) and timer.delay_s == pytest.approx(5.0)
    from_a = Weights(run=0, name="a", step=0, keys=[], error="")
    from_b = Weights(run=0, name="b", step=0, keys=[], error="")
    assert runner.reply("a", from_a, now) == []
    runner.reply("b", from_b, now + 1)
    assert seen == [{"a": from_a, "b": from_b}]


def test_a_wait_whose_transfer_stopped_times_out_timeout_s_after_its_last_chunk() -> None:
    runner = FlowRunner()
    seen: list[Any] = []

    def gathering():  # type: ignore[no-untyped-def]
        try:
            yield AwaitReplies(("b",), Weights, 5.0, "weights")
        except TransportTimeout as exc:
            seen.append(exc)

    (timer,) = runner.start(gathering(), 0.0)
    runner.progress("b", 4.0)
    (again,) = runner.timer(timer.tag, 5.0)
    assert isinstance(again, StartTimer) and again.delay_s == pytest.approx(4.0)
    assert runner.timer(again.tag, 9.0) == [] and "weights from b" in str(seen[0])


# ------------------------------------------------------------ attribution


def _chunk_events(
    message: Message, name: str, token: str, route: bytes = b"bulk", key: str | None = None
) -> list[BulkChunkArrived]:
    transfer = OutgoingTransfer(1, encode(message), chunk_bytes=1000)
    return [
        BulkChunkArrived(route, key, BulkChunk.from_message(chunk))
        for chunk in transfer.messages(name=name, token=token)
    ]


def _token(harness: Harness, name: str) -> str:
    (registered,) = harness.to(name, "registered")
    return str(registered.body["bulk_token"])


def _register(harness: Harness, name: str, token: str, key: str | None = None) -> None:
    register = Register(name=name, data_endpoint=f"tcp://{name}:1", info={})
    harness.feed(RegisterAsked(name.encode(), key, register, bulk_token=token))


WEIGHTS = Message(
    "weights",
    {"run": 1, "name": "b", "step": 0, "keys": ["w"], "error": ""},
    tensors=(torch.randn(40, 50),),
)


def test_a_registration_sent_again_on_one_connection_keeps_its_token() -> None:
    harness = Harness()
    _register(harness, "b", "first")
    _register(harness, "b", "second")  # the stage's retry, its first answer being slow
    assert [m.body["bulk_token"] for m in harness.to("b", "registered")] == ["first", "first"]
    register = Register(name="b", data_endpoint="tcp://b:1", info={})
    # another connection under the name (a new process, once the old one is dead)
    member = harness.state.membership.get("b")
    assert member is not None
    harness.state.membership.declare_dead("b", "gone", harness.now)
    harness.feed(RegisterAsked(b"b-again", None, register, bulk_token="third"))
    assert harness.to("b", "registered")[-1].body["bulk_token"] == "third"


def test_a_stage_s_chunks_are_progress_and_its_whole_reply_is_handled_as_sent() -> None:
    harness = Harness(interval=1.0)
    _register(harness, "b", "tok-b")
    assert _token(harness, "b") == "tok-b"
    events = _chunk_events(WEIGHTS, "b", "tok-b")
    assert len(events) == 9
    for event in events[:-1]:
        harness.now += 1.0  # far longer than the suspect time, all told
        harness.feed(event)
        harness.feed(Tick())
    member = harness.state.membership.get("b")
    assert member is not None and member.last_seen == harness.now
    assert not harness.events("stage_dead") and not harness.to("b", "probe")
    out = harness.feed(events[-1])
    # a late reply (no flow asked) is logged as such: it reached the core as weights
    assert [c.wire.kind for c in out if isinstance(c, Send)] == ["bulk_done"]
    assert harness.events("late_reply") == [{"stage": "b", "kind": "weights", "run": 1}]


@pytest.mark.parametrize(
    ("name", "token", "problem"),
    [
        ("b", "guessed", "a token that is not its own"),
        ("nobody", "tok-b", "not a registered stage"),
    ],
)
def test_chunks_in_a_stage_s_name_without_its_token_are_refused(
    name: str, token: str, problem: str
) -> None:
    harness = Harness()
    _register(harness, "b", "tok-b")
    before = harness.state.membership.get("b")
    seen = before.last_seen if before is not None else None
    harness.now += 1.0
    for event in _chunk_events(WEIGHTS, name, token, route=b"outsider")[:3]:
        harness.feed(event)
    dropped = harness.events("dropped_message")
    assert len(dropped) == 3 and problem in dropped[0]["error"]
    refusals = [s for s in harness.sent if s.wire.kind == "bulk_refused"]
    assert len(refusals) == 1 and refusals[0].to == b"outsider"  # answered once
    member = harness.state.membership.get("b")
    assert member is not None and member.last_seen == seen  # no liveness from it


def test_with_keys_a_chunk_must_come_from_the_stage_s_own_key() -> None:
    timeouts = Timeouts()
    membership = Membership(heartbeat_interval_s=1.0, suspect_after_intervals=3, probe_intervals=2)
    state = ControlState(
        timeouts=timeouts, membership=membership, public_keys={"b": b"KEY-B", "c": b"KEY-C"}
    )
    core = CoordinatorCore(state)
    register = Register(name="b", data_endpoint="tcp://b:1", info={})
    core.on_event(RegisterAsked(b"b", "KEY-B", register, bulk_token="t"), 0.0)
    wrong = core.on_event(_chunk_events(WEIGHTS, "b", "t", key="KEY-C")[0], 1.0)
    assert any("not b.key" in str(getattr(c, "fields", {})) for c in wrong)
    right = core.on_event(BulkOpenAsked(b"bulk-b", "KEY-B", BulkOpen(name="b", token="t")), 1.0)
    assert [c.wire.kind for c in right if isinstance(c, Send)] == ["bulk_opened"]
    link = state.bulk.get("b")
    assert link is not None and link.route == b"bulk-b"
    # the coordinator's own state for b (an assignment with tensors) now goes there
    assign = Message("assign", {}, tensors=(torch.ones(2),))
    assert state.bulk.route_for(b"b", assign) is link
    assert state.bulk.route_for(b"b", Message("heartbeat_ack")) is None


def test_a_stage_restored_from_disk_gets_a_token_when_it_first_speaks() -> None:
    harness = Harness()
    harness.state.new_token = lambda: "renewed"
    saved = SavedState(0, 0, (SavedMember("b", b"b", "tcp://b:1", {}, None),), None)
    harness.core.restore(saved, None, harness.now)
    harness.feed(StageSpoke(b"b", Heartbeat(name="b", metrics={})))
    assert [m.body["bulk_token"] for m in harness.to("b", "registered")] == ["renewed"]
    harness.feed(StageSpoke(b"b", Heartbeat(name="b", metrics={})))  # once
    assert len(harness.to("b", "registered")) == 1
    for event in _chunk_events(WEIGHTS, "b", "renewed"):
        harness.feed(event)
    assert harness.events("late_reply") == [{"stage": "b", "kind": "weights", "run": 1}]


def test_a_chunk_with_a_negative_count_is_dropped_and_the_core_goes_on() -> None:
    harness = Harness()
    _register(harness, "b", "tok-b")
    (event,) = _chunk_events(Message("heartbeat_ack"), "b", "tok-b")
    bad = replace(event.message, seq=-1)
    harness.feed(BulkChunkArrived(b"bulk", None, bad))
    assert "seq must be an integer >= 0" in harness.events("dropped_message")[-1]["error"]


def test_a_whole_transfer_in_another_stage_s_name_is_refused() -> None:
    harness = Harness()
    _register(harness, "c", "tok-c")
    for event in _chunk_events(WEIGHTS, "c", "tok-c"):  # WEIGHTS names b
        harness.feed(event)
    assert "in the name of 'b'" in harness.events("dropped_message")[-1]["error"]


# ------------------------------------------------------------ the stage's side


class _NoSocket:
    """StageBulk.received never sends."""


def _stage_bulk() -> StageBulk:
    uplink = SharedUplink(LinkSpec()).connection()
    return StageBulk(
        name="b",
        socket=_NoSocket(),  # type: ignore[arg-type]
        uplink=uplink,
        send_timeout_s=1.0,
        max_message_bytes=1 << 30,
    )


def test_a_stage_reassembles_the_coordinator_s_state_and_refuses_other_tokens() -> None:
    bulk = _stage_bulk()
    assert bulk.registered("tok") and bulk.usable
    transfer = OutgoingTransfer(5, encode(WEIGHTS), chunk_bytes=512)
    chunks = transfer.messages(name="b", token="tok")
    results = [bulk.received(BulkChunk.from_message(c)) for c in chunks]
    assert len(results) > 2 and all(r.message is None for r in results[:-1])
    whole = results[-1].message
    assert whole is not None and torch.equal(whole.tensors[0], WEIGHTS.tensors[0])
    stray = next(OutgoingTransfer(6, encode(WEIGHTS)).messages(name="b", token="old"))
    with pytest.raises(ProtocolError, match="another stage or registration"):
        bulk.received(BulkChunk.from_message(stray))


def test_a_refused_transfer_is_handed_back_for_the_control_connection() -> None:
    bulk = _stage_bulk()
    bulk.registered("tok")
    bulk._unsettled[2] = (WEIGHTS, "older")  # sent before the latest registration
    bulk._unsettled[3] = (WEIGHTS, "tok")  # sent, not yet confirmed
    got = bulk.received(BulkRefused(transfer=2, reason="old token"))
    assert got.resend is WEIGHTS and bulk.usable  # the current token still stands
    got = bulk.received(BulkRefused(transfer=3, reason="restarted"))
    assert got.resend is WEIGHTS and not bulk.usable
    assert bulk.received(BulkDone(transfer=9)).resend is None


# ------------------------------------------------------------ the emulated uplink


def test_a_heartbeat_waits_behind_state_on_its_own_connection_only() -> None:
    async def order(shared_connection: bool) -> list[str]:
        uplink = SharedUplink(LinkSpec(bandwidth_mbps=8.0))  # 1 MB/s: 64 KiB in 65 ms
        control = uplink.connection()
        bulk = control if shared_connection else uplink.connection()
        done: list[str] = []

        async def sent(label: str) -> None:
            done.append(label)

        state = asyncio.create_task(bulk.send(400_000, lambda: sent("state")))
        await asyncio.sleep(0.01)  # the state is on the link
        await control.send(100, lambda: sent("heartbeat"))
        await state
        return done

    assert asyncio.run(order(shared_connection=True)) == ["state", "heartbeat"]
    assert asyncio.run(order(shared_connection=False)) == ["heartbeat", "state"]


def test_a_dead_stage_s_half_sent_transfers_are_dropped() -> None:
    """Issue 33 finding 5: a stage opened transfers announced at 1 GiB, sent part of
    each and went silent; the coordinator kept 900 MB after its stage_dead."""
    harness = Harness(interval=1.0)
    for name in ("b", "c"):
        _register(harness, name, f"tok-{name}")
        weights = replace(WEIGHTS, body={**WEIGHTS.body, "name": name})
        for event in _chunk_events(weights, name, f"tok-{name}")[:3]:  # a third, then silence
            harness.feed(event)
    links = harness.state.bulk
    b, c = links.get("b"), links.get("c")
    assert b is not None and c is not None
    assert b.inbox.open_transfers == c.inbox.open_transfers == 1
    harness.advance(30.0, alive=("c",))  # b stops heartbeating: declared dead
    assert [e["stage"] for e in harness.events("stage_dead")] == ["b"]
    assert b.inbox.open_transfers == 0
    assert c.inbox.open_transfers == 1  # a live stage's transfer stays


def test_a_stage_s_transfers_past_its_budget_are_refused_and_it_is_told_once() -> None:
    harness = Harness(interval=1.0)
    first = _chunk_events(WEIGHTS, "b", "tok-b")
    # room for one such transfer and a half
    harness.state.bulk.budget_bytes = first[0].message.nbytes * 3 // 2
    _register(harness, "b", "tok-b")
    second = [
        BulkChunkArrived(e.routing_id, e.user_key, replace(e.message, transfer=2)) for e in first
    ]
    harness.feed(first[0])
    out = harness.feed(second[0]) + harness.feed(second[1])
    refused = [c.message for c in out if isinstance(c, Send)]
    assert len(refused) == 1 and isinstance(refused[0], BulkRefused)
    assert refused[0].transfer == 2 and "past its budget" in refused[0].reason
    link = harness.state.bulk.get("b")
    assert link is not None and link.inbox.held_bytes == first[0].message.nbytes
    for event in first[1:]:  # the first goes on, and arrives whole
        out = harness.feed(event)
    assert [c.wire.kind for c in out if isinstance(c, Send)] == ["bulk_done"]


def test_a_live_stage_s_transfer_without_a_chunk_for_stall_s_is_dropped_at_a_tick() -> None:
    harness = Harness(interval=1.0)
    harness.state.bulk.stall_s = 5.0
    _register(harness, "b", "tok-b")
    events = _chunk_events(WEIGHTS, "b", "tok-b")
    harness.feed(events[0])
    harness.advance(4.5, alive=("b",))
    link = harness.state.bulk.get("b")
    assert link is not None and link.inbox.open_transfers == 1
    harness.advance(1.0, alive=("b",))  # still heartbeating, but the transfer stalled
    assert link.inbox.open_transfers == 0
    (expired,) = harness.events("bulk_transfer_expired")
    assert expired["stage"] == "b" and expired["received"] == events[0].message.tensors[0].numel()
    assert not harness.events("stage_dead")
    out = harness.feed(events[1])  # its next chunk: refused, and the stage told
    assert [c.wire.kind for c in out if isinstance(c, Send)] == ["bulk_refused"]
    for event in _chunk_events(WEIGHTS, "b", "tok-b")[:-1]:  # sent again, whole
        harness.feed(event)
    out = harness.feed(events[-1])
    assert [c.wire.kind for c in out if isinstance(c, Send)] == ["bulk_done"]


def test_dropping_a_big_half_sent_transfer_hands_its_memory_back() -> None:
    assert freed(GIVE_BACK_BYTES) == [GiveBackMemory(GIVE_BACK_BYTES)]
    assert freed(GIVE_BACK_BYTES - 1) == []


@pytest.mark.parametrize(
    ("memory_mb", "budget"),
    [(None, 1 << 30), (100, 200 << 20), (1e6, 1 << 30), (0, 1 << 30), (float("nan"), 1 << 30),
     (True, 1 << 30), ("100", 1 << 30)],
)  # fmt: skip
def test_a_stage_s_budget_is_at_most_twice_the_memory_it_reports(
    memory_mb: object, budget: int
) -> None:
    links = BulkLinks(cap_bytes=1 << 30)
    links.issue("b", "tok", b"b", memory_mb=memory_mb)
    link = links.get("b")
    assert link is not None and link.inbox.budget_bytes == budget


def test_a_stage_that_reports_little_memory_gets_a_budget_to_match_at_registration() -> None:
    harness = Harness()
    register = Register(name="b", data_endpoint="tcp://b:1", info={"memory_mb": 64})
    harness.feed(RegisterAsked(b"b", None, register, bulk_token="tok-b"))
    link = harness.state.bulk.get("b")
    assert link is not None and link.inbox.budget_bytes == 128 << 20
