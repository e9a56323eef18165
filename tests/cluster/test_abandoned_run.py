"""A run whose client was SIGKILLed does not block the coordinator for ever.

A killed client never sends its ``run_end``; its run stayed in flight and every
other client was refused until someone ended it by hand. Now a refusal first
looks whether the run's client is still connected (a send to its dropped
connection fails at once): it is not, so its run ends (``run_abandoned``) and the
other client's run starts, nobody calling ``end_run``. The first client is a real
process, held streaming by its own input generator, and killed once it printed
its first output.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import torch

from tests._support import REPO_ROOT
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence

WAIT_S = 180.0  # generous: two loaded cores

# The first client: streams one batch, says so, then holds the stream open.
_CLIENT = """
import asyncio, sys
from zpipe.client import PipelineClient
from zpipe.models import ModelSpec, load_layer_sequence

async def main():
    spec = ModelSpec("mlp", {"dims": [8, 32, 32, 4]}, seed=2)
    batch = load_layer_sequence(spec).example_input(2, seed=0)

    async def held():
        yield batch
        await asyncio.Event().wait()

    async with PipelineClient(sys.argv[1], sink_bind="tcp://127.0.0.1:0") as client:
        async for _ in client.infer_stream(spec, held(), stage_names=["a", "b"], planner="even"):
            print("streaming", flush=True)

asyncio.run(main())
"""


def test_a_killed_clients_run_gives_way_to_the_next_client() -> None:
    spec = ModelSpec("mlp", {"dims": [8, 32, 32, 4]}, seed=2)
    batch = load_layer_sequence(spec).example_input(2, seed=1)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    with LocalCluster([DeviceSpec("a"), DeviceSpec("b")], measure_links=False) as cluster:
        first = subprocess.Popen(
            [sys.executable, "-c", _CLIENT, cluster.coordinator_endpoint],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        try:
            assert first.stdout is not None
            readable, _, _ = select.select([first.stdout], [], [], WAIT_S)
            assert readable, "the first client printed nothing"
            line = first.stdout.readline()  # its first output (or its end)
            assert line.strip() == "streaming", f"the first client ended: rc {first.poll()}"
            first.send_signal(signal.SIGKILL)
            first.wait(WAIT_S)
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
            if first.stdout is not None:
                first.stdout.close()
        started = time.monotonic()
        outputs, report = cluster.infer(spec, [batch], stage_names=["a", "b"], planner="even")
        took_s = time.monotonic() - started
        log = cluster.logs("coordinator")
    assert "run_abandoned" in log and "run_refused" not in log, log[-2000:]
    with torch.inference_mode():
        torch.testing.assert_close(outputs[0][0], build_full_model(spec)(*batch)[0])
    assert report.run > 1 and took_s < WAIT_S
