"""A send that finds a stage's connection gone, fed to the pure core (issue 33).

A killed stage's TCP connection drops at once, and the ROUTER then refuses to route
to it (``PeerGoneError``); its heartbeat deadline is seconds away. The core suspects
it at once: a run asked for meanwhile is not planned onto the dead connection, and
the stage's restarted process takes its name without a claim on it.
"""

from __future__ import annotations

from typing import Any

from tests._support.coordinator_harness import SPEC, Harness
from zpipe._errors import PeerGoneError
from zpipe.coordinator.events import RegisterAsked, RequestFailed, StageSpoke
from zpipe.coordinator.membership import MemberState
from zpipe.protocol.stage_control import Heartbeat, Register
from zpipe.transport.codec import Message

NAMES = ["a", "b", "c"]
REQUEST: dict[str, Any] = {
    "model": SPEC.to_dict(),
    "dtype": "float32",
    "sink_endpoint": "tcp://client:9",
    "wait_for_stages_s": 0.0,
    "planner": "even",
    "stage_names": NAMES,
}


def _to(h: Harness, routing_id: bytes, kind: str, since: int = 0) -> list[Message]:
    return [s.wire for s in h.sent[since:] if s.to == routing_id and s.wire.kind == kind]


def _register(h: Harness, name: str, routing_id: bytes, endpoint: str) -> None:
    register = Register(name=name, data_endpoint=endpoint, info={"probe_endpoint": endpoint})
    h.feed(RegisterAsked(routing_id, None, register))


def _with_b_gone() -> Harness:
    """a, b, c registered; a run's assign to b found b's connection gone."""
    h = Harness()
    for name in NAMES:
        h.register(name)
    h.client("run_request", **REQUEST)
    assert _to(h, b"b", "assign")
    h.now = 0.2
    h.feed(RequestFailed("b", PeerGoneError("b", "assign"), b"b"))
    return h


def test_the_run_whose_send_failed_says_so_and_the_stage_is_suspect_and_probed() -> None:
    h = _with_b_gone()
    (failed,) = h.to_client("run_failed")
    assert failed.body["error"] == "b is not connected: could not send assign"
    member = h.state.membership.get("b")
    assert member is not None and member.state is MemberState.SUSPECT
    assert _to(h, b"b", "probe")
    (suspect,) = h.events("stage_suspect")
    assert suspect["stage"] == "b" and suspect["reason"] == "connection gone"


def test_a_run_asked_for_at_once_is_not_planned_onto_the_dead_connection() -> None:
    h = _with_b_gone()
    before = len(h.sent)
    h.client("run_request", **REQUEST)
    assert not _to(h, b"b", "assign", before)
    failed = h.to_client("run_failed")
    assert len(failed) == 2 and "stages ['b'] are not registered" in failed[-1].body["error"]


def test_the_restarted_process_takes_the_name_at_once_and_the_next_run_uses_it() -> None:
    h = _with_b_gone()
    before = len(h.sent)
    h.now = 0.4
    _register(h, "b", b"b#2", "tcp://b:7")
    # no claim: the holder's connection is known to be gone, there is nobody to ask
    assert not _to(h, b"b", "probe", before)
    assert _to(h, b"b#2", "registered", before) and not _to(h, b"b#2", "refused", before)
    member = h.state.membership.get("b")
    assert member is not None and member.routing_id == b"b#2"
    assert member.state is MemberState.ALIVE
    assert "connection is gone" in h.events("stage_dead")[0]["reason"]
    before = len(h.sent)
    h.client("run_request", **REQUEST)
    assert _to(h, b"b#2", "assign", before) and not _to(h, b"b", "assign", before)


def test_a_failed_send_on_the_old_connection_leaves_the_restarted_process_alone() -> None:
    h = Harness()
    for name in NAMES:
        h.register(name)
    h.now = 3.5  # b's old process went silent; its new one registers
    for name in NAMES:
        if name != "b":
            h.stage(name, "heartbeat")
    _register(h, "b", b"b#2", "tcp://b:7")
    h.feed(RequestFailed("b", PeerGoneError("b", "probe"), b"b"))
    member = h.state.membership.get("b")
    assert member is not None and member.routing_id == b"b#2"
    assert member.state is MemberState.ALIVE and not h.events("stage_suspect")


def test_a_newcomer_within_the_holders_adaptive_deadline_is_a_claim_not_a_refusal() -> None:
    """Past the configured suspect time but within the holder's own (longer) deadline,
    learnt from its late heartbeats, the newcomer was refused, and a refused stage
    exits: now the holder is asked first, as within the configured time."""
    h = Harness()
    _register(h, "a", b"a#1", "tcp://h:1")
    for beat in range(1, 6):  # heartbeats 2.5 s apart: a slow, starved, live stage
        h.now = 2.5 * beat
        h.feed(StageSpoke(b"a#1", Heartbeat(name="a", metrics={})))
    membership = h.state.membership
    deadline = membership.deadlines("a")[0]
    assert deadline > membership.suspect_after_s + 0.5
    before = len(h.sent)
    h.now += membership.suspect_after_s + 0.25
    _register(h, "a", b"a#2", "tcp://h:2")
    assert not _to(h, b"a#2", "refused", before)
    assert _to(h, b"a#1", "probe", before)  # the holder is asked
    assert h.state.membership.get("a").routing_id == b"a#1"  # type: ignore[union-attr]


def test_a_claim_whose_holder_is_gone_admits_the_newcomer_alive_not_suspect() -> None:
    """The failed send (the claim's probe) is the holder's, whoever takes the name."""
    h = Harness()
    _register(h, "a", b"a#1", "tcp://h:1")
    h.now = 0.5
    _register(h, "a", b"a#2", "tcp://h:2")  # a claim: the holder is probed
    h.feed(RequestFailed("a", PeerGoneError("a", "probe")))  # connection not said
    member = h.state.membership.get("a")
    assert member is not None and member.routing_id == b"a#2"
    assert member.state is MemberState.ALIVE and not member.unreachable
