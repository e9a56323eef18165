"""A client's ``run_request`` and ``run_go`` sent again are answered once.

The client sends them again when its connection to the coordinator is made again
while it waits (a coordinator SIGKILLed during admission lost the request, and
the client's ``fit`` waited 340 s for a ``run_ready`` nothing would send: issue 33,
bench/chaos.py). A copy of a request the coordinator is answering, or answered,
gets that answer, never a second run; a request a killed coordinator lost is
admitted fresh by the restarted one. Pure: the in-process coordinator fed events
(with a real state directory where a restart is the point).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests._support.coordinator_harness import CLIENT, SPEC, Harness, typed
from tests._support.saving_harness import SavingHarness
from zpipe.coordinator.commands import ReachClient
from zpipe.coordinator.events import ClientRequest
from zpipe.coordinator.persistence import StateStore

NAMES = ["a", "b", "c"]


def _request(h: Harness, request_id: str | None = "req-1", **extra: Any) -> None:
    body: dict[str, Any] = {
        "model": SPEC.to_dict(), "dtype": "float32", "sink_endpoint": "tcp://client:9",
        "wait_for_stages_s": 0.0, "stage_names": NAMES, "planner": "even", **extra,
    }  # fmt: skip
    if request_id is not None:
        body["request_id"] = request_id
    h.client("run_request", **body)


def _registered(h: Harness) -> Harness:
    for name in NAMES:
        h.register(name)
    return h


def _assigned(h: Harness) -> int:
    return sum(len(h.to(name, "assign")) for name in NAMES)


def test_a_copy_sent_while_the_run_is_admitted_shares_its_answer() -> None:
    h = _registered(Harness())
    _request(h)
    run = h.core.run
    assert run is not None and _assigned(h) == 3
    _request(h)  # the client reconnected before the stages were ready
    assert h.core.run is run and _assigned(h) == 3  # no second run, no new assignment
    assert [e["stands"] for e in h.events("run_request_repeated")] == ["admitting"]
    h.answer_all("ready", NAMES, run=run.run, build_s=0.01)
    # one answer: a second would be read as the answer to the client's next request
    assert [r.body["run"] for r in h.to_client("run_ready")] == [run.run]


def test_a_copy_sent_after_the_answer_gets_the_same_answer_again() -> None:
    h = _registered(Harness())
    _request(h)
    run = h.core.run
    assert run is not None
    h.answer_all("ready", NAMES, run=run.run, build_s=0.01)
    (first,) = h.to_client("run_ready")
    _request(h)  # the run_ready was lost with the connection
    assert h.core.run is run and _assigned(h) == 3
    again = h.to_client("run_ready")
    assert len(again) == 2 and again[1].body == first.body and again[1].epoch == first.epoch


def test_a_new_request_of_the_same_client_is_a_new_run() -> None:
    """A training run's resume or re-balance: the client's next request, another id."""
    h = _registered(Harness())
    _request(h, "req-1")
    first = h.core.run
    assert first is not None
    h.answer_all("ready", NAMES, run=first.run, build_s=0.01)
    _request(h, "req-2")
    second = h.core.run
    assert second is not None and second.run > first.run and _assigned(h) == 6


def test_requests_without_an_id_are_each_a_run_as_before() -> None:
    """An older client's requests (never sent again) are not taken for copies."""
    h = _registered(Harness())
    _request(h, None)
    first = h.core.run
    _request(h, None)
    second = h.core.run
    assert first is not None and second is not None and second.run > first.run


def test_a_copy_of_run_go_shares_its_answer_and_one_after_it_gets_it_again() -> None:
    h = _registered(Harness())
    _request(h)
    run = h.core.run
    assert run is not None
    h.answer_all("ready", NAMES, run=run.run, build_s=0.01)
    h.client("run_go", run=run.run)
    h.client("run_go", run=run.run)  # sent again while the stages connect
    assert all(len(h.to(name, "connect")) == 1 for name in NAMES)
    h.answer_all("connected", NAMES, run=run.run)
    assert [r.body["run"] for r in h.to_client("run_started")] == [run.run]
    h.client("run_go", run=run.run)  # the run_started was lost: the same answer
    assert all(len(h.to(name, "connect")) == 1 for name in NAMES)
    started = h.to_client("run_started")
    assert len(started) == 2 and started[1].body == started[0].body
    assert [e["run"] for e in h.events("run_go_repeated")] == [run.run]


