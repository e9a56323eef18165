"""A coordinator runs one run at a time: a second client is refused, the first loses nothing.

bench/chaos.py found that a second client's ``run_request`` displaced the run in
flight; its client learnt only at its next request ("run 4 is not the current
run"). Now the second client gets a :class:`~zpipe.RunRefusedError` naming the run
in flight, the first stream delivers every output, and once it ended the second
client's run starts. Real processes on loopback; the first stream is held open by
its own input generator (an event), not by timing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from zpipe import RunRefusedError
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence

WAIT_S = 180.0  # generous: two loaded cores


def test_a_second_clients_run_is_refused_while_the_first_streams() -> None:
    spec = ModelSpec("mlp", {"dims": [8, 32, 32, 4]}, seed=2)
    sequence = load_layer_sequence(spec)
    batches = [sequence.example_input(2, seed=i) for i in range(4)]
    reference = build_full_model(spec)
    settings: dict[str, Any] = {"stage_names": ["a", "b"], "planner": "even"}

    async def scenario(cluster: LocalCluster) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        first_output = asyncio.Event()
        release = asyncio.Event()

        async def held_inputs() -> AsyncIterator[Any]:
            yield batches[0]
            await release.wait()  # the stream stays in flight until the test says
            for batch in batches[1:]:
                yield batch

        async with cluster.client() as first, cluster.client() as second:

            async def stream() -> list[Any]:
                outputs = []
                async for out in first.infer_stream(spec, held_inputs(), **settings):
                    outputs.append(out)
                    first_output.set()
                return outputs

            streaming = asyncio.create_task(stream())
            await asyncio.wait_for(first_output.wait(), WAIT_S)
            with pytest.raises(RunRefusedError) as refused:
                await asyncio.wait_for(second.infer(spec, batches[:1], **settings), WAIT_S)
            seen["refused_run"] = refused.value.run
            release.set()
            seen["first"] = await asyncio.wait_for(streaming, WAIT_S)
            assert first.last_report is not None
            seen["first_run"] = first.last_report.run
            # the first run ended: the second client's starts now
            seen["second"] = await asyncio.wait_for(
                second.infer(spec, batches[:1], **settings), WAIT_S
            )
        return seen

    with LocalCluster([DeviceSpec("a"), DeviceSpec("b")], measure_links=False) as cluster:
        seen = asyncio.run(scenario(cluster))
        log = cluster.logs("coordinator")
    assert seen["refused_run"] == seen["first_run"]
    assert len(seen["first"]) == len(batches)  # nothing of the first stream was lost
    with torch.inference_mode():
        for got, batch in zip(seen["first"], batches, strict=True):
            torch.testing.assert_close(got[0], reference(*batch)[0])
        torch.testing.assert_close(seen["second"][0][0], reference(*batches[0])[0])
    assert "run_refused" in log and "run_replaced" not in log
