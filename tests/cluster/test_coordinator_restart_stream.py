"""An inference stream whose coordinator is SIGKILLed mid-stream, with a stage
killed while it is away, is re-planned by the restarted coordinator and delivers
every output once and in order (zpipe.coordinator.takeover).

Real processes on loopback: the coordinator keeps the stream's run in its state
directory; the restarted one restores b as a member, declares it dead when it
stays silent, re-plans the stream over a and c and sends the client the new plan
(``run_replanned``), which replays what had no result.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests._support.coordinator_restart import _cluster, _events
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence


def test_a_restarted_coordinator_replans_a_stream_around_a_stage_lost_meanwhile(
    tmp_path: Path,
) -> None:
    spec = ModelSpec("mlp", {"dims": [8, 64, 64, 64, 4]}, seed=1)
    sequence = load_layer_sequence(spec)
    batches = [sequence.example_input(2, seed=i) for i in range(40)]
    reference = build_full_model(spec)
    with _cluster(["a", "b", "c"], tmp_path / "state") as cluster:
        done = False

        def restart_after_10(received: int, _sent: int) -> None:
            nonlocal done
            if received == 10 and not done:
                done = True
                cluster.kill("coordinator")
                cluster.kill("b")  # lost while nobody watches
                cluster.restart_coordinator()

        outputs, report = cluster.infer(
            spec, batches, planner="even", max_in_flight=3, progress=restart_after_10
        )
        log = cluster.logs("coordinator")
    assert done
    assert len(outputs) == len(batches)
    with torch.inference_mode():
        for got, batch in zip(outputs, batches, strict=True):
            torch.testing.assert_close(got[0], reference(*batch)[0])
    restored = _events(log, "coordinator_restored")[-1]
    assert restored["run"] is not None
    assert sorted(restored["members"]) == ["a", "b", "c"]  # type: ignore[call-overload]
    assert [e["stage"] for e in _events(log, "stage_dead")] == ["b"]
    assert [r["dead"] for r in report.recoveries] == ["b"]
    assert [(s.device, s.start, s.end) for s in report.plan.stages] == [("a", 0, 2), ("c", 2, 4)]
