"""The client's sink takes no frame larger than its run's model sends (issue 19,
item 5): sized per run from the model and the rows of a micro-batch."""

from __future__ import annotations

import asyncio

import torch
import zmq

from zpipe.client.sink_limits import most_rows, sink_limits
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence
from zpipe.transport.sockets import HEADER_FRAME_ALLOWANCE, ReceiveLimits

FALLBACK = ReceiveLimits(2**31 - 1, 16)


def test_the_rows_of_a_micro_batch_are_known_only_when_they_can_be() -> None:
    batches = [torch.zeros(5, 3), (torch.zeros(9, 3), torch.zeros(9))]
    assert most_rows(batches, 4) == 4
    assert most_rows(batches, None) == 9
    assert most_rows(iter(batches), None) is None  # a stream: not known in advance
    assert most_rows([], None) is None


def test_the_sink_is_sized_from_the_model_and_the_rows() -> None:
    wide = ModelSpec("mlp", {"dims": [8, 65536, 4]})  # 256 KiB a sample
    limits = sink_limits(wide, 64, FALLBACK)
    assert limits.max_message_bytes == 4 * 65536 * 64
    assert limits.queued_bytes_per_peer < FALLBACK.queued_bytes_per_peer
    tiny = ModelSpec("mlp", {"dims": [6, 16, 4]})
    assert sink_limits(tiny, 4, FALLBACK).max_message_bytes == HEADER_FRAME_ALLOWANCE
    assert sink_limits(tiny, None, FALLBACK) == FALLBACK
    user_code = ModelSpec("sequential", {"factory": "zpipe.models.examples:mlp"})
    assert sink_limits(user_code, 4, FALLBACK) == FALLBACK  # nothing is built to size it
    assert sink_limits(wide, 10**9, FALLBACK).max_message_bytes == FALLBACK.max_message_bytes


def test_after_a_run_the_sink_refuses_frames_larger_than_the_model_sends() -> None:
    spec = ModelSpec("mlp", {"dims": [6, 16, 8, 4]}, seed=9)
    batches = [load_layer_sequence(spec).example_input(3, seed=i) for i in range(3)]

    async def scenario(cluster: LocalCluster) -> tuple[list[tuple[torch.Tensor, ...]], bool, bool]:
        async with cluster.client() as client:
            outputs = await client.infer(spec, batches, stage_names=["a", "b"])
            sink, endpoint = client.connection.sink, client.connection.sink_endpoint
            context = zmq.Context()
            try:
                big = context.socket(zmq.PUSH)
                big.setsockopt(zmq.LINGER, 2000)
                big.connect(endpoint)
                big.send(bytes(4 << 20))  # 4 MiB: far above 3 rows of this model
                big.close()
                big_arrived = await sink.poll(3000) != 0
                small = context.socket(zmq.PUSH)
                small.setsockopt(zmq.LINGER, 2000)
                small.connect(endpoint)
                small.send(b"x" * 1024)
                small.close()
                small_arrived = await sink.poll(30000) != 0
            finally:
                context.term()
            return outputs, big_arrived, small_arrived

    with LocalCluster([DeviceSpec("a"), DeviceSpec("b")]) as cluster:
        outputs, big_arrived, small_arrived = asyncio.run(scenario(cluster))
    with torch.inference_mode():
        model = build_full_model(spec)
        for got, inputs in zip(outputs, batches, strict=True):
            torch.testing.assert_close(got[0], model(*inputs)[0])
    assert small_arrived, "the sink does not take small frames after the run"
    assert not big_arrived, "the sink took a 4 MiB frame from a model that sends bytes"
