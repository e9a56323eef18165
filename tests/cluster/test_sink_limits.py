"""The client's sink takes no frame larger than its run's model sends (issue 19,
item 5): sized per run from the model and the rows of a micro-batch."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from zpipe.client.sink_limits import most_rows, sink_limits
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence
from zpipe.transport import security
from zpipe.transport.sockets import CURVE_FRAME_OVERHEAD, HEADER_FRAME_ALLOWANCE, ReceiveLimits

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
    assert limits.max_message_bytes == 4 * 65536 * 64 + CURVE_FRAME_OVERHEAD
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


def _connected_push(context: zmq.Context[Any], endpoint: str, keys_dir: Path | None) -> Any:
    """A raw PUSH to the sink; with keys, as the run's last stage ``a`` (the sink's
    allow-list holds its key)."""
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    if keys_dir is not None:
        security.secure_client(
            push,
            security.load_keypair(keys_dir, "a"),
            security.load_keypair_public(keys_dir, "client"),
        )
    push.connect(endpoint)
    return push


@pytest.mark.parametrize("keyed", [False, True], ids=["open", "keys"])
def test_a_second_run_with_larger_results_reopens_the_sink_and_gets_them(
    keyed: bool, tmp_path: Path
) -> None:
    # The first run's outputs are small (the sink takes the 1 MiB header allowance
    # per frame); the second's are 2 MiB a micro-batch, over that, so the second run
    # gets its results only if the sink took its new limits. Its input (1 MiB a
    # sample) sizes the sink, so the results sit below the new limit: with CURVE a
    # frame of exactly MAXMSGSIZE bytes is 33 bytes over it on the wire.
    small = ModelSpec("mlp", {"dims": [6, 16, 4]}, seed=3)
    wide = ModelSpec("mlp", {"dims": [1 << 18, 16, 1 << 17]}, seed=4)
    rows = 4
    result_bytes = 4 * (1 << 17) * rows
    old_limit = sink_limits(small, rows, FALLBACK).max_message_bytes
    new_limit = sink_limits(wide, rows, FALLBACK).max_message_bytes
    assert old_limit < result_bytes < new_limit
    small_batches = [load_layer_sequence(small).example_input(rows, seed=i) for i in range(2)]
    wide_batches = [load_layer_sequence(wide).example_input(rows, seed=i) for i in range(3)]
    keys_dir: Path | None = None
    if keyed:
        keys_dir = tmp_path / "keys"
        security.generate_keys(keys_dir, ["coordinator", "client", "a"])

    async def scenario(cluster: LocalCluster) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        async with cluster.client() as client:
            connection = client.connection
            seen["small"] = await client.infer(small, small_batches, stage_names=["a"])
            first_sink = connection.sink
            seen["wide"] = await client.infer(wide, wide_batches, stage_names=["a"])
            second_sink = connection.sink
            seen["reopened"] = second_sink is not first_sink and first_sink.closed
            # the same limits again: the socket stays
            seen["again"] = await client.infer(wide, wide_batches[:1], stage_names=["a"])
            seen["kept"] = connection.sink is second_sink
            # a frame over the old limit, under the new one, reaches the fresh sink
            context: zmq.Context[Any] = zmq.Context()
            try:
                push = _connected_push(context, connection.sink_endpoint, keys_dir)
                push.send(bytes(old_limit + (1 << 19)))
                push.close()
                seen["over_old_limit_arrived"] = await connection.sink.poll(30000) != 0
            finally:
                context.term()
        return seen

    devices = [DeviceSpec("a")]
    with LocalCluster(devices, keys_dir=keys_dir) as cluster:
        seen = asyncio.run(scenario(cluster))
    with torch.inference_mode():
        for spec, batches, got in (
            (small, small_batches, seen["small"]),
            (wide, wide_batches, seen["wide"]),
            (wide, wide_batches[:1], seen["again"]),
        ):
            model = build_full_model(spec)
            assert len(got) == len(batches)
            for outputs, inputs in zip(got, batches, strict=True):
                torch.testing.assert_close(outputs[0], model(*inputs)[0])
    assert seen["reopened"], "the sink was not reopened for larger limits"
    assert seen["kept"], "the sink was reopened for the limits it had"
    assert seen["over_old_limit_arrived"], "the reopened sink refused a frame under its limit"
