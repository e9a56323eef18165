"""Training survives a killed stage: replicas, re-planning over the survivors, replay.

Real stage processes are killed with SIGKILL mid-run; the trained model must equal
single-process training on the same mini-batches (``exact`` consistency).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests._support.training import (
    SGD,
    SPEC,
    assert_same_weights,
    make_batches,
    train_single_process,
)
from tests._support.training_recovery import (
    INTERVAL,
    PROBE_INTERVALS,
    SUSPECT_AFTER,
    _cluster,
    _events,
    _learnable_batches,
)
from zpipe._errors import ConfigError, StageFailedError
from zpipe.client import PipelineClient, TrainReport
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.models import ModelSpec
from zpipe.recovery import DeadlinePolicy


def _train_killing(
    cluster: LocalCluster,
    victims: dict[int, str],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    **fit: object,
) -> TrainReport:
    """Train, killing ``victims[step]`` as soon as mini-batch ``step``'s loss is known."""
    killed: set[str] = set()

    def on_step(step: int, _loss: float) -> None:
        victim = victims.get(step)
        if victim is not None and victim not in killed:
            killed.add(victim)
            cluster.kill(victim)

    return cluster.fit(
        SPEC, batches, optimizer=SGD, num_microbatches=3, progress=False, on_step=on_step, **fit
    )


def test_a_killed_stage_is_replaced_and_training_ends_as_if_uninterrupted() -> None:
    batches = make_batches(8, 9, seed=21)
    want, want_losses = train_single_process(SPEC, batches, SGD)
    with _cluster(["a", "b", "c", "d"]) as cluster:
        report = _train_killing(
            cluster,
            # b dies just as the replica before mini-batch 6 is requested (the survivors
            # are asked for weights of a round that never completes); c dies after the
            # last mini-batch, as the weights are gathered, and the resumed run replays
            # from the replica it took before mini-batch 6
            {5: "b", 7: "c"},
            batches,
            partition=[[0, 1], [1, 2], [2, 3], [3, 4]],
            stage_names=["a", "b", "c", "d"],
            recover=True,
            replicate_every=3,
        )
        logs = cluster.logs("coordinator")
    assert report.losses == pytest.approx(want_losses, rel=1e-5)
    assert_same_weights(report.state_dict, want)  # momentum included: exact, not close
    assert [r["dead"] for r in report.recoveries] == ["b", "c"]
    assert [r["resumed_from"] for r in report.recoveries] == [3, 6]
    assert report.replicas == [0, 3, 6]
    assert report.training_plan is not None
    assert sorted(report.training_plan.devices) == ["a", "d"]
    assert '"replica_kept"' in logs and '"training_replanned"' in logs


def test_without_recover_a_killed_stage_ends_the_run_with_a_clear_error() -> None:
    batches = make_batches(4, 9, seed=22)
    with _cluster(["a", "b"]) as cluster, pytest.raises(StageFailedError, match="b"):
        _train_killing(cluster, {1: "b"}, batches, partition=[[0, 2], [2, 4]])


def test_recovery_arguments_are_checked_before_anything_runs() -> None:
    client = PipelineClient("tcp://127.0.0.1:1")  # never opened: the checks come first
    for kwargs, problem in [
        ({"recovery": "pray"}, "unknown recovery 'pray'"),
        ({"replicate_every": 0}, "replicate_every must be >= 1"),
    ]:
        with pytest.raises(ConfigError, match=problem):
            asyncio.run(client.fit(SPEC, [], optimizer=SGD, num_microbatches=1, **kwargs))


@pytest.mark.parametrize("recovery", ["heavy", "respipe"])
def test_heavy_and_respipe_recovery_also_end_as_if_uninterrupted(recovery: str) -> None:
    batches = make_batches(6, 9, seed=23)
    want, want_losses = train_single_process(SPEC, batches, SGD)
    with _cluster(["a", "b", "c"]) as cluster:
        report = _train_killing(
            cluster,
            {2: "b"},
            batches,
            partition=[[0, 1], [1, 3], [3, 4]],
            stage_names=["a", "b", "c"],
            recover=True,
            replicate_every=2,
            recovery=recovery,
        )
    assert report.losses == pytest.approx(want_losses, rel=1e-5)
    assert_same_weights(report.state_dict, want)
    assert [(r["dead"], r["resumed_from"], r["policy"]) for r in report.recoveries] == [
        ("b", 2, recovery)
    ]
    assert report.training_plan is not None
    if recovery == "respipe":
        # the stage after b took all of b's units; a kept its own
        assert [(s.devices, s.start, s.end) for s in report.training_plan.stages] == [
            (("a",), 0, 1), (("c",), 1, 4)
        ]  # fmt: skip
    else:
        assert sorted(report.training_plan.devices) == ["a", "c"]


