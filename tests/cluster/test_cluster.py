"""Real coordinator and stage processes on loopback, against single-process models."""

from __future__ import annotations

import asyncio
import json
import socket
from urllib.parse import urlsplit

import pytest
import torch
import zmq

from zpipe import RemoteStageError
from zpipe.cluster import LocalCluster
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence


def reference_outputs(spec: ModelSpec, batches: list[tuple[torch.Tensor, ...]]):
    model = build_full_model(spec)
    with torch.inference_mode():
        return [model(*batch) for batch in batches]


def make_batches(spec: ModelSpec, count: int, batch_size: int) -> list[tuple[torch.Tensor, ...]]:
    sequence = load_layer_sequence(spec)
    return [sequence.example_input(batch_size, seed=100 + i) for i in range(count)]


def assert_outputs_match(got, expected, atol: float = 1e-5) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=False):
        assert len(g) == len(e)
        for gt, et in zip(g, e, strict=False):
            assert gt.shape == et.shape and gt.dtype == et.dtype
            torch.testing.assert_close(gt, et, atol=atol, rtol=1e-4)


@pytest.mark.parametrize(
    "spec",
    [
        ModelSpec.preset("vit-tiny", seed=3),
        ModelSpec.preset("bert-tiny", seed=4),
        ModelSpec("mlp", {"dims": [12, 32, 32, 16, 5], "activation": "gelu"}, seed=5),
        ModelSpec("cnn", {"image_size": 16, "channels": [4, 8], "num_classes": 3}, seed=6),
    ],
    ids=["vit", "bert", "mlp", "cnn"],
)
def test_pipeline_outputs_equal_single_process(cluster: LocalCluster, spec: ModelSpec) -> None:
    batches = make_batches(spec, count=5, batch_size=4)
    # the even partition, so every model runs through all three stages
    outputs, report = cluster.infer(
        spec, batches, microbatch_size=2, max_in_flight=3, planner="even"
    )
    assert_outputs_match(outputs, reference_outputs(spec, batches))
    assert len(report.plan.stages) == 3
    assert report.microbatches == 10 and report.samples == 20
    # every stage computed every micro-batch, and counted its traffic
    for name in report.plan.devices:
        stats = report.stages[name]
        assert stats["microbatches"] == 10
        assert stats["bytes_in"] > 0 and stats["bytes_out"] > 0
        assert stats["busy_s"] > 0
        # the link meter saw its sends leave (the last ones may still be on their way)
        assert stats["link_delivered_bytes"] > 0 and stats["link_peak_in_flight"] >= 1


def test_auto_split_user_module_equals_single_process(cluster: LocalCluster) -> None:
    spec = ModelSpec(
        "traced",
        {
            "factory": "zpipe.models.examples:tiny_residual",
            "kwargs": {},
            "input_shape": [8],
            "input_dtype": "float32",
            "microbatch_size": 2,
        },
        seed=11,
    )
    batches = make_batches(spec, count=4, batch_size=2)
    outputs, report = cluster.infer(spec, batches, microbatch_size=2)
    assert_outputs_match(outputs, reference_outputs(spec, batches))
    assert report.plan.stages[-1].end == load_layer_sequence(spec).num_units


def test_explicit_partition_and_stage_choice_are_honoured(cluster: LocalCluster) -> None:
    spec = ModelSpec.preset("vit-tiny", seed=1)
    units = load_layer_sequence(spec).num_units
    partition = [[0, 1], [1, units]]
    batches = make_batches(spec, count=3, batch_size=3)
    outputs, report = cluster.infer(spec, batches, partition=partition, stage_names=["s2", "s0"])
    assert [(s.device, s.start, s.end) for s in report.plan.stages] == [
        ("s2", 0, 1),
        ("s0", 1, units),
    ]
    assert_outputs_match(outputs, reference_outputs(spec, batches))


def test_results_come_back_in_input_order_with_uneven_batches(cluster: LocalCluster) -> None:
    spec = ModelSpec("mlp", {"dims": [6, 16, 4]}, seed=2)
    sequence = load_layer_sequence(spec)
    batches = [sequence.example_input(n, seed=n) for n in (5, 1, 7, 3)]
    outputs, _ = cluster.infer(spec, iter(batches), microbatch_size=2, max_in_flight=8)
    assert [o[0].shape[0] for o in outputs] == [5, 1, 7, 3]
    assert_outputs_match(outputs, reference_outputs(spec, batches))


def test_bfloat16_compute_is_close_to_float32(cluster: LocalCluster) -> None:
    spec = ModelSpec.preset("vit-tiny", seed=9)
    batches = make_batches(spec, count=2, batch_size=4)
    outputs, _ = cluster.infer(spec, batches, dtype="bfloat16")
    for got, expected in zip(outputs, reference_outputs(spec, batches), strict=False):
        torch.testing.assert_close(got[0].float(), expected[0], atol=0.15, rtol=0.1)


