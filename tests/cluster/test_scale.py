"""Clusters at scale: emulated-compute stages (forked), and a coordinator holding
hundreds of heartbeat-only fake peers (issue 18, parts 3 and 4)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from zpipe.cli.stage import main as stage_main
from zpipe.client import PipelineClient
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.cluster.coordinator_process import CoordinatorStart
from zpipe.cluster.forked import fork_stage
from zpipe.coordinator.loop_lag import LoopLag
from zpipe.models import ModelSpec, load_layer_sequence
from zpipe.stage.emulated_compute import (
    EmulatedShard,
    emulated_profile,
    profile_with_times,
    unit_times_at,
)
from zpipe.stage.shard import Shard
from zpipe.testing.fake_peers import FakePeers

UNITS = 24
SPEC = ModelSpec("mlp", {"dims": [8] + [32] * (UNITS - 1) + [4]}, seed=3)
UNIT_S = 0.01
BATCH = 4
STAGES = 12
SLOW, SLOWDOWN = "e5", 3.0


# ------------------------------------------------------------ in one process


@pytest.mark.parametrize(
    ("spec", "start", "end"),
    [
        (SPEC, 3, 9),
        (ModelSpec.preset("vit-tiny", num_layers=2, image_size=32), 0, 5),
        (ModelSpec.preset("bert-tiny", num_layers=1), 0, 4),
    ],
)
def test_emulated_shard_ships_the_real_output_shapes(spec: ModelSpec, start: int, end: int) -> None:
    sequence = load_layer_sequence(spec)
    profile = profile_with_times(spec, [0.001] * sequence.num_units, batch_size=2)
    values = sequence.example_input(2)
    if start:
        values = Shard.build(spec, 0, start).forward(values)[0]
    real, _ = Shard.build(spec, start, end).forward(values)
    emulated = EmulatedShard.build_emulated(spec, start, end, profile, slowdown=2.0)
    started = time.perf_counter()
    shipped, took = emulated.forward(values)
    waited = time.perf_counter() - started
    assert [(t.shape, t.dtype) for t in shipped] == [(t.shape, t.dtype) for t in real]
    assert took == pytest.approx(2.0 * 0.001 * (end - start))
    assert waited >= took  # it slept its profiled time times its slowdown


def test_emulated_times_follow_the_batch_size() -> None:
    base = profile_with_times(SPEC, [0.01] * UNITS, batch_size=4)
    assert unit_times_at(base, 2) == pytest.approx([0.005] * UNITS)  # in proportion below
    assert unit_times_at(base, 8) == pytest.approx([0.02] * UNITS)  # and above
    shown = emulated_profile(base, batch_size=6, slowdown=3.0, device_name="x")
    assert shown.batch_sizes == (6,)
    assert shown.times(6) == pytest.approx([0.045] * UNITS)
    assert shown.output_bytes(6)[0] == base.output_bytes(4)[0] * 6 // 4


def test_emulate_compute_refuses_a_bad_profile_file(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(SystemExit) as exc:
        stage_main(
            [
                "--coordinator",
                "tcp://127.0.0.1:1",
                "--name",
                "x",
                "--emulate-compute",
                str(tmp_path / "bad.json"),
            ]
        )
    assert exc.value.code == 2


def test_loop_lag_reports_quantiles_of_a_window_then_starts_a_new_one() -> None:
    lag = LoopLag(report_every_s=10.0)
    assert lag.due(0.0) is None  # the first call starts the clock
    for i in range(100):
        lag.woke(asked_at=float(i), woke_at=i + (0.5 if i == 99 else 0.001))
    assert lag.due(5.0) is None
    report = lag.due(10.0)
    assert report is not None
    assert report.samples == 100
    assert report.p50_s == pytest.approx(0.001)
    assert report.max_s == pytest.approx(0.5)
    assert lag.summary() is None  # a new window


def test_a_forked_stage_reports_its_exit_code_and_writes_its_log(tmp_path: Path) -> None:
    log = tmp_path / "bad.log"
    process = fork_stage(["--coordinator", "not-an-endpoint", "--name", "x"], log)
    assert process.wait(timeout=60) == 2  # argparse's usage error, in the child
    assert "--coordinator" in log.read_text()
    assert process.poll() == 2


# ------------------------------------------------------------ emulated stages


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    directory = tmp_path_factory.mktemp("emulated")
    profile = profile_with_times(SPEC, [UNIT_S] * UNITS, batch_size=BATCH)
    path = directory / "profile.json"
    profile.save(path)
    devices = [
        DeviceSpec(f"e{i}", slowdown=SLOWDOWN if f"e{i}" == SLOW else 1.0) for i in range(STAGES)
    ]
    # thirteen processes on the machine's cores: a kill makes the client report a stall,
    # which suspects every stage at once, and one silent for the probe and an interval
    # is dead; 6 intervals of probe (3.5 s in all) keep a starved live one alive
    with LocalCluster(
        devices,
        emulate_compute=path,
        fork_stages=True,
        measure_links=False,
        start_timeout_s=120.0,
        probe_intervals=6,
    ) as cluster:
        yield cluster


def _batches(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(BATCH, 8, generator=generator) for _ in range(count)]


def test_emulated_pipeline_is_bounded_by_its_slowest_stage(emulated: LocalCluster) -> None:
    count = 24
    per_stage = UNITS // STAGES
    partition = [[i * per_stage, (i + 1) * per_stage] for i in range(STAGES)]
    started = time.monotonic()
    outputs, report = emulated.infer(
        SPEC, _batches(count), partition=partition, microbatch_size=BATCH, max_in_flight=STAGES
    )
    elapsed = time.monotonic() - started
    assert len(outputs) == count
    assert all(out[0].shape == (BATCH, 4) for out in outputs)
    slow_s = per_stage * UNIT_S * SLOWDOWN
    # the slow stage slept its profiled time x its slowdown for each micro-batch, in turn
    assert report.stages[SLOW]["busy_s"] >= count * slow_s
    assert elapsed >= count * slow_s
    busiest = max(report.stages, key=lambda name: report.stages[name]["busy_s"])
    assert busiest == SLOW
    for name, counters in report.stages.items():
        assert counters["microbatches"] == count, name


def test_a_killed_emulated_stage_is_recovered(emulated: LocalCluster) -> None:
    count = 30
    profile = profile_with_times(SPEC, [UNIT_S] * UNITS, batch_size=BATCH)
    victim = "e7"
    killed = []

    def progress(received: int, _sent: int) -> None:
        if received == 6 and not killed:
            killed.append(time.monotonic())
            emulated.kill(victim)

    outputs, report = emulated.infer(
        SPEC,
        _batches(count),
        profile=profile,
        planner="pipeedge",
        microbatch_size=BATCH,
        max_in_flight=STAGES,
        progress=progress,
    )
    assert killed
    assert len(outputs) == count
    assert all(out[0].shape == (BATCH, 4) for out in outputs)
    assert [r["dead"] for r in report.recoveries] == [victim]
    assert victim not in [s.device for s in report.plan.stages]


# ------------------------------------------------------------ fake peers


def test_a_coordinator_holds_hundreds_of_peers_without_a_false_death(tmp_path: Path) -> None:
    peers_count, interval_s, intervals = 220, 1.0, 6
    log_path, endpoint_path = tmp_path / "coordinator.log", tmp_path / "coordinator.endpoint"
    with open(log_path, "wb") as log_file:
        # port 0, and the endpoint it got: a port picked here could be taken meanwhile
        coordinator = subprocess.Popen(
            [sys.executable, "-m", "zpipe.coordinator", "--bind", "tcp://127.0.0.1:0",
             "--endpoint-file", str(endpoint_path),
             "--heartbeat-interval", str(interval_s), "--log-format", "json"],
            stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip

    async def hold() -> tuple[object, list[dict[str, object]]]:
        endpoint = await CoordinatorStart(
            coordinator, endpoint_path, log_path.read_text, timeout_s=300
        ).wait_async()
        async with FakePeers(endpoint, peers_count) as peers:
            await asyncio.sleep(intervals * interval_s)
            summary = peers.summary()
            async with PipelineClient(endpoint) as client:
                members = await client.cluster_state()
        return summary, members

    try:
        summary, members = asyncio.run(hold())
    finally:
        coordinator.send_signal(signal.SIGTERM)
        coordinator.wait(timeout=30)
    log = log_path.read_text()
    assert len(members) == peers_count
    assert all(m["state"] != "dead" for m in members)
    assert '"stage_dead"' not in log
    assert summary.register_again == 0  # type: ignore[attr-defined]
    assert summary.acks > 0  # type: ignore[attr-defined]
