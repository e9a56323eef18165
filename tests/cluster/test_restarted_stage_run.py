"""A run asked for right after a stage was killed runs on its restarted process.

The killed stage counts as alive under its name until its heartbeat deadline (120
intervals here: the whole test). The run's first send to it finds its connection
gone: the coordinator suspects it at once, the client asks for the run again, and
that request waits for a live process under the name. The stage is started again
only once the first attempt has failed, so the order is the one that failed before
("b is not connected: could not send assign"), whatever the load.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence

SPEC = ModelSpec("mlp", {"dims": [8, 32, 32, 32, 4]}, seed=5)


def test_a_run_started_at_once_after_a_kill_runs_on_the_restarted_stage() -> None:
    with LocalCluster(
        [DeviceSpec("a"), DeviceSpec("b")], heartbeat_interval_s=0.5, suspect_after=120
    ) as cluster:
        sequence = load_layer_sequence(SPEC)
        batches = [sequence.example_input(2, seed=i) for i in range(6)]
        cluster.kill("b")  # SIGKILL; waits for it to exit
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["outputs"], _ = cluster.infer(
                    SPEC,
                    batches,
                    partition=[[0, 2], [2, 4]],
                    stage_names=["a", "b"],
                    wait_for_stages_s=120.0,
                )
            except Exception as exc:  # the assertion below shows it
                result["error"] = exc

        running = threading.Thread(target=run)
        running.start()
        deadline = time.monotonic() + 180
        while running.is_alive() and "connection gone" not in cluster.logs("coordinator"):
            assert time.monotonic() < deadline, cluster.logs("coordinator")[-4000:]
            time.sleep(0.2)
        restarted = cluster.start_stage(DeviceSpec("b"))
        running.join(timeout=300)
        assert not running.is_alive()
        assert "error" not in result, result.get("error")
        reference = build_full_model(SPEC)
        with torch.inference_mode():
            for got, batch in zip(result["outputs"], batches, strict=True):
                torch.testing.assert_close(got[0], reference(*batch)[0])
        members = {m["name"]: m for m in cluster.wait_for_stages(2, timeout_s=120)}
        assert members["b"]["info"]["pid"] == restarted.pid
        assert "stage_name_taken_over" in cluster.logs("coordinator")
