"""Chain and global replication together, the global fallback, and heavy recovery's
gather, in the coordinator (in-process, no sockets)."""

from __future__ import annotations

from tests._support.coordinator_harness import Harness
from tests._support.coordinator_restore import (
    UNITS,
    _replicate,
    _request,
    _start_chain_run,
    _state,
)
from zpipe.coordinator.runs.sync_training import SyncTrainingController
from zpipe.transport.codec import Message


def test_chain_replicas_keep_the_newest_global_copy_as_their_fallback() -> None:
    h = Harness()
    run = _start_chain_run(h)
    first = _replicate(h, run, 0, global_copy=True)
    assert first.body["error"] == "" and first.body["global"] is True
    controller = h.state.current
    assert isinstance(controller, SyncTrainingController)
    replica0 = h.state.replica
    assert replica0 is not None and replica0.complete and replica0.at_stages
    assert controller.fallback is replica0
    second = _replicate(h, run, 2, global_copy=False)
    assert second.body["error"] == "" and second.body["global"] is False
    replica2 = h.state.replica
    assert replica2 is not None and replica2.step == 2 and not replica2.complete
    assert replica2.fallback is replica0
    (kept,) = [e for e in h.events("replica_kept") if e["step"] == 2]
    assert kept["fallback"] == 0


def test_two_adjacent_deaths_resume_from_the_global_copy_and_say_so() -> None:
    h = Harness()
    run = _start_chain_run(h)
    _replicate(h, run, 0, global_copy=True)
    _replicate(h, run, 2, global_copy=False)
    h.advance(8.0, alive=("a",))  # b and c die: c held b's backup
    global_copy = {"run": run, "step": 0, "start_step": 0}
    _request(
        h, stage_names=["a"], replication="chain",
        resume={"run": run, "step": 2, "dead": ["b", "c"], "global": global_copy},
    )  # fmt: skip
    h.answer_all("ready", ["a"], run=2, build_s=0.01)
    ready = h.to_client("run_ready")[-1]
    assert ready.body["run"] == 2
    assert ready.body["resumed"] == {"run": run, "step": 0}
    assign = h.to("a", "assign")[-1]
    assert (assign.body["start"], assign.body["end"]) == (0, 6)
    # everything at the global copy's step, from the coordinator: nothing to fetch
    assert "fetch" not in assign.body
    got = dict(zip(assign.body["state_keys"], assign.tensors, strict=True))
    assert {k: float(t[0]) for k, t in got.items()} == {f"units.{u}.weight": u for u in range(6)}
    assert h.events("restored_from_global")
    (planned,) = h.events("restore_planned")
    assert (planned["local"], planned["from_peers"], planned["from_coordinator"]) == (0, 0, 6)


def test_one_death_resumes_from_the_chain_copies_without_the_coordinator() -> None:
    h = Harness()
    run = _start_chain_run(h)
    _replicate(h, run, 0, global_copy=True)
    _replicate(h, run, 2, global_copy=False)
    h.advance(8.0, alive=("a", "c"))
    _request(
        h, stage_names=["a", "c"], replication="chain",
        resume={"run": run, "step": 2, "dead": ["b"]},
    )  # fmt: skip
    h.answer_all("ready", ["a", "c"], run=2, build_s=0.01)
    ready = h.to_client("run_ready")[-1]
    assert ready.body["run"] == 2 and "resumed" not in ready.body
    for name in ("a", "c"):
        assign = h.to(name, "assign")[-1]
        assert assign.body["state_keys"] == []  # own snapshots and c's backup of b
        assert {e["step"] for e in assign.body["fetch"]} == {2}
    (planned,) = h.events("restore_planned")
    # a keeps 0-1 and fetches b's unit 2 from c; c keeps 3 (its backup of b) and 4-5
    assert (planned["local"], planned["from_peers"], planned["from_coordinator"]) == (5, 1, 0)