def test_a_slow_stage_is_rebalanced_not_declared_dead() -> None:
    # Wide layers and 32-row micro-batches: b's 4x slowdown stretches its compute
    # (CPU time), which must outweigh the waits for a core that a loaded machine adds
    # to every stage alike (with 64-wide layers and 3 rows it did not, and b measured
    # as fast as the others).
    spec = ModelSpec("mlp", {"dims": [12, *[384] * 6, 4]}, seed=5)  # 7 units
    batches = make_batches(8, 96, seed=24)
    want, want_losses = train_single_process(spec, batches, SGD)
    devices = [DeviceSpec("a"), DeviceSpec("b", slowdown=4.0), DeviceSpec("c")]
    with LocalCluster(devices, heartbeat_interval_s=INTERVAL) as cluster:
        report = cluster.fit(
            spec,
            batches,
            optimizer=SGD,
            num_microbatches=3,
            partition=[[0, 2], [2, 5], [5, 7]],  # the slow device holds the most units
            stage_names=["a", "b", "c"],
            recover=True,
            replicate_every=2,
            rebalance=0.2,
            progress=False,
        )
        logs = cluster.logs("coordinator")
    assert report.losses == pytest.approx(want_losses, rel=1e-5)
    assert_same_weights(report.state_dict, want)
    assert report.recoveries == []  # slow, not dead
    # at the first replica with measurements (2), or a later one when a loaded
    # machine's noise hid the gain at the first (all stages slow alike under load)
    assert report.rebalances, "the slow stage was never rebalanced"
    assert report.rebalances[0]["at"] in (2, 4, 6, 8)
    assert report.training_plan is not None
    ranges = {s.devices[0]: s.end - s.start for s in report.training_plan.stages}
    assert ranges["b"] < 3 and sum(ranges.values()) == 7
    assert '"rebalanced"' in logs


def test_rebalance_needs_recover_and_a_share() -> None:
    client = PipelineClient("tcp://127.0.0.1:1")
    for kwargs in ({"rebalance": 0.2}, {"recover": True, "rebalance": 1.5}):
        with pytest.raises(ConfigError, match="rebalance needs recover=True"):
            asyncio.run(client.fit(SPEC, [], optimizer=SGD, num_microbatches=1, **kwargs))


def test_two_stages_killed_at_once_are_both_left_out_of_the_heavy_plan() -> None:
    batches = make_batches(8, 9, seed=25)
    want, want_losses = train_single_process(SPEC, batches, SGD)
    with _cluster(["a", "b", "c", "d"]) as cluster:
        killed: list[str] = []

        def on_step(step: int, _loss: float) -> None:
            if step == 4 and not killed:
                killed.extend(["b", "c"])
                cluster.kill("b")
                cluster.kill("c")

        report = cluster.fit(
            SPEC,
            batches,
            optimizer=SGD,
            num_microbatches=3,
            progress=False,
            on_step=on_step,
            partition=[[0, 1], [1, 2], [2, 3], [3, 4]],
            stage_names=["a", "b", "c", "d"],
            recover=True,
            replicate_every=3,
            recovery="heavy",
        )
    assert report.losses == pytest.approx(want_losses, rel=1e-5)
    assert_same_weights(report.state_dict, want)
    assert report.recoveries[0]["resumed_from"] == 3
    assert report.training_plan is not None
    assert set(report.training_plan.devices) <= {"a", "d"}