def test_a_bad_input_is_reported_and_the_stages_keep_serving(cluster: LocalCluster) -> None:
    spec = ModelSpec("mlp", {"dims": [6, 16, 4]}, seed=2)
    # the stage the planner put first (which one depends on measured speeds) says why
    with pytest.raises(
        RemoteStageError, match=r"stage 's\d' failed on micro-batch 0: .*shapes"
    ) as info:
        cluster.infer(spec, [torch.zeros(2, 7)])  # 7 features where the model takes 6
    assert info.value.microbatch == 0
    batches = make_batches(spec, count=2, batch_size=2)
    outputs, _ = cluster.infer(spec, batches)
    assert_outputs_match(outputs, reference_outputs(spec, batches))


def _data_endpoints(cluster: LocalCluster) -> dict[str, str]:
    async def state():
        async with cluster.client() as client:
            return await client.cluster_state()

    return {m["name"]: m["data_endpoint"] for m in asyncio.run(state())}


def test_garbage_to_stage_and_coordinator_is_dropped_and_the_run_continues(
    cluster: LocalCluster,
) -> None:
    endpoints = _data_endpoints(cluster)
    context = zmq.Context()
    try:
        pusher = context.socket(zmq.PUSH)
        pusher.setsockopt(zmq.LINGER, 1000)
        pusher.connect(endpoints["s1"])
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 1000)
        dealer.connect(cluster.coordinator_endpoint)
        junk = [
            [b"\xc1\x00junk"],
            [b"not msgpack", b"x" * 100],
            [json.dumps({"v": 1}).encode()],
            [b""],
        ]
        for frames in junk:
            pusher.send_multipart(frames)
            dealer.send_multipart(frames)
        pusher.close()
        dealer.close()
    finally:
        context.term()
    # raw bytes that are not even ZMTP, straight to both TCP ports
    for endpoint in (endpoints["s1"], cluster.coordinator_endpoint):
        parts = urlsplit(endpoint)
        with socket.create_connection((parts.hostname, parts.port), timeout=5) as raw:
            raw.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(range(256)))

    spec = ModelSpec("mlp", {"dims": [6, 16, 8, 4]}, seed=8)
    batches = make_batches(spec, count=3, batch_size=2)
    outputs, _report = cluster.infer(spec, batches)
    assert_outputs_match(outputs, reference_outputs(spec, batches))
    assert "dropped_message" in cluster.logs("s1")
    assert "dropped_message" in cluster.logs("coordinator")


def test_messages_of_an_older_epoch_or_a_wrong_sender_are_dropped(cluster: LocalCluster) -> None:
    from zpipe.transport.codec import Message, encode

    spec = ModelSpec("mlp", {"dims": [6, 16, 8, 4]}, seed=8)
    batches = make_batches(spec, count=2, batch_size=2)
    _, report = cluster.infer(spec, batches)
    first = report.plan.devices[0]
    endpoints = _data_endpoints(cluster)

    async def stage_metrics() -> dict[str, float]:
        async with cluster.client() as client:
            return {m["name"]: m["metrics"] for m in await client.cluster_state()}[first]

    before = asyncio.run(stage_metrics())
    context = zmq.Context()
    try:
        sock = context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(endpoints[first])
        tensor = (batches[0][0],)
        stale = Message(
            "data", {"run": report.run, "mb": 0, "src": "client"}, epoch=0, tensors=tensor
        )
        impostor = Message(
            "data", {"run": report.run, "mb": 0, "src": "mallory"}, epoch=0, tensors=tensor
        )
        sock.send_multipart(encode(stale))
        sock.send_multipart(encode(impostor))
        sock.close()
    finally:
        context.term()

    async def wait_for_counts() -> dict[str, float]:
        for _ in range(100):
            metrics = await stage_metrics()
            if metrics["stale"] > before["stale"] and metrics["dropped"] > before["dropped"]:
                return metrics
            await asyncio.sleep(0.1)
        return metrics

    after = asyncio.run(wait_for_counts())
    assert after["stale"] == before["stale"] + 1
    assert after["dropped"] == before["dropped"] + 1
    assert after["microbatches"] == before["microbatches"]  # nothing was computed


def test_a_repeated_run_reuses_the_built_shards(cluster: LocalCluster) -> None:
    spec = ModelSpec("mlp", {"dims": [5, 9, 7, 3]}, seed=77)
    batches = make_batches(spec, count=2, batch_size=2)
    first, _ = cluster.infer(spec, batches)
    second, _ = cluster.infer(spec, batches)
    assert_outputs_match(second, first, atol=0.0)
    ready = [
        json.loads(line) for line in cluster.logs("s0").splitlines() if '"assignment_ready"' in line
    ]
    assert [entry["reused"] for entry in ready[-2:]] == [False, True]
