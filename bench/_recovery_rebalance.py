"""``bench/recovery.py``'s training trials and its rebalance section (split out of
that script to keep it small; behaviour unchanged).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bench._common import emit
from bench._recovery_stream import (
    BENCH,
    DEVICES,
    Batch,
    _ratio,
    _throughput,
)
from zpipe.client import TrainReport
from zpipe.cluster import LocalCluster
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence
from zpipe.planner import even_ranges
from zpipe.planner.training_plan import TrainingPlan

OPTIMIZER = {"name": "sgd", "lr": 0.05, "momentum": 0.9}


@dataclass
class TrainTrial:
    policy: str
    victim: str
    report: TrainReport
    steps: list[tuple[int, float]]  # (mini-batch, time.monotonic()) of each completed one
    killed_at: float
    plan_before: TrainingPlan | None = None  # the plan the trial was given (None: planned)


def _train(
    cluster: LocalCluster,
    spec: ModelSpec,
    batches: list[Batch],
    args: argparse.Namespace,
    *,
    policy: str = "lightweight",
    victim: str | None = None,
    plan: TrainingPlan | None = None,
) -> TrainTrial:
    """One training run (``victim`` killed after ``--train-kill-after`` mini-batches).
    ``plan``: the plan to start from; every policy's trial must start from the same
    one, or the policies kill different stages of different plans (the coordinator's
    HPP plans afresh from profiles that drift with the load and the revived stage's
    new profile) and their throughputs after are not comparable."""
    steps: list[tuple[int, float]] = []
    killed_at = [math.inf]

    def on_step(step: int, _loss: float) -> None:
        steps.append((step, time.monotonic()))
        if victim is not None and step == args.train_kill_after and killed_at[0] == math.inf:
            killed_at[0] = time.monotonic()
            cluster.kill(victim)

    report = cluster.fit(
        spec,
        batches,
        optimizer=OPTIMIZER,
        num_microbatches=args.train_microbatches,
        progress=False,
        on_step=on_step,
        recover=True,
        replicate_every=args.replicate_every,
        recovery=policy,
        plan=plan,
    )
    return TrainTrial(policy, victim or "", report, steps, killed_at[0], plan)


def _train_single_process(
    spec: ModelSpec, batches: list[Batch], settings: dict[str, Any] = OPTIMIZER
) -> dict[str, torch.Tensor]:
    model = build_full_model(spec).train()
    assert settings["name"] == "sgd"
    optimizer = torch.optim.SGD(
        model.parameters(), lr=settings["lr"], momentum=settings["momentum"]
    )
    for *inputs, labels in batches:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(*inputs)[0], labels).backward()
        optimizer.step()
    return model.state_dict()


def _train_line(
    trial: TrainTrial, reference: dict[str, torch.Tensor], batch_size: int
) -> dict[str, Any]:
    report = trial.report
    recovered = report.recoveries[0] if report.recoveries else None
    before = [t for _, t in trial.steps if t <= trial.killed_at]
    after = [t for _, t in trial.steps if t > trial.killed_at]
    exact = set(report.state_dict) == set(reference) and all(
        torch.allclose(report.state_dict[k].float(), v.float(), rtol=1e-4, atol=1e-5)
        for k, v in reference.items()
    )
    tplan = report.training_plan
    return {
        "bench": BENCH,
        "kind": "training",
        "policy": trial.policy,
        "victim": trial.victim,
        "recovered": recovered is not None,
        "detection_s": recovered["noticed_at"] - trial.killed_at if recovered else None,
        "restart_s": recovered.get("restart_s") if recovered else None,
        "recovery_s": (after[0] - trial.killed_at) if after else None,
        "resumed_from": recovered["resumed_from"] if recovered else None,
        "replayed": recovered["replayed"] if recovered else None,
        "replicas": report.replicas,
        "throughput_before": _throughput(before, batch_size),
        "throughput_after": _throughput(after, batch_size),
        # the same run's rate after over before: what the load moved, it moved for both
        "after_over_before": _ratio(
            _throughput(after, batch_size), _throughput(before, batch_size)
        ),
        "plan_before": _stages(trial.plan_before),
        "plan_after": _stages(tplan),
        "predicted_after_samples_s": _predicted(tplan),
        "plan_after_text": tplan.describe() if tplan is not None else None,
        "stages_measured": _measured(report.stages),
        "weights_exact": exact,
    }


def _stages(plan: TrainingPlan | None) -> list[list[Any]] | None:
    """A plan's stages as ``[devices, start, end]``, to compare trials at a glance."""
    if plan is None:
        return None
    return [["+".join(s.devices), s.start, s.end] for s in plan.stages]


def _predicted(plan: TrainingPlan | None) -> float | None:
    """The planners' predicted samples/s for ``plan`` (None: not predicted)."""
    if plan is None or "samples_per_s" not in plan.predicted:
        return None
    return round(float(plan.predicted["samples_per_s"]), 2)


def _measured(stages: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each stage's measured compute per micro-batch (forward and backward, ms) and its
    utilisation, from the run's counters: the measured bottleneck is the stage with the
    most compute per micro-batch (its utilisation near 1)."""
    out: dict[str, dict[str, float]] = {}
    for name, counters in stages.items():
        if not isinstance(counters, dict) or not counters.get("microbatches"):
            continue
        count = counters["microbatches"]
        out[name] = {
            "busy_ms_per_mb": round(1e3 * counters.get("busy_s", 0.0) / count, 1),
            "utilisation": round(float(counters.get("utilisation", 0.0)), 3),
            "microbatches": count,
        }
    return out


def _recorder(steps: list[tuple[int, float]]) -> Callable[[int, float], None]:
    def on_step(step: int, _loss: float) -> None:
        steps.append((step, time.monotonic()))

    return on_step


def _rebalance_section(
    cluster: LocalCluster, spec: ModelSpec, batches: list[Batch], args: argparse.Namespace
) -> dict[str, Any]:
    """The even partition (the slow nano as heavy as the rest) trained as it is, and
    with ``rebalance``: steady throughput over the second half of the run."""
    names = [name for name, _ in DEVICES]
    partition = [list(r) for r in even_ranges(load_layer_sequence(spec).num_units, len(names))]
    out: dict[str, Any] = {}
    for label, share in (("static", None), ("rebalanced", args.rebalance)):
        steps: list[tuple[int, float]] = []
        report = cluster.fit(
            spec,
            batches,
            optimizer=OPTIMIZER,
            num_microbatches=args.train_microbatches,
            partition=partition,
            stage_names=names,
            recover=True,
            replicate_every=args.replicate_every,
            rebalance=share,
            progress=False,
            on_step=_recorder(steps),
        )
        tail = [t for step, t in steps if step >= len(batches) // 2]
        tplan = report.training_plan
        line = {
            "bench": BENCH,
            "kind": "rebalance",
            "system": label,
            "rebalance": share,
            "throughput_second_half": _throughput(tail, args.train_batch_size),
            "rebalanced_at": [r["at"] for r in report.rebalances],
            "plan_after": tplan.describe() if tplan is not None else None,
        }
        emit(line)
        print(
            f"  even partition, {label}: {line['throughput_second_half']} samples/s in the "
            f"second half, moves at {line['rebalanced_at']}",
            file=sys.stderr,
            flush=True,
        )
        out[label] = line
    return {
        "rebalanced_over_static_throughput": _ratio(
            out["rebalanced"]["throughput_second_half"], out["static"]["throughput_second_half"]
        ),
        "rebalanced_at": out["rebalanced"]["rebalanced_at"],
    }
