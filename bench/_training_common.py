"""Shared pieces of ``bench/training.py``: its constants, timed runs of zpipe and
torch, CPU and prediction helpers and the per-run JSON line (split out of that
script to keep it small; behaviour unchanged).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bench._torch_pipelining_baseline import TorchPipeline, TorchRun
from zpipe.client import TrainReport
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.config import Timeouts
from zpipe.models import ModelSpec
from zpipe.planner.profile import ModelProfile
from zpipe.planner.schedules import pipeline_actions, simulate
from zpipe.stage.profiling import profile_model
from zpipe.training.warmup import resolve_warmup_policy, warmup_counts

BENCH = "training"
OPTIMIZER: dict[str, Any] = {"name": "sgd", "lr": 0.05}
SKIPPED_HPP_NOTE = (
    "the hpp section did not run (--skip-hpp): hpp_over_best_baseline_* and "
    "predicted_over_measured_round are null"
)

# Jetson Nano : TX2 : Xavier NX, roughly (Asteroid's and Eco-FL's testbeds): slowdowns
# relative to the fastest, before the scale that fits them on this machine's cores.
HETERO_DEVICES = (("nano", 3.0), ("tx2", 1.5), ("nx", 1.0))
# A device with slowdown s computes 1/s of its busy time and sleeps the rest, so stages
# that are all busy need sum(threads / s) cores. Past about half the cores the stages
# wait for a core, and the emulation stretches that wait s times over: the devices stop
# being independent. Every slowdown is scaled up (their ratios kept) until they fit.
HOST_CORE_SHARE = 0.5

# A CNN whose early layers keep the full 32x32 resolution: large activations at early
# cuts (1 MB for a micro-batch of 4), small ones late (64 KB after the last pool).
HETERO_CNN: dict[str, Any] = {
    "channels": [64, 64, 128, 128, 256, 256],
    "pool": [False, False, True, False, True, True],
    "image_size": 32,
    "in_channels": 3,
    "num_classes": 10,
}


def _bert_spec(hidden: int, seed: int) -> ModelSpec:
    """BERT-Base's shape, shrunk to run in seconds on two cores."""
    return ModelSpec.preset(
        "bert-base",
        seed=seed,
        num_layers=4,
        hidden=hidden,
        heads=4,
        mlp=4 * hidden,
        vocab_size=1000,
        seq_len=64,
        max_positions=64,
    )


@dataclass
class TimedRun:
    """One timed run of one system: its clock, its losses, and where each step ended."""

    system: str
    samples: int
    elapsed_s: float  # as the system itself measures a run (see the module docstring)
    step_ends: list[float]  # perf_counter when each mini-batch ended
    losses: list[float]
    report: TrainReport | None = None
    torch_run: TorchRun | None = None
    # CPU seconds of all the system's processes (this one included) over the whole call:
    # zpipe's run set-up and weight gathering, torch's weight reset and batch making too
    cpu_s: float | None = None

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def period_s(self) -> float | None:
        """Seconds per round once the pipeline runs: between the first and last step ends."""
        if len(self.step_ends) < 2:
            return None
        return (self.step_ends[-1] - self.step_ends[0]) / (len(self.step_ends) - 1)

    @property
    def steady_samples_per_s(self) -> float | None:
        period = self.period_s
        if not period or not self.step_ends:
            return None
        return self.samples / len(self.step_ends) / period


class _PatientCluster(LocalCluster):
    """A LocalCluster whose client waits longer for control replies.

    LocalCluster's client asks the coordinator for the cluster's state with the default
    10 s reply timeout and gives up on the first miss, even within ``start_timeout_s``;
    a coordinator that imports torch on a loaded 2-core machine can take longer.
    """

    @property
    def timeouts(self) -> Timeouts:
        return dataclasses.replace(super().timeouts, reply_s=60.0)


def _cluster(devices: Sequence[DeviceSpec]) -> LocalCluster:
    # Heartbeats every second, suspect after 5 missed: a stage that waits for a core on a
    # loaded machine must not be declared dead in the middle of a run.
    return _PatientCluster(
        list(devices),
        heartbeat_interval_s=1.0,
        suspect_after=5,
        log_level="warning",
        start_timeout_s=180.0,
    )


def _zpipe_run(
    cluster: LocalCluster,
    system: str,
    spec: ModelSpec,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    **fit: Any,
) -> TimedRun:
    ends: list[float] = []

    def on_step(step: int, loss: float) -> None:
        ends.append(time.perf_counter())

    pids = [p.pid for p in cluster.processes.values()] + [os.getpid()]
    cpu = _cpu_seconds(pids)
    report = cluster.fit(spec, batches, optimizer=OPTIMIZER, progress=False, on_step=on_step, **fit)
    cpu = _cpu_seconds(pids) - cpu
    return TimedRun(
        system,
        report.samples,
        report.elapsed_s,
        ends,
        list(report.losses),
        report=report,
        cpu_s=cpu,
    )


def _torch_run(pipe: TorchPipeline, system: str, **train: Any) -> TimedRun:
    pids = [*pipe.pids, os.getpid()]
    cpu = _cpu_seconds(pids)
    run = pipe.train(optimizer=OPTIMIZER, **train)
    cpu = _cpu_seconds(pids) - cpu
    return TimedRun(
        system, run.samples, run.elapsed_s, run.step_ends_s, run.losses, torch_run=run, cpu_s=cpu
    )


