"""The coordinator relays a stage's speed verdict (``speed_changed``) to the run's
client: once, only about the cuts the run has now, after a look in progress unless
that look took it, and only for a run whose re-partitioning watches its forwards
(in-process; no sockets)."""

from __future__ import annotations

from typing import Any

import pytest

from tests._support.coordinator_harness import SPEC, Harness, typed
from zpipe.coordinator.events import StageSpoke
from zpipe.coordinator.runs.async_repartition import live_repartitioning
from zpipe.training.repartition import RepartitionSettings

WATCHED = RepartitionSettings(first=10, every=100, gain=0.1, forward_watch=2.0)


def _start(h: Harness, settings: RepartitionSettings = WATCHED) -> int:
    for name in "abc":
        h.register(name)
    train = {"schedule": "async-1f1b", "num_microbatches": 1,
             "optimizer": {"name": "sgd", "lr": 0.1}, "async": {"vertical_sync": True},
             "repartition": settings.to_dict()}  # fmt: skip
    h.client(
        "run_request", model=SPEC.to_dict(), dtype="float32", sink_endpoint="tcp://client:9",
        wait_for_stages_s=0.0, mode="train", stage_names=list("abc"), train=train,
        partition=[[0, 2], [2, 4], [4, 6]],
    )  # fmt: skip
    run = h.core.run
    assert run is not None, h.events("run_failed")
    h.answer_all("ready", list(run.devices), run=run.run, build_s=0.01)
    h.client("run_go", run=run.run)
    h.answer_all("connected", list(run.devices), run=run.run)
    assert h.to_client("run_started")
    return run.run


def _verdict(h: Harness, run: int, *, stage: str = "b", step: int = 14, **over: Any) -> None:
    body = {"run": run, "name": stage, "step": step, "plan_epoch": 0, "ratio": 10.0,
            "baseline_s": 0.1, "now_s": 1.0, **over}  # fmt: skip
    h.feed(StageSpoke(stage.encode(), typed("speed_changed", body, sender=stage)))


def test_the_stages_of_a_watched_async_run_are_told_the_watchs_factor() -> None:
    h = Harness()
    _start(h)
    for name in "abc":
        (assign,) = h.to(name, "assign")
        assert assign.body["train"]["forward_watch"] == 2.0
    unwatched = Harness()
    _start(unwatched, RepartitionSettings(first=10, every=100))
    (assign,) = unwatched.to("b", "assign")
    assert "forward_watch" not in assign.body["train"]


def test_a_verdict_goes_to_the_client_once() -> None:
    h = Harness()
    run = _start(h)
    _verdict(h, run)
    (relayed,) = h.to_client("speed_changed")
    assert relayed.body == {"run": run, "name": "b", "step": 14, "plan_epoch": 0,
                            "ratio": 10.0, "baseline_s": 0.1, "now_s": 1.0}  # fmt: skip
    _verdict(h, run)  # the same verdict again
    assert len(h.to_client("speed_changed")) == 1
    _verdict(h, run, stage="c", step=15)  # another stage's
    assert len(h.to_client("speed_changed")) == 2


def test_a_verdict_about_cuts_moved_since_is_dropped() -> None:
    h = Harness()
    run = _start(h)
    owner = h.state.current
    flows = live_repartitioning(owner)
    assert flows is not None
    h.core.run.repartition_epoch = 1  # type: ignore[union-attr]  (a move committed)
    _verdict(h, run, plan_epoch=0)
    assert not h.to_client("speed_changed")
    assert h.events("speed_change_dropped")[-1]["why"] == "older cuts"
    _verdict(h, run, plan_epoch=1, step=20)
    assert len(h.to_client("speed_changed")) == 1


def _profiles(h: Harness, run: int, step: int, phase: str) -> None:
    """Every stage's reply to ``phase`` of the look before ``step``: equal forwards."""
    for name, (start, end) in zip("abc", ((0, 2), (2, 4), (4, 6)), strict=True):
        metrics = {"microbatches": step, "forward_s": 1.0, "backward_s": 2.0,
                   "start": start, "end": end}  # fmt: skip
        h.stage(name, "repartition_reply", run=run, step=step, phase=phase, error="",
                metrics=metrics)  # fmt: skip


def test_a_verdict_during_a_look_that_has_not_decided_goes_to_that_look() -> None:
    h = Harness()
    run = _start(h)
    h.client("repartition", run=run, step=10, look=True)  # the stages' profiles not in yet
    _verdict(h, run, step=9)
    assert not h.to_client("speed_changed")
    assert h.events("speed_change_deferred")[-1]["why"] == "a look in progress"
    _profiles(h, run, 10, "profile")
    (answer,) = h.to_client("repartitioned")
    assert answer.body["error"] == ""
    # the look's event names its mini-batch, as the other events of the look do
    considered = h.events("repartition_considered")[-1]
    assert considered["step"] == 10
    # the look measured b by the verdict, so the client is not told to look again
    assert considered["verdicts_taken"] == ["b"]
    assert not h.to_client("speed_changed")
    assert h.events("speed_change_dropped")[-1]["why"] == "the look took it"
    _verdict(h, run, step=12)  # after the look: relayed at once
    assert len(h.to_client("speed_changed")) == 1


