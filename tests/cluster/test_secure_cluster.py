"""A cluster with --keys: only devices with allowed keys join or inject data."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from zpipe.client.runs.lossy import StagesLossyResult, run_lossy
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.lossy.data import Dataset
from zpipe.lossy.simulate import RunConfig, prepare_run
from zpipe.lossy.trace import evaluate_in_process, same_run, train_in_process
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence
from zpipe.transport import security
from zpipe.transport.codec import Message, decode, encode
from zpipe.transport.roles import generate_keys_with_roles


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("keys")
    trusted = root / "trusted"
    security.generate_keys(trusted, ["coordinator", "client", "k0", "k1"])
    # An intruder has its own pair and knows the coordinator's public key, but the
    # coordinator's directory does not hold the intruder's public key.
    intruder = root / "intruder"
    security.generate_keys(intruder, ["mallory"])
    shutil.copy(trusted / "coordinator.key", intruder / "coordinator.key")
    return {"trusted": trusted, "intruder": intruder}


def test_secure_cluster_runs_and_refuses_unknown_keys(keys: dict[str, Path]) -> None:
    spec = ModelSpec("mlp", {"dims": [6, 16, 16, 4]}, seed=1)
    sequence = load_layer_sequence(spec)
    batches = [sequence.example_input(3, seed=i) for i in range(3)]
    devices = [DeviceSpec("k0"), DeviceSpec("k1")]
    with LocalCluster(devices, keys_dir=keys["trusted"], heartbeat_interval_s=0.5) as cluster:
        # An intruding stage cannot join: its handshake is refused, so it never hears back.
        intruder = subprocess.run(
            [
                sys.executable,
                "-m",
                "zpipe.stage",
                "--coordinator",
                cluster.coordinator_endpoint,
                "--name",
                "mallory",
                "--keys",
                str(keys["intruder"]),
                "--connect-timeout",
                "2",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert intruder.returncode == 1
        assert "could not reach the coordinator" in intruder.stderr

        async def members() -> list[str]:
            async with cluster.client() as client:
                return [m["name"] for m in await client.cluster_state()]

        assert sorted(asyncio.run(members())) == ["k0", "k1"]

        # Data injected into the first stage with an unknown key never arrives.
        endpoints = {}

        async def state() -> None:
            async with cluster.client() as client:
                for m in await client.cluster_state():
                    endpoints[m["name"]] = m["data_endpoint"]

        asyncio.run(state())
        mallory = security.load_keypair(keys["intruder"], "mallory")
        k0_public = security.load_keypair_public(keys["trusted"], "k0")
        context = zmq.Context()
        try:
            sock = context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            security.secure_client(sock, mallory, k0_public)
            sock.connect(endpoints["k0"])
            sock.send_multipart([b"injected"], flags=zmq.NOBLOCK)
            # open until k0 refused the handshake: a close before its I/O thread read the
            # HELLO would reset the connection with nothing to refuse (a loaded machine)
            refused_by = time.monotonic() + 60.0
            while "peer_refused" not in cluster.logs("k0") and time.monotonic() < refused_by:
                time.sleep(0.1)
            sock.close()
        finally:
            context.term()

        outputs, report = cluster.infer(spec, batches)
        reference = build_full_model(spec)
        with torch.inference_mode():
            for got, batch in zip(outputs, batches, strict=False):
                torch.testing.assert_close(got[0], reference(*batch)[0])
        assert report.stages["k0"]["dropped"] == 0  # refused at the handshake, never decoded
        assert "peer_refused" in cluster.logs("k0")
        assert "peer_refused" in cluster.logs("coordinator")
        # Stages measured their links to each other through CURVE probe sockets.
        coordinator_log = cluster.logs("coordinator")
        assert coordinator_log.count('"link_measured"') == 2
        assert "link_unmeasured" not in coordinator_log
        # A lossy (EdgePipe) run: its partials cross the stages' CURVE data ports.
        _lossy_run_equals_its_simulation(cluster)


def test_a_client_without_an_allowed_key_cannot_start_a_run(keys: dict[str, Path]) -> None:
    from zpipe import TransportTimeout
    from zpipe.client import PipelineClient
    from zpipe.config import Timeouts

    with LocalCluster([DeviceSpec("k0")], keys_dir=keys["trusted"]) as cluster:

        async def attempt() -> None:
            async with PipelineClient(
                cluster.coordinator_endpoint,
                keys_dir=keys["intruder"],
                key_name="mallory",
                timeouts=Timeouts(reply_s=1.5),
            ) as c:
                await c.cluster_state()

        with pytest.raises(TransportTimeout, match="coordinator"):
            asyncio.run(attempt())


def test_secure_training_with_a_group_and_a_pipeline(keys: dict[str, Path]) -> None:
    from zpipe.planner.training_plan import TrainingPlan
    from zpipe.training.objectives import make_optimizer

    spec = ModelSpec("mlp", {"dims": [6, 16, 16, 3]}, seed=4)
    generator = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(6, 6, generator=generator), torch.randint(0, 3, (6,), generator=generator))
        for _ in range(2)
    ]
    sgd = {"name": "sgd", "lr": 0.1, "momentum": 0.5}
    model = build_full_model(spec).train()
    opt = make_optimizer(sgd, model.parameters())
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x)[0], y).backward()
        opt.step()
    group = TrainingPlan.from_dict(
        {
            "algo": "data-parallel",
            "schedule": "1f1b",
            "num_units": 3,
            "microbatch_size": 3,
            "num_microbatches": 2,
            "stages": [
                {"devices": ["k0", "k1"], "start": 0, "end": 3, "shares": [2, 1], "warmup": 1}
            ],
        }
    )
    devices = [DeviceSpec("k0"), DeviceSpec("k1")]
    with LocalCluster(devices, keys_dir=keys["trusted"], heartbeat_interval_s=0.5) as cluster:
        grouped = cluster.fit(spec, batches, optimizer=sgd, num_microbatches=2, plan=group)
        piped = cluster.fit(
            spec, batches, optimizer=sgd, num_microbatches=2, partition=[[0, 1], [1, 3]]
        )
        assert "peer_refused" not in cluster.logs("k0") + cluster.logs("k1")
    for report in (grouped, piped):
        for key, value in model.state_dict().items():
            torch.testing.assert_close(report.state_dict[key], value, rtol=1e-5, atol=1e-6)


def test_a_stage_key_cannot_read_the_cluster_or_start_a_run(tmp_path: Path) -> None:
    # Issue 19, roles: with roles.txt, only client keys may start runs or read the
    # cluster; a stage's own (allowed) key is refused for them, and the client works.
    trusted = tmp_path / "keys"
    generate_keys_with_roles(trusted, ["coordinator", "client", "r0"])
    with LocalCluster([DeviceSpec("r0")], keys_dir=trusted, heartbeat_interval_s=0.5) as cluster:
        server_key = security.load_keypair_public(trusted, "coordinator")
        context = zmq.Context()

        def ask(name: str, kind: str, body: dict[str, object]) -> str | None:
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            security.secure_client(sock, security.load_keypair(trusted, name), server_key)
            sock.connect(cluster.coordinator_endpoint)
            try:
                sock.send_multipart(encode(Message(kind, body)))
                if not sock.poll(3000):
                    return None
                return decode(sock.recv_multipart(copy=False)).kind
            finally:
                sock.close(linger=0)

        try:
            assert ask("r0", "cluster_request", {}) is None
            request = {
                "model": {"family": "mlp", "config": {"dims": [4, 4]}},
                "dtype": "float32",
                "sink_endpoint": "tcp://127.0.0.1:9",
                "wait_for_stages_s": 1.0,
            }
            assert ask("r0", "run_request", request) is None
            assert ask("client", "cluster_request", {}) == "cluster_state"
        finally:
            context.term()
        log = cluster.logs("coordinator")
    assert log.count("role_refused") >= 2


def _lossy_run_equals_its_simulation(cluster: LocalCluster) -> None:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(30, 6)), rng.integers(0, 4, size=30)
    y[0] = 3
    data = Dataset("random", x, y, x[:5], y[:5])
    cfg = RunConfig(allocation="vertical", n_devices=2, region_m=60.0, seed=1, hidden=(8, 8),
                    lr=0.1, batch_size=5, n_data=3, mapping="exhaustive")  # fmt: skip
    prepared = prepare_run(cfg, data)

    async def run() -> StagesLossyResult:
        async with cluster.client() as client:
            return await run_lossy(client, prepared, data, stage_names=["k0", "k1"])

    result = asyncio.run(run())
    simulated = train_in_process(prepared, data)
    assert same_run(result.trace, simulated, rtol=1e-10)
    assert not any(result.protocol_errors.values())
    # its test passes' partials crossed the CURVE data ports too
    assert result.test is not None and result.test.traffic.messages > 0
    assert result.test.same_as(
        evaluate_in_process(prepared, simulated.params, data.x_test, result.test.spec)
    )
