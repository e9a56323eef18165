"""The synchronous training controller, in-process: replicas, resume, fetch plans, balance."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests._support.coordinator_harness import SPEC, Harness
from zpipe._errors import UnitsLostError
from zpipe.coordinator.commands import AllowPeers
from zpipe.coordinator.current_run import KeptReplica
from zpipe.coordinator.decisions import (
    fetch_grants,
    fetch_plans,
    held_at_coordinator,
    restore_from,
)
from zpipe.coordinator.runs.sync_balance import rebalanced
from zpipe.coordinator.runs.sync_training import SyncTrainingController
from zpipe.planner.training_plan import TrainingPlan, TrainStage
from zpipe.recovery import COORDINATOR, StageSpan, lightweight_replan
from zpipe.transport.codec import Message

TRAIN = {"num_microbatches": 3, "optimizer": {"name": "sgd", "lr": 0.1}}


def _plan(ranges: list[tuple[str, int, int]]) -> TrainingPlan:
    return TrainingPlan(
        algo="explicit", schedule="1f1b", num_units=ranges[-1][2], microbatch_size=1,
        num_microbatches=3,
        stages=tuple(TrainStage((d,), a, b, (1,), 1) for d, a, b in ranges),
    )  # fmt: skip


def _start_training(
    h: Harness,
    names: list[str],
    *,
    links: dict[str, float] | None = None,
    then: Any = None,
    **request: Any,
) -> int:
    """Register ``names`` (declaring ``links``' uplink in Mbit/s), call ``then(name)`` on
    each, start a training run over them."""
    for name in names:
        h.register(name, info={"link": {"bandwidth_mbps": links[name]}} if links else None)
        if then is not None:
            then(name)
    h.client(
        "run_request", model=SPEC.to_dict(), dtype="float32", sink_endpoint="tcp://client:9",
        wait_for_stages_s=0.0, mode="train", stage_names=names, train=TRAIN, recover=True,
        **request,
    )  # fmt: skip
    run = h.core.run
    assert run is not None
    h.answer_all("ready", list(run.devices), run=run.run, build_s=0.01)
    h.client("run_go", run=run.run)
    h.answer_all("connected", list(run.devices), run=run.run)
    assert h.to_client("run_started")
    return run.run


def _weights(name: str, units: range, **extra: Any) -> Message:
    keys = [f"units.{u}.weight" for u in units]
    body = {"run": 0, "step": 0, "name": name, "keys": keys, "error": "", **extra}
    return Message("weights", body, tensors=tuple(torch.full((2,), float(u)) for u in units))


def test_a_global_replica_gathers_every_units_state_and_answers_once() -> None:
    h = Harness()
    run = _start_training(h, ["a", "b", "c"], partition=[[0, 2], [2, 4], [4, 6]])
    assert isinstance(h.state.current, SyncTrainingController)
    h.client("replicate", run=run, step=0)
    h.client("replicate", run=run, step=0)  # the client asked again: one gather, and
    # one answer (a second to the same client would wait for its next request)
    assert [len(h.to(n, "weights_request")) for n in "abc"] == [1, 1, 1]
    assert h.to("a", "weights_request")[0].body["optimizer"] is True
    for name, units in (("a", range(0, 2)), ("b", range(2, 4)), ("c", range(4, 6))):
        h.feed_message(name, _weights(name, units))
    replies = h.to_client("replicated")
    assert len(replies) == 1 and replies[0].body["error"] == "" and replies[0].body["tensors"] == 6
    assert h.state.replica is not None and h.state.replica.step == 0
    assert held_at_coordinator(h.state.replica.state) == set(range(6))


def test_a_stage_that_dies_during_a_replica_fails_that_replica_and_the_run_is_told() -> None:
    h = Harness()
    run = _start_training(h, ["a", "b", "c"], partition=[[0, 2], [2, 4], [4, 6]])
    h.client("replicate", run=run, step=3)
    h.feed_message("a", _weights("a", range(0, 2)))
    h.advance(8.0, alive=("a", "c"))
    (reply,) = h.to_client("replicated")
    assert reply.body["error"].startswith("StageLostError: stage 'b' failed")
    (failed,) = h.to_client("stage_failed")
    assert failed.body["stage"] == "b"
    assert h.state.replica is None


def test_a_resumed_chain_run_fetches_the_dead_stages_units_from_its_backup() -> None:
    h = Harness()
    old = _plan([("a", 0, 2), ("b", 2, 4), ("c", 4, 6)])
    # chain replication: a backed up to b, b to c, c to the coordinator (which holds 4-5)
    state = {f"units.{u}.weight": torch.zeros(2) for u in (4, 5)}
    h.state.replica = KeptReplica(1, 3, old, state, {"a": "b", "b": "c", "c": COORDINATOR})
    for name in "abc":
        h.register(name)
    h.advance(8.0, alive=("a", "c"))  # b dies
    h.client(
        "run_request", model=SPEC.to_dict(), dtype="float32", sink_endpoint="tcp://client:9",
        wait_for_stages_s=0.0, mode="train", stage_names=["a", "b", "c"], train=TRAIN,
        recover=True, resume={"run": 1, "step": 3, "dead": ["b"]},
    )  # fmt: skip
    assigns = {n: h.to(n, "assign")[-1] for n in ("a", "c")}
    ranges = {n: (m.body["start"], m.body["end"]) for n, m in assigns.items()}
    assert ranges == {"a": (0, 3), "c": (3, 6)}
    # a keeps its own snapshot of 0-1 and fetches b's unit 2 from the backup c holds
    assert [(e["from"], e["owner"], e["start"], e["end"]) for e in assigns["a"].body["fetch"]] == [
        ("a", "a", 0, 2), ("c", "b", 2, 3)
    ]  # fmt: skip
    assert assigns["a"].body["fetch"][1]["endpoint"] == "tcp://c:2"
    # c has b's unit 3 in the backup it holds and keeps its own 4-5: the coordinator's
    # copy of them (c's backup) is not sent again
    assert [(e["from"], e["owner"], e["start"], e["end"]) for e in assigns["c"].body["fetch"]] == [
        ("c", "b", 3, 4), ("c", "c", 4, 6)
    ]  # fmt: skip
    assert assigns["c"].body["state_keys"] == []
    assert assigns["a"].body["state_keys"] == []
    assert [e["policy"] for e in h.events("training_replanned")] == ["lightweight"]


def test_the_next_backup_revokes_the_fetch_grants_of_a_restore() -> None:
    """A restore grants c's probe port the fetch of b's units of step 3; the run's next
    backup replaces those copies, so before any backup goes out every member is told
    to answer no fetch (an empty grant), and a stale copy cannot be fetched. Later
    backups, with nothing granted since, do not ask again."""
    h = Harness()
    old = _plan([("a", 0, 2), ("b", 2, 4), ("c", 4, 6)])
    h.state.replica = KeptReplica(1, 3, old, {}, {"a": "b", "b": "c", "c": "a"})
    for name in "abc":
        h.register(name)
    h.advance(8.0, alive=("a", "c"))  # b dies
    h.client(
        "run_request", model=SPEC.to_dict(), dtype="float32", sink_endpoint="tcp://client:9",
        wait_for_stages_s=0.0, mode="train", stage_names=["a", "b", "c"], train=TRAIN,
        recover=True, resume={"run": 1, "step": 3, "dead": ["b"]}, replication="chain",
    )  # fmt: skip
    allowed = [j for j in h.jobs if isinstance(j, AllowPeers)]
    assert allowed and allowed[-1].fetches is not None
    granted = {n: [(g["peer"], g["owner"], g["step"]) for g in gs] for n, gs in
               allowed[-1].fetches.items()}  # fmt: skip
    assert granted == {"c": [("a", "b", 3)]}
    run = h.core.run
    assert run is not None
    h.answer_all("ready", list(run.devices), run=run.run, build_s=0.01)
    h.client("run_go", run=run.run)
    h.answer_all("connected", list(run.devices), run=run.run)

    def replicate(step: int) -> list[AllowPeers]:
        jobs, sent = len(h.jobs), len(h.sent)
        h.client("replicate", run=run.run, step=step)
        assert [s.peer for s in h.sent[sent:] if s.wire.kind == "backup_request"] == ["a", "c"]
        for name in ("a", "c"):
            h.feed_message(name, _backed_up(name, run=run.run, step=step))
        (reply,) = [r for r in h.to_client("replicated") if r.body["step"] == step]
        assert reply.body["error"] == ""
        return [j for j in h.jobs[jobs:] if isinstance(j, AllowPeers)]

    (revoked,) = replicate(5)
    assert revoked.fetches == {}  # no member is named: none answers a fetch
    assert {m.name for m in revoked.members} == {"a", "c"}
    assert replicate(7) == []  # nothing granted since: no extra round trip
    assert h.state.fetch_grants_out is False


def test_run_ready_gives_every_first_stage_device_its_own_data_port_limit() -> None:
    """A data-parallel first stage: a and b each take a share of every micro-batch on
    their own data port. b's limit is the smaller: the client is told each device's,
    and the smallest where one limit is read (it was a's only, which b's port would
    exceed)."""
    h = Harness()
    for name in "abc":
        h.register(name)
    plan = TrainingPlan(
        algo="explicit", schedule="1f1b", num_units=6, microbatch_size=3, num_microbatches=3,
        stages=(TrainStage(("a", "b"), 0, 3, (2, 1), 1), TrainStage(("c",), 3, 6, (3,), 1)),
    )  # fmt: skip
    h.client(
        "run_request", model=SPEC.to_dict(), dtype="float32", sink_endpoint="tcp://client:9",
        wait_for_stages_s=0.0, mode="train", stage_names=["a", "b", "c"],
        train={**TRAIN, "plan": plan.to_dict()},
    )  # fmt: skip
    run = h.core.run
    assert run is not None, h.events("run_failed")
    limits = {"a": 1 << 30, "b": 1 << 20, "c": 1 << 30}
    for name in "abc":
        ring = {"ring_endpoint": f"tcp://{name}:3"} if name in "ab" else {}
        h.stage(name, "ready", run=run.run, build_s=0.1, max_message_bytes=limits[name], **ring)
    (ready,) = h.to_client("run_ready")
    assert ready.body["training_plan"]["first_limits"] == {"a": 1 << 30, "b": 1 << 20}
    assert ready.body["first_max_message_bytes"] == 1 << 20


def test_units_with_no_live_holder_are_lost_clearly() -> None:
    old = _plan([("a", 0, 2), ("b", 2, 4), ("c", 4, 6)])
    replica = KeptReplica(1, 3, old, {}, {"a": "b", "b": "c", "c": "a"})
    new = [StageSpan(("a",), 0, 6)]
    with pytest.raises(
        UnitsLostError,
        match=r"units \[2, 4\) are lost: b and the holder of their backup \(c\) are gone",
    ):
        fetch_plans(replica, new, alive={"a"})


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=3), min_size=2, max_size=5),
    dead_mask=st.lists(st.booleans(), min_size=5, max_size=5),
    topology=st.sampled_from(["chain", "ring"]),
)
def test_after_a_failure_every_unit_has_exactly_one_source(
    sizes: list[int], dead_mask: list[bool], topology: str
) -> None:
    names = [f"d{i}" for i in range(len(sizes))]
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    old = _plan([(n, bounds[i], bounds[i + 1]) for i, n in enumerate(names)])
    holders = {n: names[i + 1] for i, n in enumerate(names[:-1])}
    holders[names[-1]] = COORDINATOR if topology == "chain" else names[0]
    here = range(bounds[-2], bounds[-1]) if topology == "chain" else range(0)
    state = {f"units.{u}.weight": torch.zeros(1) for u in here}
    replica = KeptReplica(1, 5, old, state, holders)
    dead = {n for n, d in zip(names, dead_mask, strict=False) if d}
    if len(dead) == len(names):
        dead.discard(names[0])
    alive = set(names) - dead
    new_plan = lightweight_replan(old, failed=dead, unit_work=[1.0] * bounds[-1])
    new = [StageSpan(s.devices, s.start, s.end) for s in new_plan.stages]
    try:
        choice = restore_from(replica, new, alive)
    except UnitsLostError as exc:
        lost = range(*exc.units)
        # truly lost: no live device ran them, and no live holder has their backup
        for unit in (lost[0], lost[-1]):
            owner = next(n for i, n in enumerate(names) if bounds[i] <= unit < bounds[i + 1])
            assert owner in dead and holders[owner] not in alive and unit not in here
        return
    fetches = choice.fetches
    for span in new:
        (device,) = span.devices
        covered = [u for e in fetches[device] for u in range(e["start"], e["end"])]
        covered += [u for a, b in choice.from_coordinator[device] for u in range(a, b)]
        assert sorted(covered) == list(range(span.start, span.end))  # each unit once
        # the coordinator sends only what no live device holds
        assert all(u in here for a, b in choice.from_coordinator[device] for u in range(a, b))
        for entry in fetches[device]:
            assert entry["from"] in alive and entry["step"] == 5
            # from its owner's own snapshot, or from the holder of the owner's backup
            assert entry["owner"] == entry["from"] or holders[entry["owner"]] == entry["from"]
    # every holder is told exactly the fetches made from it, and by whom
    grants = fetch_grants(fetches)
    made = sorted(
        (e["from"], d, e["owner"], e["start"], e["end"])
        for d, entries in fetches.items()
        for e in entries
        if e["from"] != d
    )
    told = sorted(
        (h, g["peer"], g["owner"], g["start"], g["end"]) for h, gs in grants.items() for g in gs
    )
    assert made == told
    assert all(g["run"] == 1 and g["step"] == 5 for gs in grants.values() for g in gs)


def test_rebalancing_moves_units_off_a_slow_device_only_when_worth_it() -> None:
    plan = _plan([("a", 0, 2), ("b", 2, 4), ("c", 4, 6)])
    counters = {
        "a": {"microbatches": 3, "forward_s": 0.3, "backward_s": 0.3},
        "b": {"microbatches": 3, "forward_s": 1.2, "backward_s": 1.2},  # four times slower
        "c": {"microbatches": 3, "forward_s": 0.3, "backward_s": 0.3},
    }
    found = rebalanced(plan, counters, [1.0] * 6, threshold=0.2)
    assert found.plan is not None
    sizes = {s.devices[0]: s.end - s.start for s in found.plan.stages}
    assert sizes["b"] < 2 and sum(sizes.values()) == 6
    assert found.fields["balanced"] < found.fields["bottleneck"]
    assert rebalanced(plan, counters, [1.0] * 6, threshold=0.99).plan is None
    unmeasured = {**counters, "c": {"microbatches": 0}}
    assert rebalanced(plan, unmeasured, [1.0] * 6, threshold=0.2).plan is None


def test_rebalancing_a_profiled_run_keeps_a_big_activation_off_a_slow_uplink() -> None:
    # a and b run the same units as fast, but b holds 5 of the 6 units; the even cut
    # (after unit 2) would make a send unit 2's 4.8 MB over its 50 Mbit/s uplink.
    from zpipe.planner.profile import synthetic_profile

    h = Harness()
    outputs = [1_000] * 6
    outputs[2] = 4_800_000
    profile = synthetic_profile(
        [0.05] * 6, outputs, param_bytes=[100] * 6, backward_times_s=[0.1] * 6,
        activation_bytes=[10] * 6,
    )  # fmt: skip
    links = {"a": 50.0, "b": 10_000.0}

    def profiled(name: str) -> None:  # the run was planned: every stage's profile is cached
        member = h.state.membership.get(name)
        assert member is not None
        h.state.profiles.put(SPEC, 1, "float32", member, profile, train=True)

    run = _start_training(
        h, ["a", "b"], partition=[[0, 1], [1, 6]], rebalance=0.1, links=links, then=profiled
    )
    h.client("replicate", run=run, step=2)
    for name, units in (("a", range(0, 1)), ("b", range(1, 6))):
        done = len(units) * 3  # 3 micro-batches at 0.15 s a unit
        metrics = {"microbatches": 3, "forward_s": done * 0.05, "backward_s": done * 0.1}
        h.feed_message(name, _weights(name, units, metrics=metrics))
    (reply,) = h.to_client("replicated")
    assert reply.body["error"] == ""
    moved = TrainingPlan.from_dict(reply.body["rebalance"])
    assert [(s.start, s.end) for s in moved.stages] == [(0, 2), (2, 6)]  # not (0, 3)
    assert moved.predicted["stage0_send_forward_s"] < 0.01
    (considered,) = h.events("rebalance_considered")
    assert considered["balanced_round_s"] < considered["round_s"]


def _backed_up(name: str, **extra: Any) -> Message:
    body = {"run": 0, "step": 0, "holder": "", "bytes": 0, **extra}
    return Message("backed_up", {"name": name, "keys": [], "error": "", **body})


def _replicating_over_chain(h: Harness) -> int:
    run = _start_training(
        h, ["a", "b", "c"], partition=[[0, 2], [2, 4], [4, 6]], replication="chain",
        progress=True,
    )  # fmt: skip
    h.client("replicate", run=run, step=0)
    assert [len(h.to(n, "backup_request")) for n in "abc"] == [1, 1, 1]
    h.feed_message("a", _backed_up("a"))
    h.feed_message("c", _backed_up("c"))
    return run


def test_a_backup_still_moving_to_its_peer_keeps_the_replica_wait_and_the_client_waiting() -> None:
    """Issue 17: b's backup to c crosses the probe sockets for longer than the result
    deadline (a big one on a slow link); its chunks, counted on b's heartbeats, are
    progress, and the client hears that the replica it awaits is moving."""
    h = Harness()
    run = _replicating_over_chain(h)
    result_s = h.state.timeouts.result_s
    moved = 0
    for _ in range(int(result_s * 1.5)):
        moved += 1 << 20
        h.stage("b", "heartbeat", metrics={"peer_state_bytes": moved})
        h.advance(1.0, alive=("a", "c"))
    assert h.to_client("replicated") == []  # still waiting, not given up
    notices = h.to_client("progress")
    assert notices
    assert all(n.body["run"] == run and n.body["awaited"] == "backed_up" for n in notices)
    # at most one notice per PROGRESS_NOTICE_S (2 s) of heartbeats every second
    assert len(notices) <= int(result_s * 1.5) // 2 + 1
    h.feed_message("b", _backed_up("b"))
    (reply,) = h.to_client("replicated")
    assert reply.body["error"] == ""


def test_a_backup_that_stops_moving_times_out_at_the_result_deadline() -> None:
    h = Harness()
    _replicating_over_chain(h)
    h.stage("b", "heartbeat", metrics={"peer_state_bytes": 1 << 20})
    result_s = h.state.timeouts.result_s
    h.advance(result_s + 5.0, alive=("a", "b", "c"))  # b alive, its backup stuck
    (reply,) = h.to_client("replicated")
    assert "backed_up from b" in reply.body["error"]


def test_without_the_clients_offer_no_progress_notice_is_sent() -> None:
    h = Harness()
    run = _start_training(h, ["a", "b", "c"], partition=[[0, 2], [2, 4], [4, 6]])
    h.client("replicate", run=run, step=0)
    for step in range(1, 6):
        h.stage("a", "heartbeat", metrics={"peer_state_bytes": step})
        h.advance(1.0, alive=("b", "c"))
    assert h.to_client("progress") == []