def test_fast_consistency_keeps_the_survivors_newer_weights_and_the_loss_keeps_falling() -> None:
    adam = {"name": "adam", "lr": 0.01}
    batches = _learnable_batches()
    _, want_losses = train_single_process(SPEC, batches, adam)
    with _cluster(["a", "b", "c"]) as cluster:
        killed: set[str] = set()

        def on_step(step: int, _loss: float) -> None:
            if step == 5 and not killed:
                killed.add("b")
                cluster.kill("b")

        report = cluster.fit(
            SPEC,
            batches,
            optimizer=adam,
            num_microbatches=3,
            progress=False,
            on_step=on_step,
            partition=[[0, 1], [1, 3], [3, 4]],
            stage_names=["a", "b", "c"],
            recover=True,
            replicate_every=4,
            consistency="fast",
        )
        log = cluster.logs("coordinator")
        survivor_log = cluster.logs("a")
    # a's data port was bound again for the first plan only: the recovery's plan has
    # the same model, so its limits, and re-binding under a connected upstream could
    # crash libzmq's I/O thread (a stage segfaulted there in CI)
    assert survivor_log.count('"assignment_received"') >= 2
    assert survivor_log.count('"data_port_rebound"') == 1
    # every mini-batch trained once: what had completed was not trained again
    assert len(report.losses) == len(batches)
    (recovery,) = report.recoveries
    assert (recovery["dead"], recovery["replica"], recovery["consistency"]) == ("b", 4, "fast")
    assert recovery["resumed_from"] >= 6  # after the replica: mini-batches 4 and 5 stay
    # up to the failure the run is the uninterrupted one
    assert report.losses[:6] == pytest.approx(want_losses[:6], rel=1e-5)
    epochs = [sum(report.losses[i : i + 4]) / 4 for i in range(0, 16, 4)]
    assert epochs == sorted(epochs, reverse=True), epochs  # falling, epoch after epoch
    assert epochs[-1] < epochs[0] - 0.2
    # only the dead stage's units (1 and 2) came from the replica; a and c kept theirs
    (fast,) = [json.loads(line) for line in log.splitlines() if '"fast_resume"' in line]
    assert fast["units_from_replica"] == [1, 2]
    assert fast["replica_step"] == 4
    assert set(fast["completed"]) == {"a", "c"}
    assert all(done >= 5 for done in fast["completed"].values())


def test_an_unknown_consistency_or_replication_is_refused() -> None:
    client = PipelineClient("tcp://127.0.0.1:1")
    with pytest.raises(ConfigError, match="unknown consistency 'eventual'"):
        asyncio.run(client.fit(SPEC, [], optimizer=SGD, num_microbatches=1, consistency="eventual"))
    with pytest.raises(ConfigError, match="unknown replication 'gossip'"):
        asyncio.run(client.fit(SPEC, [], optimizer=SGD, num_microbatches=1, replication="gossip"))


def test_a_stall_at_the_data_source_finds_a_dead_stage_before_its_heartbeats_lapse() -> None:
    batches = make_batches(10, 9, seed=26)
    want, want_losses = train_single_process(SPEC, batches, SGD)
    # heartbeats alone would take 20 intervals (6 s) to suspect anyone
    with LocalCluster(
        [DeviceSpec(n) for n in ("a", "b", "c")],
        heartbeat_interval_s=INTERVAL,
        suspect_after=20,
        probe_intervals=PROBE_INTERVALS,
    ) as cluster:
        report = _train_killing(
            cluster,
            {4: "b"},
            batches,
            partition=[[0, 1], [1, 3], [3, 4]],
            stage_names=["a", "b", "c"],
            recover=True,
            replicate_every=6,
            stall_deadline=DeadlinePolicy(k=5.0, min_samples=2, floor_s=0.25, cold_start_s=10),
        )
        log = cluster.logs("coordinator")
    assert report.losses == pytest.approx(want_losses, rel=1e-5)
    assert_same_weights(report.state_dict, want)
    assert [r["dead"] for r in report.recoveries] == ["b"]
    suspected = [e for e in _events(log, "stage_suspect") if e["stage"] == "b"]
    assert suspected and suspected[0]["reason"] == "stall"  # before any heartbeat lapsed
    assert _events(log, "stall_reported")
    assert [e["stage"] for e in _events(log, "stage_dead")] == ["b"]