def test_a_verdict_after_a_looks_decision_is_relayed_when_the_look_ends() -> None:
    h = Harness()
    run = _start(h)
    h.client("repartition", run=run, step=10)  # a look at the flush
    _profiles(h, run, 10, "prepare")  # decided: the commit is asked for
    assert h.events("repartition_considered")[-1]["verdicts_taken"] == []
    _verdict(h, run, step=9)
    assert not h.to_client("speed_changed")  # the look is not over yet
    _profiles(h, run, 10, "commit")
    (answer,) = h.to_client("repartitioned")
    assert answer.body["error"] == "" and answer.body["plan_epoch"] == 0  # cuts kept
    # the old code dropped it for good: b's watch, having fired, does not fire again
    (relayed,) = h.to_client("speed_changed")
    assert relayed.body["name"] == "b" and relayed.body["step"] == 9
    assert h.events("speed_change_relayed")[-1]["deferred"] is True
    # the look the client makes next takes it
    assert _look(h, run, 12, slow_b=1)["verdicts_taken"] == ["b"]


def test_verdicts_the_run_did_not_ask_for_or_that_mean_nothing_are_dropped() -> None:
    h = Harness()
    run = _start(h, RepartitionSettings(first=10, every=100))  # no forward watch
    _verdict(h, run)
    _verdict(h, run + 1)  # another run's
    assert not h.to_client("speed_changed")
    watched = Harness()
    run = _start(watched)
    _verdict(watched, run, ratio=-1.0)  # a stage's bad values: dropped, still serving
    _verdict(watched, run, stage="a", name="b")  # a verdict in another stage's name
    assert not watched.to_client("speed_changed")
    assert watched.events("dropped_message")
    _verdict(watched, run)
    assert len(watched.to_client("speed_changed")) == 1


def _look(h: Harness, run: int, step: int, slow_b: int) -> dict[str, Any]:
    """A look without a flush at ``step``: every stage's forwards took 0.1 s, b's
    last ``slow_b`` 1.0 s; the look's ``repartition_considered`` event."""
    h.client("repartition", run=run, step=step, look=True)
    for name, (start, end) in zip("abc", ((0, 2), (2, 4), (4, 6)), strict=True):
        forwards = [[mb, 0.1] for mb in range(step)]
        if name == "b" and slow_b:
            forwards[-slow_b:] = [[mb, 1.0] for mb, _ in forwards[-slow_b:]]
        forward_s = sum(s for _, s in forwards)
        metrics = {"microbatches": step, "forward_s": forward_s, "backward_s": 2 * forward_s,
                   "start": start, "end": end, "recent": forwards}  # fmt: skip
        h.stage(name, "repartition_reply", run=run, step=step, phase="profile", error="",
                metrics=metrics)  # fmt: skip
    return h.events("repartition_considered")[-1]


def test_the_look_after_a_verdict_measures_the_stage_at_its_new_speed_once() -> None:
    h = Harness()
    run = _start(h)
    _verdict(h, run, step=14)  # b: 10x slower, its forwards 0.1 s before
    assert len(h.to_client("speed_changed")) == 1
    considered = _look(h, run, 16, slow_b=1)  # one slow forward in the window
    assert considered["verdicts_taken"] == ["b"]
    a_s, b_s = considered["window"]["a"][0], considered["window"]["b"][0]
    # b's old forwards' median times the verdict's ratio, with its backwards (x3)
    assert b_s == pytest.approx(3.0) and a_s == pytest.approx(0.3)
    # the next look measures b on its window only: the verdict counted once
    later = _look(h, run, 20, slow_b=1)
    assert later["verdicts_taken"] == []
    assert later["window"]["b"][0] == pytest.approx(0.3)


def test_a_verdict_while_the_client_pauses_for_a_move_is_dropped_by_the_moves_commit() -> None:
    h = Harness()
    run = _start(h)
    considered = _look(h, run, 16, slow_b=10)  # b's window shows it: the look moves
    assert considered["bounds"] is not None, considered
    (answer,) = h.to_client("repartitioned")
    assert answer.body["pause"] is True
    _verdict(h, run, stage="c", step=15)  # while the client pauses for the move
    assert h.events("speed_change_deferred")[-1]["stage"] == "c"
    h.client("repartition", run=run, step=16)  # the flush that carries the move out
    for phase in ("prepare", "fetch", "commit"):
        _profiles(h, run, 16, phase)
    assert h.to_client("repartitioned")[-1].body["plan_epoch"] == 1
    # c's verdict measured the units it ran before the move: not the client's to act on
    assert not h.to_client("speed_changed")
    assert h.events("speed_change_dropped")[-1]["why"] == "older cuts"
