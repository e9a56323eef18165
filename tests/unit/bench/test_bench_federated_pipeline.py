"""bench/federated.py's pipeline-client section: its plans (pure) and its summary keys,
with the pipeline-memory section's."""

from __future__ import annotations

import json
from typing import Any

import pytest

import bench._federated_pipeline as piped
import bench.federated as fed


def test_both_systems_are_planned_over_the_same_four_devices() -> None:
    pipeline, dp, devices = piped.plans(piped.HOME_MBPS, 2.5)
    names = {d.name for d in devices}
    assert names == {"nx0", "tx20", "nano0", "nano1"}
    assert {s.devices[0] for s in pipeline.stages} == names and pipeline.num_stages == 4
    assert pipeline.microbatch_size in piped.MICROBATCH_SIZES
    assert pipeline.microbatch_size * pipeline.num_microbatches == piped.BATCH
    (stage,) = dp.stages
    assert set(stage.devices) == names and sum(stage.shares) == piped.BATCH
    # over a home's Wi-Fi the all-reduce of every weight costs more than the bubbles
    assert pipeline.predicted["samples_per_s"] > dp.predicted["samples_per_s"]
    assert piped.slowdown_scale(1, 2) == 2.5  # 1 + 2/3 + 1/3 + 1/3 on one of two cores


def test_gpipe_runs_the_1f1b_plan_with_every_forward_first() -> None:
    pipeline, _, _ = piped.plans(piped.HOME_MBPS, 2.5)
    gpipe = piped.gpipe_of(pipeline)
    assert pipeline.schedule == "1f1b" and gpipe.schedule == "gpipe"
    m = pipeline.num_microbatches
    # the same cuts, devices and micro-batches; only the warm-ups (and so the schedule)
    assert [(s.devices, s.start, s.end) for s in gpipe.stages] == [
        (s.devices, s.start, s.end) for s in pipeline.stages
    ]
    assert (gpipe.microbatch_size, gpipe.num_microbatches) == (pipeline.microbatch_size, m)
    assert gpipe.warmups == [m] * pipeline.num_stages
    assert pipeline.warmups != gpipe.warmups  # 1F1B-Sync's last stage holds fewer
    assert not gpipe.predicted  # the 1F1B plan's prediction is not GPipe's
    _, _, devices = piped.plans(piped.HOME_MBPS, 2.5)
    predicted = piped.predicted_gpipe(pipeline, devices)
    assert predicted.stages == gpipe.stages
    # the cost model that planned the pipeline: GPipe's last stage runs every forward
    # before its first backward, so the gradients start back later and the round is longer
    assert predicted.predicted["round_s"] > pipeline.predicted["round_s"]
    assert predicted.predicted["stage3_peak_microbatches"] == m > pipeline.warmups[-1]


def test_the_section_reaches_the_summary_and_can_be_skipped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[Any] = []
    memory: list[Any] = []

    def section(args: Any) -> dict[str, Any]:
        seen.append(args)
        return {"pipeline_client_over_dp_throughput": 3.5, "gpipe_over_1f1b_throughput": 1.0}

    def memory_section(args: Any) -> dict[str, Any]:
        memory.append(args)
        return {"gpipe_over_1f1b_peak_memory": 1.4}

    monkeypatch.setattr(fed, "pipeline_client_section", section)
    monkeypatch.setattr(fed, "pipeline_memory_section", memory_section)
    monkeypatch.setattr(fed, "compare_methods", lambda seeds, *a, **k: _figures(seeds))
    # the re-scheduling and partition sections start stage processes too: fakes here
    monkeypatch.setattr(
        fed,
        "pipeline_resched_section",
        lambda args: {"resched_over_static_throughput_after_slowdown": 1.3},
    )
    monkeypatch.setattr(
        fed,
        "pipeline_partition_section",
        lambda args: {"ecofl_over_even_partition_throughput": 1.6},
    )
    # and the netns section makes a network lab (root): a fake that records its flags
    netns: list[Any] = []
    monkeypatch.setattr(
        fed,
        "netns_section",
        lambda args: netns.append(args) or {"pipeline_client_over_dp_throughput_netns": 9.0},
    )
    monkeypatch.setattr(fed, "lambda_sweep", lambda *a: {})
    monkeypatch.setattr(fed, "load_digits_dataset", lambda: None)
    argv = ["--lambdas=", "--seeds", "1", "--skip-flower", "--pipeline-client-mbps", "40"]
    assert fed.main(argv) == 0
    out = _summary(capsys.readouterr().out)
    assert out["pipeline_client_over_dp_throughput"] == 3.5
    assert out["pipeline_client_over_dp_throughput_netns"] == 9.0
    assert netns[0].pipeline_client_mbps == 40.0  # the same home's flags as the emulated one
    assert out["gpipe_over_1f1b_throughput"] == 1.0
    assert out["gpipe_over_1f1b_peak_memory"] == 1.4
    assert seen[0].pipeline_client_mbps == 40.0 and seen[0].pipeline_client_steps == 12
    assert memory[0].pipeline_memory_microbatches == 16
    assert fed.main([*argv, "--skip-pipeline-client"]) == 0
    out = _summary(capsys.readouterr().out)
    assert "pipeline_client_over_dp_throughput" not in out
    assert out["gpipe_over_1f1b_peak_memory"] == 1.4
    assert fed.main([*argv, "--skip-pipeline-memory", "--pipeline-client-steps", "5"]) == 0
    out = _summary(capsys.readouterr().out)
    assert "gpipe_over_1f1b_peak_memory" not in out
    assert seen[-1].pipeline_client_steps == 5
    assert (len(seen), len(memory)) == (2, 2)
    assert out["resched_over_static_throughput_after_slowdown"] == 1.3
    assert out["ecofl_over_even_partition_throughput"] == 1.6
    skip = ["--skip-pipeline-resched", "--skip-pipeline-partition", "--skip-pipeline-netns"]
    assert fed.main([*argv, *skip]) == 0
    out = _summary(capsys.readouterr().out)
    assert "pipeline_client_over_dp_throughput_netns" not in out
    assert "resched_over_static_throughput_after_slowdown" not in out
    assert "ecofl_over_even_partition_throughput" not in out
    for bad in (
        ["--pipeline-client-steps", "3"],
        ["--pipeline-client-mbps", "0"],
        ["--pipeline-memory-steps", "0"],
        ["--pipeline-memory-microbatches", "1"],
    ):
        with pytest.raises(SystemExit):
            fed.main([*argv, *bad])


def _figures(seeds: Any) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    return (
        {m: [0.5 for _ in seeds] for m in fed.METHODS},
        {m: [100.0 for _ in seeds] for m in fed.METHODS},
    )


def _summary(text: str) -> dict[str, Any]:
    lines = [json.loads(line) for line in text.splitlines()]
    return next(line for line in lines if line.get("summary"))