def test_a_slow_stage_answers_the_stall_probe_and_is_not_declared_dead() -> None:
    batches = make_batches(6, 9, seed=27)
    want, want_losses = train_single_process(SPEC, batches, SGD)
    devices = [DeviceSpec("a"), DeviceSpec("b", slowdown=3.0), DeviceSpec("c")]
    # a hair-trigger deadline: every wait past the last one's length is a stall
    hair_trigger = DeadlinePolicy(k=0.0, min_samples=1, floor_s=0.0, cold_start_s=0.0,
                                  mad_floor_ratio=0.0)  # fmt: skip
    # the hair trigger reports a stall at nearly every result, and each report suspects
    # every stage: one silent for the probe and an interval is dead. Generous probes (10
    # intervals, 5 s) keep a stage a loaded machine starves alive; each must still answer
    with LocalCluster(
        devices, heartbeat_interval_s=INTERVAL, suspect_after=10, probe_intervals=10
    ) as cluster:
        report = cluster.fit(
            SPEC,
            batches,
            optimizer=SGD,
            num_microbatches=3,
            progress=False,
            partition=[[0, 1], [1, 3], [3, 4]],
            stage_names=["a", "b", "c"],
            recover=True,
            replicate_every=3,
            stall_deadline=hair_trigger,
        )
        log = cluster.logs("coordinator")
    assert report.losses == pytest.approx(want_losses, rel=1e-5)
    assert_same_weights(report.state_dict, want)
    assert report.recoveries == []
    assert _events(log, "stall_reported")  # the stalls were reported and probed...
    assert _events(log, "stage_answered_probe")
    assert _events(log, "stage_dead") == []  # ...and everyone answered


# b computes twice as fast as a and c. Each is a slowed-down device whose extra time
# is a multiple of its compute thread's CPU time (one thread: see
# zpipe/transport/emulation.py), which a loaded machine barely changes, so the
# profiles keep the spread. With a, b and c alike the planner predicted a third
# device to gain 0-26 % from profiles of the bare model (microseconds per layer),
# and under load the new b, profiled alone and later than a and c, looked slow
# enough to miss the 5 % its admission asks. Twice as fast, b would have to look
# twice as slow as it is (a gain of 16 % still) before its admission is in doubt.
# Whether a and c both pay their way is less sure: under three busy loops the
# planner left one of them out of a plan in 6 of 16 runs, so the test below asks
# only about b.
_SLOW = DeviceSpec("slow", slowdown=20.0, threads=1)
_FAST = DeviceSpec("fast", slowdown=10.0, threads=1)


def test_a_stage_that_restarts_is_replaced_then_taken_back_into_the_plan() -> None:
    spec = ModelSpec("mlp", {"dims": [12, *[48] * 8, 4]}, seed=5)
    batches = make_batches(12, 12, seed=28)
    want, want_losses = train_single_process(spec, batches, SGD)
    with LocalCluster(
        [replace(_SLOW, name="a"), replace(_FAST, name="b"), replace(_SLOW, name="c")],
        heartbeat_interval_s=INTERVAL,
        suspect_after=SUSPECT_AFTER,
        probe_intervals=PROBE_INTERVALS,
    ) as cluster:
        first_endpoint: list[str] = []

        def on_step(step: int, _loss: float) -> None:
            if step == 4 and not first_endpoint:
                # b's process dies and a new one comes up under its name at once
                first_endpoint.append("killed")
                cluster.kill("b")
                cluster.start_stage(replace(_FAST, name="b"))

        async def source() -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
            async with cluster.client() as watcher:
                (b,) = [m for m in await watcher.cluster_state() if m["name"] == "b"]
                for step, batch in enumerate(batches):
                    if step == 6:
                        # the replica before mini-batch 6 comes after the new b is up,
                        # however slowly it starts on a loaded machine
                        await _until_registered_again(watcher, "b", b["data_endpoint"])
                    yield batch

        report = cluster.fit(
            spec,
            source(),
            optimizer=SGD,
            num_microbatches=4,
            microbatch_size=3,
            progress=False,
            on_step=on_step,
            stage_names=["a", "b", "c"],
            recover=True,
            replicate_every=3,
            # b over a and c alone was predicted to gain 39-52 % at load 11-15 (see _FAST)
            rebalance=0.05,
        )
        log = cluster.logs("coordinator")
    assert report.losses == pytest.approx(want_losses, rel=1e-5)
    assert_same_weights(report.state_dict, want)
    # the old process was lost with its run: found silent, or replaced by its new self
    assert [(r["dead"], r["resumed_from"]) for r in report.recoveries] == [("b", 3)]
    assert [e["stage"] for e in _events(log, "stage_dead")] == ["b"]
    # ...and the new one joined the run at the next replica, the planner predicting
    # a shorter round with it
    # (on a loaded machine the first plan may leave a slow device out, so it can be a
    # newcomer too)
    considered = _events(log, "admission_considered")
    assert any("b" in event["newcomers"] for event in considered)
    # b came back into the run at a replica after it registered again (measured speeds
    # may also move boundaries at a replica: those moves keep the same devices)
    after = [r for r in report.rebalances if r["at"] > report.recoveries[0]["resumed_from"]]
    joined = [r["at"] for r in after if "b" in _devices_of(r["plan"])]
    assert joined and joined[0] in (6, 9)
    # b admitted once, and in the last plan; the slow a and c (20x) are the planner's
    # call on the speeds it measured: under load (three busy loops on two cores) it
    # left one of them out of the first plan or the last in 6 of 16 runs, on this code
    # and on the code before the feed waited for room alike
    admitted = [e["devices"] for e in _events(log, "admitted")]
    assert sum("b" in devices for devices in admitted) == 1
    assert report.training_plan is not None
    assert "b" in report.training_plan.devices


