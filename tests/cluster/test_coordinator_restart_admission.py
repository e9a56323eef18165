"""A coordinator SIGKILLed during admission: the client's stream still starts and ends.

Issue 33 (bench/chaos.py): killed after the assignments, before ``run_ready``, a
coordinator lost the client's request with its process; the client waited for
``run_ready`` until its deadline (30 + 300 + 10 = 340 s). The client now sends the
request again once it reconnects to the restarted coordinator, which admits it
fresh (a run being admitted is saved as no run) under a new run id.

Real processes on loopback. Stage b is stopped (SIGSTOP) before the request, so
the admission waits on its ``ready``; the coordinator is killed once its log says
the run was planned (its assignments go out next), b continues, the coordinator
restarts from its state directory. Generous deadlines; no step depends on timing
except that b is not declared dead before the kill (suspected after 10 s).
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch

from tests._support.coordinator_restart import _events
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence

DEADLINE_S = 240.0  # the old client waited 340 s: a stream that ends sooner was resent


def _wait_for(cluster: LocalCluster, event: str, *, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = _events(cluster.logs("coordinator"), event)
        if found:
            return found[-1]
        time.sleep(0.05)
    raise AssertionError(f"the coordinator logged no {event} within {timeout_s} s")


def test_a_coordinator_killed_during_admission_does_not_stall_the_client(
    tmp_path: Path,
) -> None:
    spec = ModelSpec("mlp", {"dims": [8, 32, 32, 4]}, seed=1)
    sequence = load_layer_sequence(spec)
    batches = [sequence.example_input(2, seed=i) for i in range(8)]
    reference = build_full_model(spec)
    cluster = LocalCluster(
        [DeviceSpec(n) for n in ("a", "b", "c")],
        heartbeat_interval_s=0.5,
        suspect_after=20,  # b is stopped until the kill: not declared dead before it
        probe_intervals=4,
        measure_links=False,
        state_dir=tmp_path / "state",
    )
    result: dict[str, Any] = {}
    with cluster:

        def stream() -> None:
            try:
                result["outputs"], result["report"] = cluster.infer(
                    spec, batches, planner="even", stage_names=["a", "b", "c"]
                )
            except BaseException as exc:  # any failure: the test reports it
                result["error"] = exc

        cluster.kill("b", signal.SIGSTOP)
        client = threading.Thread(target=stream, daemon=True)
        client.start()
        planned = _wait_for(cluster, "run_planned", timeout_s=120.0)
        cluster.kill("coordinator")  # the assignments are out, b's ready is not
        cluster.kill("b", signal.SIGCONT)
        cluster.restart_coordinator()
        client.join(DEADLINE_S)
        log = cluster.logs("coordinator")
    assert not client.is_alive(), "the client still waits for run_ready"
    assert "error" not in result, result.get("error")
    outputs = result["outputs"]
    assert len(outputs) == len(batches)
    with torch.inference_mode():
        for got, batch in zip(outputs, batches, strict=True):
            torch.testing.assert_close(got[0], reference(*batch)[0])
    restored = _events(log, "coordinator_restored")[-1]
    assert restored["run"] is None  # the run being admitted was saved as none
    runs = [e["run"] for e in _events(log, "run_planned")]
    assert runs[0] == planned["run"] and runs[-1] > planned["run"]  # admitted afresh
