"""A cluster with --keys: only devices with allowed keys join or inject data."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq

from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence
from zpipe.transport import security


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
            time.sleep(0.5)
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