def test_a_request_lost_with_a_killed_coordinator_is_admitted_fresh(tmp_path: Path) -> None:
    """Killed after the assignments, before run_ready: the file keeps no run, and the
    copy the client sends when it reconnects starts the run anew, under a new id."""
    h = _registered(SavingHarness(StateStore(tmp_path / "state")))
    _request(h)
    lost = h.core.run
    assert lost is not None and h.to_client("run_ready") == []
    again = h.restarted()
    _request(again)  # the same request, sent again on reconnecting
    run = again.core.run
    assert run is not None and run.run > lost.run
    assert [m.body["run"] for m in again.to("a", "assign")] == [run.run]
    again.answer_all("ready", NAMES, run=run.run, build_s=0.01)
    assert [r.body["run"] for r in again.to_client("run_ready")] == [run.run]
    again.client("run_go", run=run.run)
    again.answer_all("connected", NAMES, run=run.run)
    assert [r.body["run"] for r in again.to_client("run_started")] == [run.run]


def test_a_request_answered_before_the_kill_gets_the_saved_answer(tmp_path: Path) -> None:
    """Killed once run_ready was saved (it may never have reached the client): the
    restarted coordinator answers the copy from the file, and assigns nothing."""
    h = _registered(SavingHarness(StateStore(tmp_path / "state")))
    _request(h)
    run = h.core.run
    assert run is not None
    h.answer_all("ready", NAMES, run=run.run, build_s=0.01)
    (ready,) = h.to_client("run_ready")
    again = h.restarted()
    _request(again)
    assert again.core.run is not None and again.core.run.run == run.run
    assert _assigned(again) == 0
    (answer,) = again.to_client("run_ready")
    assert answer.body == ready.body and answer.epoch == ready.epoch
    # and the run_go the client then sends connects the run the file kept
    again.client("run_go", run=run.run)
    again.answer_all("connected", NAMES, run=run.run)
    assert [r.body["run"] for r in again.to_client("run_started")] == [run.run]


def test_a_run_go_answered_before_the_kill_is_answered_again(tmp_path: Path) -> None:
    h = SavingHarness(StateStore(tmp_path / "state"))
    run = h.start_stream(NAMES)
    again = h.restarted()
    again.client("run_go", run=run)  # run_started lost with the killed process
    assert all(again.to(name, "connect") == [] for name in NAMES)
    assert [r.body["run"] for r in again.to_client("run_started")] == [run]


# ---------------------------------------------------------------- one run at a time

OTHER = b"client-other"


def _other_request(h: Harness, request_id: str = "other-1") -> None:
    body = {
        "model": SPEC.to_dict(), "dtype": "float32", "sink_endpoint": "tcp://other:9",
        "wait_for_stages_s": 0.0, "stage_names": NAMES, "planner": "even",
        "request_id": request_id,
    }  # fmt: skip
    h.feed(ClientRequest(OTHER, None, typed("run_request", body)))  # type: ignore[arg-type]


def _to_other(h: Harness, kind: str) -> list[Any]:
    return [s.wire for s in h.sent if s.to == OTHER and s.wire.kind == kind]


def test_another_clients_request_is_refused_while_a_run_is_in_flight() -> None:
    """It displaced the stream silently; its client learnt at its next request that
    "run 1 is not the current run" (bench/chaos.py)."""
    h = Harness()
    run = h.start_stream(NAMES)
    _other_request(h)
    (refused,) = _to_other(h, "run_failed")
    assert refused.body["in_flight"] == run and f"run {run} " in refused.body["error"]
    assert h.core.run is not None and h.core.run.run == run  # the stream goes on
    assert _assigned(h) == 3 and h.events("run_replaced") == []
    assert [e["in_flight"] for e in h.events("run_refused")] == [run]
    h.client("run_end", run=run)  # and ends as usual
    h.answer_all("metrics", NAMES, run=run)
    assert [r.body["run"] for r in h.to_client("run_report")] == [run]


def test_another_clients_request_is_admitted_once_the_run_ended() -> None:
    h = Harness()
    run = h.start_stream(NAMES)
    h.client("run_end", run=run)  # being answered: the stages' metrics not yet in
    _other_request(h)
    assert _to_other(h, "run_failed") == []
    second = h.core.run
    assert second is not None and second.run > run


def test_a_run_broken_by_a_death_is_not_in_flight() -> None:
    """A stream without recovery whose stage died: nobody will go on with it."""
    h = Harness(ack_notices=True)
    run = h.start_stream(NAMES)
    h.advance(6.5, alive=("a", "c"))  # b dies
    assert [e["stage"] for e in h.events("stage_dead")] == ["b"]
    h.register("b")
    _other_request(h)
    assert _to_other(h, "run_failed") == []
    assert h.core.run is not None and h.core.run.run > run


def test_a_stream_being_recovered_is_in_flight() -> None:
    h = Harness()
    names = ["a", "b", "c", "d"]
    run = h.start_stream(names, recover=True)
    h.advance(6.5, alive=("a", "c", "d"))  # b dies: re-planned, survivors not ready yet
    _other_request(h)
    (refused,) = _to_other(h, "run_failed")
    assert refused.body["in_flight"] == run