def _devices_of(plan: dict[str, object]) -> list[str]:
    return [d for stage in plan["stages"] for d in stage["devices"]]  # type: ignore[attr-defined]


async def _until_registered_again(client: PipelineClient, name: str, old_endpoint: str) -> None:
    # a new process imports torch before it registers: up to a minute on a loaded machine
    deadline = time.monotonic() + 180.0
    while time.monotonic() < deadline:
        members = await client.cluster_state()
        if any(
            m["name"] == name and m["state"] == "alive" and m["data_endpoint"] != old_endpoint
            for m in members
        ):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{name} did not register again within 180 s")


@pytest.mark.parametrize("replication", ["chain", "topology"])
def test_replicas_kept_at_the_stages_recover_a_killed_stage_exactly(replication: str) -> None:
    batches = make_batches(8, 9, seed=29)
    want, want_losses = train_single_process(SPEC, batches, SGD)
    with _cluster(["a", "b", "c"]) as cluster:
        report = _train_killing(
            cluster,
            {4: "b"},
            batches,
            partition=[[0, 1], [1, 3], [3, 4]],
            stage_names=["a", "b", "c"],
            recover=True,
            replicate_every=3,
            replication=replication,
        )
        log = cluster.logs("coordinator")
        c_log = cluster.logs("c")
    assert report.losses == pytest.approx(want_losses, rel=1e-5)
    assert_same_weights(report.state_dict, want)
    assert [(r["dead"], r["resumed_from"]) for r in report.recoveries] == [("b", 3)]
    kept = _events(log, "replica_kept")
    first = kept[0]
    # each stage backed up to the next; the last to the coordinator (chain) or to the
    # first stage (topology), so the coordinator held the last stage's units or nothing
    last_holder = "coordinator" if replication == "chain" else "a"
    assert first["holders"] == {"a": "b", "b": "c", "c": last_holder}
    if replication == "chain":
        assert (
            0
            < int(first["bytes"])
            < sum(  # type: ignore[call-overload]
                t.numel() * t.element_size() for t in want.values()
            )
        )
    else:
        assert first["bytes"] == 0
    # b's units came from the backup c kept of them
    assert '"backup_kept"' in c_log and '"owner": "b"' in c_log


def test_with_keys_the_holder_serves_the_units_the_new_plan_gives_a_peer(
    tmp_path: Path,
) -> None:
    # The coordinator tells c (b's backup holder) who fetches b's units in the new
    # plan; with keys, c answers that device's fetch (and would refuse any other).
    from zpipe.transport.roles import generate_keys_with_roles

    batches = make_batches(8, 9, seed=29)
    want, want_losses = train_single_process(SPEC, batches, SGD)
    keys = tmp_path / "keys"
    generate_keys_with_roles(keys, ["coordinator", "client", "a", "b", "c"])
    with LocalCluster(
        [DeviceSpec(name) for name in ("a", "b", "c")],
        heartbeat_interval_s=INTERVAL,
        suspect_after=SUSPECT_AFTER,
        probe_intervals=PROBE_INTERVALS,
        keys_dir=keys,
    ) as cluster:
        report = _train_killing(
            cluster,
            {4: "b"},
            batches,
            partition=[[0, 1], [1, 3], [3, 4]],
            stage_names=["a", "b", "c"],
            recover=True,
            replicate_every=3,
            replication="chain",
        )
        logs = cluster.logs("a") + cluster.logs("c")
        c_log = cluster.logs("c")
    assert report.losses == pytest.approx(want_losses, rel=1e-5)
    assert_same_weights(report.state_dict, want)
    assert [(r["dead"], r["resumed_from"]) for r in report.recoveries] == [("b", 3)]
    assert "fetch_refused" not in logs
    # a took some of b's units in the new plan: c served them from its backup of b
    assert '"units_served"' in c_log and '"peer": "a"' in c_log
