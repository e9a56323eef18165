"""A coordinator killed at each point of a run's life and started again on its state
directory (zpipe.coordinator.takeover): at admission, during assignment and during a
stream's recovery. The restarted coordinator never gives an id or a plan epoch the
killed one had handed out (replies are matched by run id: a ``ready`` of the lost
assignment, queued at a stage while the coordinator was away, must not answer the
client's re-sent request). Pure: the in-process coordinator, a real state directory
written whenever the core says so, no sockets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests._support.coordinator_harness import SPEC
from tests._support.saving_harness import SavingHarness
from zpipe.coordinator.commands import AllowPeers, PlanInference, RunJob
from zpipe.coordinator.persistence import StateStore
from zpipe.transport.codec import Message

NAMES = ["a", "b", "c"]
TRAIN = {"num_microbatches": 3, "optimizer": {"name": "sgd", "lr": 0.1}}


def _request(h: SavingHarness, mode: str) -> None:
    extra: dict[str, Any] = {"planner": "even"}
    if mode == "train":
        extra = {"mode": "train", "train": TRAIN, "partition": [[0, 2], [2, 4], [4, 6]]}
    h.client(
        "run_request", model=SPEC.to_dict(), dtype="float32", sink_endpoint="tcp://client:9",
        wait_for_stages_s=0.0, stage_names=NAMES, **extra,
    )  # fmt: skip


def _killed_during_assignment(tmp_path: Path, mode: str) -> tuple[SavingHarness, int, int]:
    h = SavingHarness(StateStore(tmp_path / "state"))
    for name in NAMES:
        h.register(name)
    _request(h, mode)
    run = h.core.run
    assert run is not None, h.events("run_failed")
    assert all(h.to(n, "assign") for n in run.devices)  # every stage has its assignment
    assert h.to_client("run_ready") == []  # and none is ready yet: killed now
    return h.restarted(), run.run, run.epoch


def _readies(h: SavingHarness, run: int) -> None:
    h.answer_all("ready", NAMES, run=run, build_s=0.01)


def test_killed_during_an_inference_assignment_the_resent_request_gets_a_new_run(
    tmp_path: Path,
) -> None:
    again, lost, lost_epoch = _killed_during_assignment(tmp_path, "infer")
    assert again.core.run is None  # the run was never ready: the file kept none
    assert again.state.run_counter >= lost and again.state.epoch >= lost_epoch
    _request(again, "infer")  # the client (or its caller) asks again
    run = again.core.run
    assert run is not None and run.run > lost and run.epoch > lost_epoch
    # the stages' ready for the lost assignment arrive late: they answer nothing
    _readies(again, lost)
    assert again.to_client("run_ready") == []
    _readies(again, run.run)
    (ready,) = again.to_client("run_ready")
    assert ready.body["run"] == run.run


def test_killed_during_a_training_assignment_the_resent_request_gets_a_new_run(
    tmp_path: Path,
) -> None:
    again, lost, lost_epoch = _killed_during_assignment(tmp_path, "train")
    assert again.core.run is None
    _request(again, "train")
    run = again.core.run
    assert run is not None and run.run > lost and run.epoch > lost_epoch
    _readies(again, lost)
    assert again.to_client("run_ready") == []
    _readies(again, run.run)
    assert [r.body["run"] for r in again.to_client("run_ready")] == [run.run]


def test_killed_at_admission_the_previous_run_is_still_the_one_on_disk(tmp_path: Path) -> None:
    """Killed once the ids are taken, before any stage heard them: the file has the new
    counters and the run that was current before (here a finished stream: none)."""
    h = SavingHarness(StateStore(tmp_path / "state"))
    first = h.start_stream(NAMES)
    h.client("run_end", run=first)
    h.answer_all("metrics", NAMES, run=first)
    assert h.to_client("run_report")
    saved = h.store.load_state()
    assert saved is not None and saved.run is None and saved.run_counter == first
    _request(h, "infer")
    second = h.core.run
    assert second is not None and second.run == first + 1
    saved = h.store.load_state()
    assert saved is not None and saved.run_counter == second.run
    assert saved.epoch == second.epoch


def test_killed_during_a_streams_recovery_the_restarted_one_recovers_it_anew(
    tmp_path: Path,
) -> None:
    h = SavingHarness(StateStore(tmp_path / "state"), ack_notices=False)
    names = ["a", "b", "c", "d"]
    run = h.start_stream(names, recover=True)
    h.advance(6.5, alive=("a", "c", "d"))  # b dies; the re-plan assigns a, c and d
    lost = {n: h.to(n, "assign")[-1].epoch for n in ("a", "c", "d")}
    assert len(set(lost.values())) == 1 and h.to_client("run_replanned") == []
    again = h.restarted(ack_notices=False)  # killed before the survivors were ready
    taken = again.core.run
    assert taken is not None and taken.run == run and "b" in taken.devices
    assert again.state.epoch >= max(lost.values())
    # b stays silent: declared dead again, and the stream re-planned under a new epoch
    again.advance(6.5, alive=("a", "c", "d"))
    assigned = {n: again.to(n, "assign")[-1] for n in ("a", "c", "d")}
    assert all(m.epoch > max(lost.values()) for m in assigned.values())
    again.answer_all("ready", ["a", "c", "d"], run=run, build_s=0.01)
    again.answer_all("connected", ["a", "c", "d"], run=run)
    (replanned,) = again.to_client("run_replanned")
    assert replanned.body["dead"] == "b" and replanned.epoch > max(lost.values())


def _backed_up(h: SavingHarness, run: int, step: int) -> list[Any]:
    """The client asks for a replica after ``step``; every stage backs up. Returns the
    peer grants (``AllowPeers`` jobs) sent before the backups."""
    jobs = len(h.jobs)
    h.client("replicate", run=run, step=step)
    for name in NAMES:
        body = {"run": run, "step": step, "holder": "", "bytes": 0}
        h.feed_message(name, Message("backed_up", {"name": name, "keys": [], "error": "", **body}))  # type: ignore[attr-defined]
    (reply,) = [r for r in h.to_client("replicated") if r.body["step"] == step]
    assert reply.body["error"] == ""
    return [j for j in h.jobs[jobs:] if isinstance(j, AllowPeers)]


def test_a_restarted_coordinator_revokes_fetch_grants_it_cannot_know_of(tmp_path: Path) -> None:
    """Fetch grants are not saved: a restarted coordinator cannot know whether a restore
    or a move of the killed one left some at the stages, so the run's first backup
    after the restart revokes them all (an empty grant for every member) before any
    snapshot is replaced, and the later ones do not ask again."""
    h = SavingHarness(StateStore(tmp_path / "state"))
    for name in NAMES:
        h.register(name)
    h.client(
        "run_request", model=SPEC.to_dict(), dtype="float32", sink_endpoint="tcp://client:9",
        wait_for_stages_s=0.0, mode="train", stage_names=NAMES, train=TRAIN,
        partition=[[0, 2], [2, 4], [4, 6]], replication="chain", recover=True,
    )  # fmt: skip
    run = h.core.run
    assert run is not None, h.events("run_failed")
    h.answer_all("ready", NAMES, run=run.run, build_s=0.01)
    h.client("run_go", run=run.run)
    h.answer_all("connected", NAMES, run=run.run)
    _backed_up(h, run.run, 2)
    assert h.state.fetch_grants_out is False and _backed_up(h, run.run, 4) == []
    again = h.restarted()
    assert again.state.fetch_grants_out is True
    (revoked,) = _backed_up(again, run.run, 6)
    assert revoked.fetches == {} and {m.name for m in revoked.members} == set(NAMES)
    assert _backed_up(again, run.run, 8) == []


class PlanningHeld(SavingHarness):
    """A coordinator whose planner does not answer while ``hold`` (killed while a
    heavy recovery plans the survivors afresh)."""

    hold = False

    def _apply(self, commands: list[Any]) -> None:
        held = [
            c
            for c in commands
            if self.hold and isinstance(c, RunJob) and isinstance(c.job, PlanInference)
        ]
        self.jobs.extend(c.job for c in held)
        super()._apply([c for c in commands if c not in held])


def test_killed_while_a_recovery_plans_the_restarted_one_declares_the_stage_dead_again(
    tmp_path: Path,
) -> None:
    """The dead stage is saved with the run until the new plan is connected: without
    it the restarted coordinator would take over a run naming a stage it does not
    know of, never declare it dead, and the stream would wait for a re-plan."""
    h = PlanningHeld(StateStore(tmp_path / "state"))
    names = ["a", "b", "c", "d"]
    run = h.start_stream(names, recover=True, recovery="heavy")
    h.hold = True
    h.advance(6.5, alive=("a", "c", "d"))  # b dies; the re-plan waits on the planner
    assert [e["stage"] for e in h.events("stage_dead")] == ["b"]
    assert isinstance(h.jobs[-1], PlanInference) and h.to("a", "assign")[-1].epoch == 1
    again = h.restarted()
    assert again.core.run is not None and "b" in again.core.run.devices
    assert again.state.membership.get("b") is not None  # restored, to be declared dead
    again.advance(6.5, alive=("a", "c", "d"))
    assert [e["stage"] for e in again.events("stage_dead")] == ["b"]
    again.answer_all("ready", ["a", "c", "d"], run=run, build_s=0.01)
    again.answer_all("connected", ["a", "c", "d"], run=run)
    (replanned,) = again.to_client("run_replanned")
    assert replanned.body["dead"] == "b" and "b" not in replanned.body["plan"]["stages"][0]
