"""A hostile peer against a running stream: poison frames sent straight to the client's
sink are logged and dropped, and the stream still delivers exact outputs (issue 19)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgpack
import torch
import zmq
from structlog.testing import capture_logs

from zpipe.cluster import LocalCluster
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence
from zpipe.transport.codec import PROTOCOL_VERSION, Message, encode

POISON_DEADLINE_S = 60.0


def _poison(run: int) -> list[list[bytes]]:
    def shaped(shape: list[int]) -> list[bytes]:
        header = {
            "v": PROTOCOL_VERSION,
            "k": "data",
            "e": 0,
            "b": {"run": run, "mb": 0, "src": "mallory"},
            "t": [["float32", shape]],
        }
        return [msgpack.packb(header), b""]

    impostor = Message("data", {"run": run, "mb": 0, "src": "mallory"}, tensors=(torch.ones(2),))
    return [
        [b"\xc1 garbage"],
        shaped([0, 2**63]),  # a zero-element tensor with a dimension past int64
        shaped([0, 2**62, 2**62]),
        [bytes(f) for f in encode(impostor)],  # decodes, but not from the last stage
    ]


def _send_raw(endpoint: str, messages: list[list[bytes]]) -> None:
    context = zmq.Context()
    try:
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 5000)
        push.connect(endpoint)
        for frames in messages:
            push.send_multipart(frames)
        push.close()  # LINGER: term() waits until they are delivered
    finally:
        context.term()


def test_poison_frames_to_the_sink_are_dropped_and_the_stream_finishes(
    cluster: LocalCluster,
) -> None:
    spec = ModelSpec("mlp", {"dims": [6, 16, 8, 4]}, seed=21)
    sequence = load_layer_sequence(spec)
    batches = [sequence.example_input(2, seed=i) for i in range(8)]
    poison = _poison(run=0)

    async def run() -> list[tuple[torch.Tensor, ...]]:
        async with cluster.client() as client:

            async def feed() -> AsyncIterator[tuple[torch.Tensor, ...]]:
                for i, batch in enumerate(batches):
                    if i == 3:
                        _send_raw(client.sink_endpoint, poison)
                        # the rest of the stream only once the sink has read every one
                        deadline = time.monotonic() + POISON_DEADLINE_S
                        while sum(e["event"] == "dropped_message" for e in logs) < len(poison):
                            assert time.monotonic() < deadline, "the sink never read the poison"
                            await asyncio.sleep(0.05)
                    yield batch

            names = [d.name for d in cluster.devices]
            return await client.infer(spec, feed(), stage_names=names, planner="even")

    with capture_logs() as logs:
        outputs = asyncio.run(run())
    reference = build_full_model(spec)
    assert len(outputs) == len(batches)
    with torch.inference_mode():
        for got, batch in zip(outputs, batches, strict=True):
            torch.testing.assert_close(got[0], reference(*batch)[0])
    dropped = [e for e in logs if e["event"] == "dropped_message"]
    assert len(dropped) == len(poison)
    assert not [e for e in logs if e["event"] == "run_task_failed"]