def test_heavy_recovery_gathers_every_unit_then_sends_each_stage_all_of_its_own() -> None:
    h = Harness()
    run = _start_chain_run(h)
    _replicate(h, run, 0, global_copy=False)
    h.advance(8.0, alive=("a", "c"))
    _request(
        h, stage_names=["a", "c"], replication="chain", recovery="heavy", planner="even",
        partition=[[0, 3], [3, 6]],
        resume={"run": run, "step": 0, "dead": ["b"]},
    )  # fmt: skip
    # a sends its own snapshot, c b's backup (c's own units are here: c backed up to us)
    asks = {n: h.to(n, "weights_request")[-1].body["snapshot"] for n in ("a", "c")}
    assert [(e["owner"], e["start"], e["end"]) for e in asks["a"]] == [("a", 0, 2)]
    assert [(e["owner"], e["start"], e["end"]) for e in asks["c"]] == [("b", 2, 4)]
    for name, units in (("a", range(0, 2)), ("c", range(2, 4))):
        keys, tensors = _state(name, units, 0)
        body = {"name": name, "keys": keys, "error": "", "step": 0, "run": run}
        h.feed_message(name, Message("weights", body, tensors=tensors))
    (gathered,) = h.events("heavy_gathered")
    assert gathered["holders"] == ["a", "c"]
    sent = {}
    for name in ("a", "c"):
        assign = h.to(name, "assign")[-1]
        assert "fetch" not in assign.body
        sent[name] = (assign.body["start"], assign.body["end"], len(assign.body["state_keys"]))
    # every unit of the new plan came from the coordinator
    assert sorted(sent.values()) == [(0, 3, 3), (3, 6, 3)]
    (planned,) = h.events("restore_planned")
    assert (planned["recovery"], planned["from_coordinator"], planned["from_peers"]) == (
        "heavy",
        6,
        0,
    )


def test_without_the_clients_global_copy_two_adjacent_deaths_lose_units_clearly() -> None:
    h = Harness()
    run = _start_chain_run(h)
    _replicate(h, run, 0, global_copy=True)
    _replicate(h, run, 2, global_copy=False)
    h.advance(8.0, alive=("a",))
    # the client no longer holds the mini-batches since the global copy: no fallback
    _request(
        h, stage_names=["a"], replication="chain",
        resume={"run": run, "step": 2, "dead": ["b", "c"]},
    )  # fmt: skip
    (failed,) = h.to_client("run_failed")
    assert "units [2, 4) are lost" in failed.body["error"]


def test_fast_consistency_takes_the_dead_stages_units_from_its_neighbours_backup() -> None:
    h = Harness()
    run = _start_chain_run(h)
    _replicate(h, run, 2, global_copy=False)
    h.advance(8.0, alive=("a", "c"))
    _request(
        h, stage_names=["a", "c"], replication="chain",
        resume={"run": run, "step": 2, "dead": ["b"], "consistency": "fast"},
    )  # fmt: skip
    # the survivors' newest state (after mini-batch 5) comes to the coordinator
    for name in ("a", "c"):
        (ask,) = h.to(name, "weights_request")[-1:]
        assert ask.body["latest"] is True
        keys, tensors = _state(name, UNITS[name], 100)
        body = {"name": name, "keys": keys, "error": "", "step": 0, "run": run, "completed": 5}
        h.feed_message(name, Message("weights", body, tensors=tensors))
    assigns = {n: h.to(n, "assign")[-1] for n in ("a", "c")}
    ranges = {n: (m.body["start"], m.body["end"]) for n, m in assigns.items()}
    assert ranges == {"a": (0, 3), "c": (3, 6)}
    sent = {
        n: {k: float(t[0]) for k, t in zip(m.body["state_keys"], m.tensors, strict=True)}
        for n, m in assigns.items()
    }
    # the survivors' newest units from here; b's from the backup c keeps (mini-batch 2)
    assert sent == {
        "a": {"units.0.weight": 100.0, "units.1.weight": 101.0},
        "c": {"units.4.weight": 104.0, "units.5.weight": 105.0},
    }
    fetched = {
        n: [(e["from"], e["owner"], e["step"], e["start"], e["end"]) for e in m.body["fetch"]]
        for n, m in assigns.items()
    }
    assert fetched == {"a": [("c", "b", 2, 2, 3)], "c": [("c", "b", 2, 3, 4)]}
