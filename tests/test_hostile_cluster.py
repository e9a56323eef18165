"""Hostile peers against real processes: a coordinator refuses a peer's model factory
and runs nothing (issue 19, item 1); an idle stage's data port does not queue big
frames (item 5), and the stream that follows is exact."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence
from zpipe.transport.codec import Message, decode, encode


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster([DeviceSpec("a"), DeviceSpec("b")]) as running:
        yield running


def _rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def test_an_idle_stage_does_not_queue_big_frames(cluster: LocalCluster) -> None:
    members = {m["name"]: m for m in cluster.wait_for_stages(2, timeout_s=60)}
    pid = cluster.processes["a"].pid
    before = _rss_kib(pid, "VmRSS")
    context = zmq.Context()
    try:
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.SNDTIMEO, 5000)
        push.connect(members["a"]["data_endpoint"])
        frame = bytes(64 << 20)
        sent = 0
        for _ in range(8):
            try:
                push.send(frame, copy=False)
                sent += 1
            except zmq.Again:
                break
        # Up to 3 s to deliver what is queued (term waits for it): libzmq on the stage
        # refuses each oversized frame and drops the connection, freeing what it read.
        push.close(linger=3000)
    finally:
        context.term()
    assert sent >= 1
    assert cluster.processes["a"].poll() is None
    grown_mib = (_rss_kib(pid, "VmHWM") - before) / 1024
    assert grown_mib < 100, f"an idle stage grew {grown_mib:.0f} MiB on frames nothing reads"


def test_a_run_request_naming_os_system_is_refused_and_nothing_runs(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    model = {
        "family": "sequential",
        "config": {
            "factory": "os:system",
            "kwargs": {"command": f"touch {marker}"},
            "input_shape": [4],
        },
    }
    request = Message(
        "run_request",
        {
            "model": model,
            "dtype": "float32",
            "sink_endpoint": "tcp://127.0.0.1:9",
            "wait_for_stages_s": 30.0,
        },
    )
    context = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(cluster.coordinator_endpoint)
        dealer.send_multipart(encode(request))
        assert dealer.poll(60_000), "the coordinator did not answer the run request"
        reply = decode(dealer.recv_multipart(copy=False))
        dealer.close(linger=0)
    finally:
        context.term()
    assert reply.kind == "run_failed"
    assert "os:system" in reply["error"] and "--allow-factory" in reply["error"]
    assert not marker.exists()

    # The coordinator and the stages keep serving.
    spec = ModelSpec("mlp", {"dims": [6, 16, 8, 4]}, seed=8)
    batches = [load_layer_sequence(spec).example_input(2, seed=i) for i in range(2)]
    outputs, _ = cluster.infer(spec, batches)
    reference = build_full_model(spec)
    with torch.inference_mode():
        for got, batch in zip(outputs, batches, strict=True):
            torch.testing.assert_close(got[0], reference(*batch)[0])
    assert not marker.exists()