def _cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (Linux /proc; 0 for what is unreadable)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def _median_run(runs: list[TimedRun]) -> TimedRun:
    """The run with the median steady throughput (the lower middle one of an even count)."""
    keyed = sorted(runs, key=lambda r: r.steady_samples_per_s or 0.0)
    return keyed[(len(keyed) - 1) // 2]


def _max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float | None:
    if len(a) != len(b) or not a:
        return None
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def _round(x: float | None, digits: int = 4) -> float | None:
    return round(x, digits) if x is not None else None


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _warmups(schedule: str, num_stages: int, m: int) -> list[int]:
    """The warm-ups a run gets when it names none (what the coordinator fills in):
    "auto" is Asteroid's counts."""
    if schedule == "gpipe":
        return [m] * num_stages
    policy = resolve_warmup_policy("auto")
    return warmup_counts(policy, num_stages, m)


def _profile(spec: ModelSpec, microbatch_size: int, threads: int) -> ModelProfile:
    """Forward and backward time of every unit at the micro-batch size, in this process."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return profile_model(spec, batch_sizes=[microbatch_size], warmup=2, repeats=5, train=True)
    finally:
        torch.set_num_threads(previous)


def _stage_rows(report: TrainReport) -> list[dict[str, Any]]:
    """Per stage of the plan: its units and counters."""
    rows = []
    for i, stage in enumerate(report.plan.stages):
        m = report.stages.get(stage.device, {})
        rows.append(
            {
                "stage": i,
                "device": stage.device,
                "units": [stage.start, stage.end],
                "microbatches": int(m.get("microbatches") or 0),
                "busy_s": _round(float(m.get("busy_s", 0.0))),
                "idle_s": _round(float(m.get("idle_s", 0.0))),
                "send_s": _round(float(m.get("send_s", 0.0))),
                "bytes_out": int(m.get("bytes_out") or 0),
                "peak_live_activations": int(m.get("peak_live_activations") or 0),
                "peak_activation_bytes": int(m.get("peak_activation_bytes") or 0),
            }
        )
    return rows


def _predict_round(
    report: TrainReport,
    profile: ModelProfile,
    microbatch_size: int,
    warmups: list[int],
    link_s: Callable[[int, list[dict[str, Any]]], tuple[list[float], list[float]]],
) -> dict[str, Any]:
    """``simulate``'s round for this run's plan, schedule and measured per-stage compute."""
    rows = _stage_rows(report)
    num_stages, m = len(rows), report.num_microbatches
    forward, backward = [], []
    unit_f = profile.times(microbatch_size)
    unit_b = profile.backward_times(microbatch_size)
    for row in rows:
        start, end = row["units"]
        per_mb = float(row["busy_s"]) / row["microbatches"] if row["microbatches"] else 0.0
        f, b = sum(unit_f[start:end]), sum(unit_b[start:end])
        share = f / (f + b) if f + b > 0 else 1.0 / 3.0
        forward.append(per_mb * share)
        backward.append(per_mb * (1.0 - share))
    send_f, send_b = link_s(m, rows)
    actions = pipeline_actions(
        report.schedule, num_stages=num_stages, num_microbatches=m, warmups=warmups
    )
    result = simulate(actions, forward, backward, send_f, send_b)
    return {
        "predicted_round_s": round(result.round_s, 5),
        "forward_s": [round(x, 5) for x in forward],
        "backward_s": [round(x, 5) for x in backward],
        "send_forward_s": [round(x, 5) for x in send_f],
        "send_backward_s": [round(x, 5) for x in send_b],
        "warmups": warmups,
        "predicted_bubble_fraction": round(result.bubble_fraction, 4),
    }


def _measured_link_s(m: int, rows: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """Per link, each sender's ``send_s`` per message (no emulated link: loopback)."""
    per_message = []
    for i, row in enumerate(rows):
        # per micro-batch: its activations (or, from the last stage, its loss) and,
        # from every stage but the first, its gradient
        messages = row["microbatches"] * (1 if i == 0 else 2)
        per_message.append(float(row["send_s"]) / messages if messages else 0.0)
    return per_message[:-1], per_message[1:]


def _run_line(
    section: str, system: str, runs: list[TimedRun], median: TimedRun, **extra: Any
) -> dict[str, Any]:
    return {
        "bench": BENCH,
        "section": section,
        "system": system,
        "steady_samples_per_s": _round(median.steady_samples_per_s),
        "steady_samples_per_s_runs": [_round(r.steady_samples_per_s) for r in runs],
        "samples_per_s": _round(median.samples_per_s),
        "samples_per_s_runs": [_round(r.samples_per_s) for r in runs],
        "round_s": _round(median.period_s, 5),
        "elapsed_s": _round(median.elapsed_s),
        "cpu_ms_per_sample": _round(1e3 * median.cpu_s / median.samples, 3)
        if median.cpu_s is not None and median.samples
        else None,
        "cpu_ms_per_sample_runs": [
            _round(1e3 * r.cpu_s / r.samples, 3) if r.cpu_s is not None and r.samples else None
            for r in runs
        ],
        "samples": median.samples,
        "steps": len(median.step_ends),
        "losses": [round(x, 6) for x in median.losses],
        **extra,
    }
