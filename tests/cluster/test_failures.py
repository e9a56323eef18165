"""A stage killed during inference is detected and reported within the configured bound."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import torch

from zpipe import StageFailedError
from zpipe._errors import ConfigError
from zpipe.client import PipelineClient
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.config import Timeouts
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence
from zpipe.transport.ports import free_tcp_port

# Detection floors of several seconds: a live stage starved of CPU (a loaded CI
# machine, --cpu-burners) may miss a second of heartbeats and must not die of it.
INTERVAL = 0.5
SUSPECT_AFTER = 6
PROBE_INTERVALS = 4


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_stage_that_dies_mid_run_is_reported_to_the_client(sig: int) -> None:
    devices = [DeviceSpec("a"), DeviceSpec("b"), DeviceSpec("c")]
    spec = ModelSpec("mlp", {"dims": [8, 64, 64, 64, 4]}, seed=0)
    sequence = load_layer_sequence(spec)
    killed_at: list[float] = []

    with LocalCluster(
        devices,
        heartbeat_interval_s=INTERVAL,
        suspect_after=SUSPECT_AFTER,
        probe_intervals=PROBE_INTERVALS,
    ) as cluster:

        async def endless() -> AsyncIterator[torch.Tensor]:
            for i in range(100_000):
                if i == 20:
                    cluster.kill("b", sig)
                    killed_at.append(time.monotonic())
                yield sequence.example_input(2, seed=i)[0]
                await asyncio.sleep(0.01)

        async def run() -> None:
            async with cluster.client() as client:
                stream = client.infer_stream(spec, endless(), max_in_flight=2, recover=False)
                async for _ in stream:
                    pass

        try:
            with pytest.raises(StageFailedError) as info:
                asyncio.run(run())
            reported_after = time.monotonic() - killed_at[0]
            assert info.value.stage == "b"
            assert "heartbeat" in info.value.reason
            # found by the heartbeat detector (suspect, then an unanswered probe), not by
            # the client's result timeout; how fast is bench/recovery.py's detection_time_s
            assert reported_after < Timeouts().result_s / 4, reported_after
            assert reported_after >= SUSPECT_AFTER * INTERVAL * 0.5
            logs = cluster.logs("coordinator")
            assert '"stage_suspect"' in logs and '"stage_dead"' in logs
        finally:
            if sig == signal.SIGSTOP:
                cluster.kill("b", signal.SIGKILL)


def test_a_stream_is_replanned_around_a_killed_stage_and_delivers_every_output_once(
    tmp_path: Path,
) -> None:
    devices = [DeviceSpec("a"), DeviceSpec("b"), DeviceSpec("c")]
    spec = ModelSpec("mlp", {"dims": [8, 64, 64, 64, 4]}, seed=1)
    sequence = load_layer_sequence(spec)
    batches = [sequence.example_input(2, seed=i) for i in range(60)]
    reference = build_full_model(spec)

    with LocalCluster(
        devices,
        heartbeat_interval_s=INTERVAL,
        suspect_after=SUSPECT_AFTER,
        probe_intervals=PROBE_INTERVALS,
    ) as cluster:

        def kill_b_after_15(received: int, _sent: int) -> None:
            if received == 15:
                cluster.kill("b")

        # the even partition, so that b is in the pipeline when it dies
        trace = tmp_path / "trace.json"
        outputs, report = cluster.infer(
            spec, batches, planner="even", max_in_flight=3, progress=kill_b_after_15, trace=trace
        )
        logs = cluster.logs("coordinator")
    assert len(outputs) == len(batches)
    with torch.inference_mode():
        for got, batch in zip(outputs, batches, strict=True):
            torch.testing.assert_close(got[0], reference(*batch)[0])
    assert [r["dead"] for r in report.recoveries] == ["b"]
    assert report.recoveries[0]["replayed"] >= 1  # b held micro-batches when it died
    # lightweight (the default): a and c keep their order and share the 4 units evenly
    assert [(s.device, s.start, s.end) for s in report.plan.stages] == [("a", 0, 2), ("c", 2, 4)]
    assert '"run_recovered"' in logs and '"policy": "lightweight"' in logs
    # the trace marks the failure and the re-plan, and the survivors' spans of the
    # whole run are in it (a re-plan keeps a stage's timeline)
    events = json.loads(trace.read_text())["traceEvents"]
    instants = [e["name"] for e in events if e["ph"] == "i"]
    assert instants[0] == "stage b failed" and instants[1].startswith("re-planned without b")
    first = next(
        e["pid"] for e in events if e["name"] == "process_name" and e["args"]["name"] == "a"
    )
    computed = {e["args"]["mb"] for e in events if e["pid"] == first and e.get("cat") == "compute"}
    assert computed == set(range(60))


def test_respipe_and_heavy_recovery_each_deliver_every_output_once() -> None:
    spec = ModelSpec("mlp", {"dims": [8, 32, 32, 32, 32, 32, 4]}, seed=2)  # 6 units
    sequence = load_layer_sequence(spec)
    batches = [sequence.example_input(2, seed=i) for i in range(40)]
    reference = build_full_model(spec)
    devices = [DeviceSpec(name) for name in ("a", "b", "c", "d")]
    with LocalCluster(
        devices,
        heartbeat_interval_s=INTERVAL,
        suspect_after=SUSPECT_AFTER,
        probe_intervals=PROBE_INTERVALS,
    ) as cluster:

        def killer(name: str) -> Callable[[int, int], None]:
            def kill_after_10(received: int, _sent: int) -> None:
                if received == 10:
                    cluster.kill(name)

            return kill_after_10

        partition = [[0, 1], [1, 3], [3, 5], [5, 6]]
        runs = {}
        runs["respipe"] = cluster.infer(
            spec, batches, partition=partition, recovery="respipe", max_in_flight=3,
            progress=killer("b"),
        )  # fmt: skip
        runs["heavy"] = cluster.infer(
            spec, batches, stage_names=["a", "c", "d"], planner="even", recovery="heavy",
            max_in_flight=3, progress=killer("c"),
        )  # fmt: skip
    for outputs, _ in runs.values():
        assert len(outputs) == len(batches)
        with torch.inference_mode():
            for got, batch in zip(outputs, batches, strict=True):
                torch.testing.assert_close(got[0], reference(*batch)[0])
    respipe = runs["respipe"][1]
    assert [r["dead"] for r in respipe.recoveries] == ["b"]
    # the next stage, c, took all of b's units; the others kept theirs
    assert [(s.device, s.start, s.end) for s in respipe.plan.stages] == [
        ("a", 0, 1), ("c", 1, 5), ("d", 5, 6)
    ]  # fmt: skip
    heavy = runs["heavy"][1]
    assert [r["dead"] for r in heavy.recoveries] == ["c"]
    # planned afresh over the survivors by the run's own planner (even): 3 units each
    assert [(s.start, s.end) for s in heavy.plan.stages] == [(0, 3), (3, 6)]
    assert sorted(heavy.plan.devices) == ["a", "d"]


def test_an_unknown_recovery_policy_is_refused_before_the_run() -> None:
    client = PipelineClient("tcp://127.0.0.1:1")
    with pytest.raises(ConfigError, match="unknown recovery 'fastest'"):
        asyncio.run(client.infer(ModelSpec("mlp", {"dims": [2, 2]}), [], recovery="fastest"))


def test_stage_without_a_coordinator_exits_with_a_clear_message() -> None:

    started = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "zpipe.stage",
            "--coordinator",
            f"tcp://127.0.0.1:{free_tcp_port()}",
            "--name",
            "lonely",
            "--connect-timeout",
            "1.5",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "could not reach the coordinator" in result.stderr
    # it gives up (after 1.5 s of trying), never waits on: a bound a starved process meets
    assert time.monotonic() - started < 55


def _wait_exit(process: subprocess.Popen[bytes], timeout: float) -> int:
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise


def test_sigterm_stops_a_stage_and_the_coordinator_stops_its_stages() -> None:
    with LocalCluster([DeviceSpec("x"), DeviceSpec("y"), DeviceSpec("z")]) as cluster:
        cluster.processes["x"].send_signal(signal.SIGTERM)
        assert _wait_exit(cluster.processes["x"], 20) == 0
        # the coordinator's SIGTERM tells every stage still registered to shut down
        cluster.processes["coordinator"].send_signal(signal.SIGTERM)
        assert _wait_exit(cluster.processes["coordinator"], 20) == 0
        assert _wait_exit(cluster.processes["y"], 20) == 0
        assert _wait_exit(cluster.processes["z"], 20) == 0
        assert '"stage_shutdown"' in cluster.logs("y")


def test_a_stage_whose_coordinator_dies_exits_with_a_clear_message() -> None:
    with LocalCluster([DeviceSpec("x")], heartbeat_interval_s=0.2) as cluster:
        # serves on while the coordinator is away, up to its --coordinator-timeout
        cluster.start_stage(DeviceSpec("orphan"), "--coordinator-timeout", "3")
        cluster.wait_for_stages(2, timeout_s=60)
        cluster.kill("coordinator")
        # one that starts now never reaches it and gives up after its connect timeout
        late = cluster.start_stage(DeviceSpec("late"), "--connect-timeout", "2")
        assert _wait_exit(late, 30) == 1
        assert "could not reach the coordinator" in cluster.logs("late")
        assert _wait_exit(cluster.processes["orphan"], 30) == 1
        assert '"coordinator_away"' in cluster.logs("orphan")
        assert "no word from the coordinator" in cluster.logs("orphan")


def test_a_stream_stall_finds_a_dead_stage_before_its_heartbeats_lapse() -> None:
    spec = ModelSpec("mlp", {"dims": [8, 64, 64, 64, 4]}, seed=2)
    sequence = load_layer_sequence(spec)
    batches = [sequence.example_input(2, seed=i) for i in range(60)]
    reference = build_full_model(spec)
    # heartbeats alone would take 20 intervals (6 s) to suspect anyone
    with LocalCluster(
        [DeviceSpec("a"), DeviceSpec("b"), DeviceSpec("c")],
        heartbeat_interval_s=INTERVAL,
        suspect_after=20,
        probe_intervals=PROBE_INTERVALS,
    ) as cluster:

        def kill_b_after_15(received: int, _sent: int) -> None:
            if received == 15:
                cluster.kill("b")

        outputs, report = cluster.infer(
            spec, batches, planner="even", max_in_flight=3, progress=kill_b_after_15
        )
        logs = cluster.logs("coordinator")
    assert len(outputs) == len(batches)
    with torch.inference_mode():
        for got, batch in zip(outputs, batches, strict=True):
            torch.testing.assert_close(got[0], reference(*batch)[0])
    assert [r["dead"] for r in report.recoveries] == ["b"]
    suspected = [
        json.loads(line)
        for line in logs.splitlines()
        if '"event": "stage_suspect"' in line and '"stage": "b"' in line
    ]
    assert suspected and suspected[0]["reason"] == "stall"
    assert '"stall_reported"' in logs
