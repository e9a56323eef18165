"""A client's notices across a coordinator restart (zpipe.coordinator.notices): the
ones it had not acknowledged are saved and sent again by the restarted coordinator,
and the run's numbering goes on after them. Pure: the in-process coordinator and a
real state directory, no sockets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests._support.coordinator_harness import CLIENT, Harness
from zpipe.coordinator.commands import Persist, Send
from zpipe.coordinator.notices import NoticeOutbox, number_notices
from zpipe.coordinator.persistence import StateFileError, StateStore, write_messages
from zpipe.coordinator.records import SavedNotices, SavedState
from zpipe.protocol import storage
from zpipe.protocol.client_control import RunReplanned, StageFailed

NAMES = ["a", "b", "c", "d"]


def _restarted(h: Harness, store: StateStore, **harness: Any) -> Harness:
    """What a coordinator started on ``store`` takes over from ``h`` (through the file)."""
    store.save_state(h.core.saved_state())
    again = Harness(**harness)
    again.core.restore(store.load_state(), None, again.now)
    return again


def test_a_notice_the_client_had_not_acknowledged_is_sent_again_after_a_restart(
    tmp_path: Path,
) -> None:
    store = StateStore(tmp_path / "state")
    h = Harness(ack_notices=False)  # the client is cut off when b dies
    run = h.start_stream(NAMES)
    h.advance(6.5, alive=("a", "c", "d"))
    (missed,) = h.to_client("stage_failed")
    assert (missed.body["stage"], missed.body["seq"]) == ("b", 1)

    again = _restarted(h, store, ack_notices=False)
    assert again.core.run is not None and again.core.run.run == run
    again.advance(1.0, alive=("a", "c", "d"))
    resent = again.to_client("stage_failed")
    assert resent, "the restarted coordinator forgot the notice"
    assert {(n.body["run"], n.body["stage"], n.body["seq"]) for n in resent} == {(run, "b", 1)}
    assert all(s.to == CLIENT for s in again.sent if s.wire.kind == "stage_failed")
    # once acknowledged it is not sent again, and that is saved too
    commands = again.client("notice_ack", run=run, seq=1)
    assert Persist(soon=True) in commands
    sent = len(again.to_client("stage_failed"))
    again.advance(6.0, alive=("a", "c", "d"))
    assert len(again.to_client("stage_failed")) == sent
    saved = again.core.saved_state().notices
    assert saved == SavedNotices(run, 1, ())


def test_the_runs_next_notice_after_a_restart_gets_a_new_number(tmp_path: Path) -> None:
    """The client drops a number it has seen: a restarted coordinator that numbered
    from 1 again would have c's death dropped as a repeat of b's."""
    store = StateStore(tmp_path / "state")
    h = Harness()  # a connected client: it acknowledges b's notice at once
    run = h.start_stream(NAMES)
    h.advance(6.5, alive=("a", "c", "d"))
    assert [n.body["seq"] for n in h.to_client("stage_failed")] == [1]

    again = _restarted(h, store)
    again.advance(8.0, alive=("a", "d"))  # c dies after the restart
    failed = [(n.body["stage"], n.body["seq"]) for n in again.to_client("stage_failed")]
    assert failed == [("c", 2)]
    assert again.core.run is not None and again.core.run.run == run


def test_a_notice_is_saved_before_it_is_sent() -> None:
    outbox = NoticeOutbox(resend_s=2.0, keep_s=60.0)
    notice = Send(CLIENT, StageFailed(run=3, stage="b", reason="x"), "client", 1.0)
    out = number_notices(outbox, [notice], 0.0)
    assert [type(c).__name__ for c in out] == ["Send", "Persist"]
    assert out[1] == Persist()  # now, not soon: the shell saves before its sends go out
    # one save for a batch that already has one
    again = number_notices(outbox, [notice, Persist()], 0.0)
    assert sum(isinstance(c, Persist) for c in again) == 1
    assert outbox.unacknowledged(3) == [1, 2]
    assert number_notices(outbox, [Persist(soon=True)], 0.0) == [Persist(soon=True)]


def _replanned(run: int, seq: int) -> RunReplanned:
    return RunReplanned(
        run=run, plan={"algo": "even"}, dead="b", detected_s=3.5, recovered_s=0.25,
        first_endpoint="tcp://a:1", first_stage="a", first_key=None, last_stage="d",
        last_key="k" * 40, last_endpoint="tcp://d:1", seq=seq, epoch=4,
    )  # fmt: skip


def test_notices_round_trip_through_the_state_file(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    kept = ((b"client-1", StageFailed(run=5, stage="b", reason="x", seq=2, epoch=3)),
            (b"client-1", _replanned(5, 3)))  # fmt: skip
    store.save_state(SavedState(4, 5, (), None, notices=SavedNotices(5, 3, kept)))
    loaded = store.load_state()
    assert loaded is not None and loaded.notices == SavedNotices(5, 3, kept)
    # a state without notices reads back as one (and an older file has none)
    store.save_state(SavedState(4, 5, (), None))
    loaded = store.load_state()
    assert loaded is not None and loaded.notices is None


def _entry(**fields: Any) -> dict[str, Any]:
    body = StageFailed(run=5, stage="b", reason="x", seq=2).body()
    return {"to": b"client-1", "kind": "stage_failed", "body": body, "epoch": 0, **fields}


@pytest.mark.parametrize(
    ("notices", "error"),
    [
        ({"run": 5, "last_seq": 1, "kept": [_entry()]}, "numbered 2 among run 5's notices up to 1"),
        ({"run": 6, "last_seq": 3, "kept": [_entry()]}, "of run 5 numbered 2 among run 6's"),
        ({"run": 5, "last_seq": 3, "kept": [_entry(to="client-1")]}, "without a client routing"),
        ({"run": 5, "last_seq": 3, "kept": [_entry(kind="run_ready")]}, "is not a notice kind"),
        ({"run": 5, "last_seq": 3, "kept": [_entry(body={"run": 5})]}, "stage_failed"),
        ({"run": 5, "last_seq": 0, "kept": []}, "must be counts"),
        ({"run": 5, "last_seq": True, "kept": []}, "must be counts"),
        ({"run": 5, "last_seq": 3, "kept": {"a": 1}}, "'kept' must be a list"),
        ({"run": 5, "last_seq": 3}, "kept"),
    ],
)
def test_damaged_notices_are_refused_naming_the_file(
    tmp_path: Path, notices: dict[str, Any], error: str
) -> None:
    """A damaged record with a valid checksum: never restored (a wrong number would
    have the client drop a notice as one it has seen)."""
    store = StateStore(tmp_path)
    record = storage.CoordinatorState(
        cluster_epoch=1, run_counter=5, members=[], run=None, saved_at=0.0, notices=notices
    )
    write_messages(store.state_path, [record.to_message()])
    with pytest.raises(StateFileError, match=r"coordinator\.state") as raised:
        store.load_state()
    assert error in str(raised.value)
