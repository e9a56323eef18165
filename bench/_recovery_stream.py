"""Shared pieces of ``bench/recovery.py`` and its inference-stream trials: the
devices, a stream with one stage killed midway and its JSON line (split out of
that script to keep it small; behaviour unchanged).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from zpipe.client import RunReport
from zpipe.cluster import LocalCluster
from zpipe.models import ModelSpec

BENCH = "recovery"
Batch = tuple[torch.Tensor, ...]

# (name, slowdown before scaling): Jetson Xavier NX, TX2 and Nano, roughly.
DEVICES = (("nx-a", 1.0), ("nx-b", 1.0), ("tx2", 1.5), ("nano", 3.0))
BANDWIDTH_MBPS = 200.0
HOST_CORE_SHARE = 0.5  # see bench/_inference_common.py


@dataclass
class Trial:
    policy: str
    victim: str
    report: RunReport
    outputs: list[Batch]
    arrivals: list[float]  # time.monotonic() of each output
    killed_at: float


def _scale(threads: int, cores: int) -> float:
    demand = sum(threads / s for _, s in DEVICES)
    return max(1.0, math.ceil(4.0 * demand / (HOST_CORE_SHARE * cores)) / 4.0)


def _throughput(arrivals: list[float], samples_per_output: int) -> float | None:
    if len(arrivals) < 2 or arrivals[-1] <= arrivals[0]:
        return None
    return (len(arrivals) - 1) * samples_per_output / (arrivals[-1] - arrivals[0])


def _trial_line(trial: Trial, reference: list[Batch], batch_size: int) -> dict[str, Any]:
    recoveries = trial.report.recoveries
    recovered = recoveries[0] if recoveries else None
    before = [t for t in trial.arrivals if t <= trial.killed_at]
    after: list[float] = []
    if recovered is not None:
        after = [t for t in trial.arrivals if t >= recovered["at"]]
    exact = len(trial.outputs) == len(reference) and all(
        torch.allclose(got[0], want[0], rtol=1e-4, atol=1e-5)
        for got, want in zip(trial.outputs, reference, strict=True)
    )
    return {
        "bench": BENCH,
        "kind": "inference",
        "policy": trial.policy,
        "victim": trial.victim,
        "recovered": recovered is not None,
        "detection_s": recovered["detected_s"] if recovered else None,
        "replan_s": recovered["recovered_s"] if recovered else None,
        "recovery_s": (after[0] - trial.killed_at) if after else None,
        "replayed": recovered["replayed"] if recovered else None,
        "throughput_before": _throughput(before, batch_size),
        "throughput_after": _throughput(after, batch_size),
        "plan_after": trial.report.plan.to_dict()["stages"],
        "outputs_exact": exact,
    }


def _stream(
    cluster: LocalCluster,
    spec: ModelSpec,
    batches: list[Batch],
    args: argparse.Namespace,
    *,
    policy: str = "lightweight",
    victim: str | None = None,
) -> Trial:
    arrivals: list[float] = []
    killed_at = [math.inf]

    def progress(received: int, _sent: int) -> None:
        arrivals.append(time.monotonic())
        if victim is not None and received == args.kill_after:
            killed_at[0] = time.monotonic()
            cluster.kill(victim)

    outputs, report = cluster.infer(
        spec,
        batches,
        planner="pipeedge",
        microbatch_size=args.batch_size,
        max_in_flight=args.max_in_flight,
        recovery=policy,
        progress=progress,
    )
    return Trial(policy, victim or "", report, outputs, arrivals, killed_at[0])


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b
