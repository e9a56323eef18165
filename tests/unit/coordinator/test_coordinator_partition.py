"""A coordinator cut off from every stage suspects itself, fed events with a fake clock;
notices a cut-off client missed are sent again; stages left running on exit."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests._support.coordinator_harness import Harness
from zpipe.cli.coordinator import build_parser, config_from_args
from zpipe.config import Timeouts
from zpipe.coordinator.commands import AwaitStages
from zpipe.coordinator.jobs import JobRunner
from zpipe.coordinator.membership import Membership
from zpipe.coordinator.notices import NoticeOutbox
from zpipe.coordinator.partition import GaveUp, Holding, PartitionWatch, Rejoined, Suspected
from zpipe.coordinator.state import ControlState
from zpipe.protocol.client_control import StageFailed

NAMES = ["a", "b", "c", "d"]


# ------------------------------------------------------------------ the watch alone


def test_several_members_silent_at_once_make_the_coordinator_suspect_itself() -> None:
    watch = PartitionWatch(quiet_after_s=3.0, give_up_after_s=60.0)
    heard = {"a": 10.0, "b": 10.5, "c": 9.8}
    assert watch.tick(heard, 13.4) is None  # b spoke 2.9 s ago
    assert watch.tick(heard, 13.5) == Suspected(3.0, 3)
    assert watch.suspecting
    assert watch.tick(heard, 40.0) == Holding()


def test_one_member_alone_going_silent_is_its_own_failure() -> None:
    watch = PartitionWatch(quiet_after_s=3.0, give_up_after_s=60.0)
    assert watch.tick({"a": 0.0}, 100.0) is None
    assert watch.tick({}, 100.0) is None
    assert not watch.suspecting


def test_a_word_from_anyone_ends_it_and_only_those_speaking_when_it_began_are_refreshed() -> None:
    watch = PartitionWatch(quiet_after_s=3.0, give_up_after_s=60.0)
    # c had been silent for 2.5 s when the others went quiet at 10; d for 4 s: d was
    # already failing on its own, and is judged as before
    heard = {"a": 10.0, "b": 9.0, "c": 7.5, "d": 6.0}
    assert isinstance(watch.tick(heard, 13.0), Suspected)
    assert watch.tick(heard, 20.0) == Holding()
    back = watch.tick({**heard, "a": 20.5}, 21.0)
    assert back == Rejoined(11.0, ("b", "c"))
    assert not watch.suspecting


def test_nobody_coming_back_for_the_limit_gives_up_once_until_someone_speaks() -> None:
    watch = PartitionWatch(quiet_after_s=3.0, give_up_after_s=60.0)
    heard = {"a": 0.0, "b": 0.0}
    assert isinstance(watch.tick(heard, 5.0), Suspected)
    assert watch.tick(heard, 64.9) == Holding()
    assert watch.tick(heard, 65.0) == GaveUp(65.0)
    assert watch.tick(heard, 66.0) is None  # judged as usual from now on
    # a later silence after new words is suspected again
    assert watch.tick({"a": 70.0, "b": 70.0}, 71.0) is None
    assert isinstance(watch.tick({"a": 70.0, "b": 70.0}, 73.0), Suspected)


def test_the_limit_counts_from_the_first_tick_that_saw_the_silence() -> None:
    # a coordinator paused for 100 s (SIGSTOP) first reads what queued meanwhile
    watch = PartitionWatch(quiet_after_s=3.0, give_up_after_s=60.0)
    heard = {"a": 0.0, "b": 0.0}
    assert watch.tick(heard, 100.0) == Suspected(100.0, 2)
    assert watch.tick(heard, 100.25) == Holding()
    assert watch.tick({"a": 100.3, "b": 0.0}, 100.5) == Rejoined(100.5, ("b",))


# ------------------------------------------------------------------ the core


def test_a_coordinator_cut_off_from_every_stage_declares_nobody_dead_and_the_run_goes_on() -> None:
    h = Harness()
    run = h.start_stream(NAMES, recover=True)
    epoch = h.core.run.epoch  # type: ignore[union-attr]
    h.advance(2.0, alive=tuple(NAMES))
    h.advance(8.0, alive=())  # the coordinator hears nobody for 8 s
    assert h.events("stage_dead") == []
    (cut,) = h.events("coordinator_partitioned")
    assert cut["members"] == 4 and cut["silent_s"] >= 3.0
    h.advance(10.0, alive=tuple(NAMES))
    (back,) = h.events("coordinator_rejoined")
    assert back["away_s"] >= 8.0
    assert h.events("stage_dead") == []
    current = h.core.run
    assert current is not None and current.run == run and current.epoch == epoch
    assert current.failed == set()
    assert not h.to_client("stage_failed") and not h.to_client("run_replanned")
    assert all(m.state.value == "alive" for m in h.state.membership.all())
    assert [r["event"] for r in h.records] == ["coordinator_partitioned", "coordinator_rejoined"]


def test_a_stage_that_died_during_the_partition_is_still_found_afterwards() -> None:
    h = Harness()
    h.start_stream(NAMES, recover=True)
    h.advance(2.0, alive=tuple(NAMES))
    h.advance(8.0, alive=())
    assert h.events("stage_dead") == []
    h.advance(10.0, alive=("a", "c", "d"))  # b does not come back
    assert [e["stage"] for e in h.events("stage_dead")] == ["b"]
    assert h.events("coordinator_rejoined")


def test_a_partition_longer_than_the_stages_outlive_ends_in_deaths() -> None:
    h = Harness()
    h.start_stream(NAMES)
    limit = h.state.timeouts.coordinator_silence_s
    h.advance(limit + 10.0, alive=())
    assert h.events("coordinator_partition_over")
    assert sorted(e["stage"] for e in h.events("stage_dead")) == NAMES


def test_one_stage_going_silent_among_several_is_declared_dead_as_before() -> None:
    h = Harness()
    h.start_stream(NAMES)
    h.advance(8.0, alive=("a", "c", "d"))
    assert [e["stage"] for e in h.events("stage_dead")] == ["b"]
    assert h.events("coordinator_partitioned") == []


# ------------------------------------------------------------------ notices the client missed


def test_a_notice_is_numbered_and_sent_again_until_acknowledged() -> None:
    outbox = NoticeOutbox(resend_s=2.0, keep_s=120.0)
    first = outbox.post(b"c", StageFailed(run=4, stage="b", reason="x"), 0.0)
    second = outbox.post(b"c", StageFailed(run=4, stage="d", reason="y"), 0.5)
    assert (first.seq, second.seq) == (1, 2)
    assert outbox.due(4, 1.9) == []
    assert outbox.due(4, 2.0) == [(b"c", first)]
    assert outbox.due(4, 2.5) == [(b"c", second)]
    assert outbox.acknowledged(4, 1) and not outbox.acknowledged(4, 1)  # a repeat ack
    assert outbox.due(4, 4.5) == [(b"c", second)]
    assert outbox.unacknowledged(4) == [2]
    # another run's numbers start again at 1; a run no longer current is forgotten
    other = outbox.post(b"c", StageFailed(run=5, stage="b", reason="x"), 5.0)
    assert other.seq == 1
    assert outbox.due(5, 7.0) == [(b"c", other)]
    assert outbox.unacknowledged(4) == []


def test_a_notice_is_forgotten_once_the_client_would_have_given_up() -> None:
    outbox = NoticeOutbox(resend_s=2.0, keep_s=10.0)
    outbox.post(b"c", StageFailed(run=1, stage="b", reason="x"), 0.0)
    assert len(outbox.due(1, 9.0)) == 1
    assert outbox.due(1, 10.0) == [] and outbox.unacknowledged(1) == []


def test_a_stage_failure_the_client_missed_is_sent_again_until_it_acknowledges() -> None:
    h = Harness(ack_notices=False)  # the client is cut off
    run = h.start_stream(NAMES)
    h.advance(6.5, alive=("a", "c", "d"))  # b is declared dead after 5 s
    first = h.to_client("stage_failed")
    assert [n.body["stage"] for n in first] == ["b"] and first[0].body["seq"] == 1
    h.advance(6.0, alive=("a", "c", "d"))
    again = h.to_client("stage_failed")
    assert len(again) >= 3 and {(n.body["stage"], n.body["seq"]) for n in again} == {("b", 1)}
    assert h.events("notice_sent_again")
    h.client("notice_ack", run=run, seq=1)  # the client is back and has it
    sent = len(h.to_client("stage_failed"))
    h.advance(6.0, alive=("a", "c", "d"))
    assert len(h.to_client("stage_failed")) == sent


def test_a_connected_client_gets_each_notice_once() -> None:
    h = Harness()
    h.start_stream(NAMES)
    h.advance(20.0, alive=("a", "c", "d"))
    assert [n.body["seq"] for n in h.to_client("stage_failed")] == [1]
    assert h.events("notice_sent_again") == []


# ------------------------------------------------------------------ stages on exit


@pytest.mark.parametrize(
    ("flags", "shuts_down"),
    [
        ([], True),  # nothing to take the stages over: they stop with it
        (["--state-dir", "STATE"], False),  # a restarted coordinator takes them over
        (["--state-dir", "STATE", "--shutdown-stages-on-exit"], True),
        (["--shutdown-stages-on-exit"], True),
    ],
)
def test_a_coordinator_with_a_state_dir_leaves_its_stages_running_unless_told(
    flags: list[str], shuts_down: bool, tmp_path: Path
) -> None:
    argv = [f.replace("STATE", str(tmp_path)) for f in flags]
    config = config_from_args(build_parser().parse_args(argv))
    assert config.shuts_down_stages is shuts_down


async def test_a_run_after_a_restart_waits_for_restored_stages_to_speak() -> None:
    timeouts = Timeouts()
    membership = Membership(heartbeat_interval_s=1.0, suspect_after_intervals=3, probe_intervals=2)
    state = ControlState(timeouts=timeouts, membership=membership)
    for name in ("a", "b"):
        membership.register(
            name=name, routing_id=name.encode(), data_endpoint=f"tcp://{name}:1", info={},
            public_key=None, now=0.0,
        )  # fmt: skip
    state.unconfirmed.add("b")  # restored from disk, not heard by this process yet
    runner = JobRunner(state, None, None, measure_links=False, store=None)  # type: ignore[arg-type]
    picked = asyncio.create_task(runner.run(AwaitStages(("a", "b"), None, 30.0)))
    await asyncio.sleep(0.3)
    assert not picked.done()
    state.confirm("b")  # b spoke
    chosen = await asyncio.wait_for(picked, 10)
    assert [m.name for m in chosen] == ["a", "b"]
