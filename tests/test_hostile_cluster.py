"""A real coordinator refuses a peer's model factory and runs nothing (issue 19, item 1)."""

from __future__ import annotations

from pathlib import Path

import torch
import zmq

from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence
from zpipe.transport.codec import Message, decode, encode


def test_a_run_request_naming_os_system_is_refused_and_nothing_runs(tmp_path: Path) -> None:
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
    with LocalCluster([DeviceSpec("a"), DeviceSpec("b")]) as cluster:
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