def test_the_same_clients_new_request_replaces_its_run() -> None:
    """A training run's resume or re-balance, or a retry after a failure."""
    h = Harness()
    run = h.start_stream(NAMES)
    _request(h, "req-2")
    assert h.to_client("run_failed") == []
    assert h.core.run is not None and h.core.run.run > run
    assert [e["previous"] for e in h.events("run_replaced")] == [run]


# ---------------------------------------------------------------- a client that is gone


def test_the_refusal_first_looks_whether_the_runs_client_is_there() -> None:
    """A live client's run is never taken: it gets a progress notice it drops."""
    h = Harness()
    run = h.start_stream(NAMES)
    _other_request(h)
    (look,) = [j for j in h.jobs if isinstance(j, ReachClient)]
    assert look.to == CLIENT and look.message.KIND == "progress"
    assert look.message.run == run  # type: ignore[attr-defined]
    (refused,) = _to_other(h, "run_failed")
    assert refused.body["in_flight"] == run
    assert f"end-run --coordinator ENDPOINT {run}" in refused.body["error"]
    assert h.core.run is not None and h.core.run.run == run and h.events("run_abandoned") == []


def test_a_run_whose_client_is_gone_ends_and_the_request_is_admitted() -> None:
    """A client SIGKILLed never sends run_end: its run would block everyone for ever."""
    h = Harness()
    run = h.start_stream(NAMES)
    h.gone.add(CLIENT)  # its connection dropped
    _other_request(h)
    assert [e["run"] for e in h.events("run_abandoned")] == [run]
    assert [r["run"] for r in h.records if r["event"] == "run_abandoned"] == [run]
    # ended as run_end ends it: the stages' metrics first, the run then over
    assert all(len(h.to(n, "metrics_request")) == 1 for n in NAMES)
    assert h.core.run is not None and h.core.run.run == run
    h.answer_all("metrics", NAMES, run=run)
    second = h.core.run
    assert second is not None and second.run > run and second.client == OTHER
    assert _to_other(h, "run_failed") == [] and h.to_client("run_report") == []
    h.answer_all("ready", NAMES, run=second.run, build_s=0.01)
    assert [r.body["run"] for r in _to_other(h, "run_ready")] == [second.run]


def test_a_copy_sent_while_the_gone_clients_run_ends_shares_the_answer() -> None:
    h = Harness()
    run = h.start_stream(NAMES)
    h.gone.add(CLIENT)
    _other_request(h)
    _other_request(h)  # sent again (reconnected) while the stages' metrics come in
    h.answer_all("metrics", NAMES, run=run)
    second = h.core.run
    assert second is not None and second.run > run
    assert len(h.events("run_abandoned")) == 1
    h.answer_all("ready", NAMES, run=second.run, build_s=0.01)
    assert [r.body["run"] for r in _to_other(h, "run_ready")] == [second.run]


def test_a_third_client_waits_on_the_run_admitted_after_the_gone_one() -> None:
    h = Harness()
    run = h.start_stream(NAMES)
    h.gone.add(CLIENT)
    _other_request(h)
    h.answer_all("metrics", NAMES, run=run)
    second = h.core.run
    assert second is not None
    h.answer_all("ready", NAMES, run=second.run, build_s=0.01)
    third = b"client-third"
    body = {
        "model": SPEC.to_dict(), "dtype": "float32", "sink_endpoint": "tcp://third:9",
        "wait_for_stages_s": 0.0, "stage_names": NAMES, "planner": "even",
        "request_id": "third-1",
    }  # fmt: skip
    h.feed(ClientRequest(third, None, typed("run_request", body)))  # type: ignore[arg-type]
    refused = [s.wire for s in h.sent if s.to == third and s.wire.kind == "run_failed"]
    assert [r.body["in_flight"] for r in refused] == [second.run]
    assert h.core.run is second


def test_a_restarted_coordinator_gives_the_gone_clients_run_way_too(tmp_path: Path) -> None:
    """The run is saved and restored; its killed client never reconnects."""
    h = SavingHarness(StateStore(tmp_path / "state"))
    run = h.start_stream(NAMES)
    again = h.restarted()
    for name in NAMES:  # the stages speak to the new process
        again.stage(name, "heartbeat")
    assert again.core.run is not None and again.core.run.run == run
    again.gone.add(CLIENT)
    _other_request(again)
    assert [e["run"] for e in again.events("run_abandoned")] == [run]
    again.answer_all("metrics", NAMES, run=run)
    second = again.core.run
    assert second is not None and second.run > run and second.client == OTHER
