"""Eco-FL's heterogeneity-aware partition against PipeDream's even one over a home of
two unlike devices (Eco-FL Fig. 12, in small): ``ecofl_over_even_partition_throughput``.

The paper's Fig. 12 trains EfficientNet on a TX2-N and a Nano-H: PipeDream's
partitioner, made for like devices, splits the work evenly, so the faster device
idles (its GPU utilisation low) and the pipeline runs at the slower one's pace;
Eco-FL's eq. 1 gives each device work in proportion to its speed. Here a TX2 and a
Nano (emulated: ``--slowdown`` 1.5 and 3 times a scale that fits this machine's
cores, at least :data:`MIN_SCALE`, as :mod:`bench._federated_pipeline`) train the
pipeline-client bench's MLP, mini-batches of 32 with FedProx's SGD, on two plans
that differ in their cut only:

- ``ecofl``: :func:`zpipe.federated.home_plan.plan_home` (device order, eq. 1's
  cut, the micro-batch count);
- ``even``: the same order and micro-batches, the cut that balances the units' work
  (multiply-accumulates) as if the devices were alike (:func:`even_cut`).

Each runs ``--pipeline-partition-repeats`` times (in turn) on the same stage
processes. Throughput is steady-state (as the pipeline-client bench: from the end
of the second mini-batch to the end of the last); a stage's utilisation is its
compute (forward and backward seconds from its counters) over the run's training
time, which is what Fig. 12's GPU utilisation shows on a CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from bench._common import emit, loadavg
from bench._federated_pipeline import BATCH, DIMS, HOST_CORE_SHARE, MICROBATCH_SIZES, SKIP
from zpipe.cluster import AsyncLocalCluster, DeviceSpec
from zpipe.federated.fedprox import FACTORY, optimizer_config
from zpipe.federated.home_plan import home_devices, mlp_profile, plan_home
from zpipe.federated.model import MLPShape
from zpipe.models import ModelSpec
from zpipe.planner.cluster import ClusterSpec
from zpipe.planner.training_cost import TrainingCosts, predict_training
from zpipe.planner.training_plan import TrainingPlan

HOME = ("tx2", "nano")  # Fig. 12's TX2-N and Nano-H
# emulated compute well above a message's overhead (bench/_federated_resched.py's reason)
MIN_SCALE = 4.0


def even_cut(work: list[float]) -> int:
    """PipeDream's cut of two like devices: the least larger half of the work."""
    total = sum(work)
    return min(
        range(1, len(work)),
        key=lambda k: (max(sum(work[:k]), total - sum(work[:k])), k),
    )


def even_of(plan: TrainingPlan, work: list[float]) -> TrainingPlan:
    """``plan`` (two stages) with the even cut: same devices, order and micro-batches."""
    if plan.num_stages != 2:
        raise ValueError(f"Fig. 12 compares two-stage plans, got {plan.num_stages} stages")
    cut = even_cut(work)
    first, second = plan.stages
    stages = (replace(first, end=cut), replace(second, start=cut))
    return replace(plan, stages=stages, predicted={})


def home_scale(threads: int, cores: int) -> float:
    """The least multiple of 0.25 (at least 1) that keeps the home within half the cores."""
    demand = sum(threads * d.speed for d in home_devices(HOME))
    return max(1.0, float(np.ceil(4.0 * demand / (HOST_CORE_SHARE * cores)) / 4.0))


def plans(scale: float) -> tuple[TrainingPlan, TrainingPlan, list[Any]]:
    shape = MLPShape.from_dims(DIMS)
    profile = mlp_profile(shape, MICROBATCH_SIZES)
    devices = [replace(d, speed=d.speed / scale) for d in home_devices(HOME)]
    ecofl = plan_home(shape, devices, BATCH, profile=profile, microbatch_sizes=MICROBATCH_SIZES)
    b = ecofl.microbatch_size
    work = [f + w for f, w in zip(profile.times(b), profile.backward_times(b), strict=True)]
    even = even_of(ecofl, work)
    costs = TrainingCosts(profile, ClusterSpec(tuple(devices)), microbatch_size=b)
    return ecofl, replace(even, predicted=predict_training(even, costs)), devices


def utilisation(stages: dict[str, Any], elapsed_s: float) -> dict[str, float]:
    """Each stage's compute seconds over the run's training time."""
    return {
        name: round(
            (float(c.get("forward_s") or 0) + float(c.get("backward_s") or 0)) / elapsed_s, 3
        )
        for name, c in stages.items()
    }


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    cores = os.cpu_count() or 1
    threads = max(1, cores // len(HOME))
    scale = args.pipeline_partition_scale or max(MIN_SCALE, home_scale(threads, cores))
    ecofl, even, devices = plans(scale)
    rng = np.random.default_rng(0)
    steps = args.pipeline_partition_steps
    x = torch.tensor(rng.normal(size=(BATCH * steps, DIMS[0])))
    y = torch.tensor(rng.integers(0, DIMS[-1], size=len(x)))
    batches = [(x[i : i + BATCH].float(), y[i : i + BATCH]) for i in range(0, len(x), BATCH)]
    spec = ModelSpec("mlp", {"dims": DIMS, "activation": "relu"}, seed=0)
    stages = [DeviceSpec(d.name, slowdown=1.0 / d.speed, threads=threads) for d in devices]
    systems = [("ecofl", ecofl), ("even", even)]
    measured: dict[str, list[float]] = {name: [] for name, _ in systems}
    busy: dict[str, list[dict[str, float]]] = {name: [] for name, _ in systems}
    profile = mlp_profile(MLPShape.from_dims(DIMS), MICROBATCH_SIZES)
    async with AsyncLocalCluster(
        stages, measure_links=False, allow_factories=(FACTORY,), start_timeout_s=240.0
    ) as cluster:
        for repeat in range(args.pipeline_partition_repeats):
            turn = repeat % len(systems)
            for system, plan in systems[turn:] + systems[:turn]:
                stamps: list[float] = []
                report = await cluster.fit(
                    spec,
                    batches,
                    optimizer=optimizer_config(0.05, 0.05),
                    num_microbatches=plan.num_microbatches,
                    plan=plan,
                    profile=profile,
                    progress=False,
                    on_step=lambda step, loss, stamps=stamps: stamps.append(time.perf_counter()),
                )
                steady = (len(stamps) - SKIP) * BATCH / (stamps[-1] - stamps[SKIP - 1])
                measured[system].append(steady)
                busy[system].append(utilisation(dict(report.stages), report.elapsed_s))
                emit(
                    {
                        "bench": "federated",
                        "section": "pipeline_partition",
                        "system": system,
                        "steady_samples_per_s": round(steady, 2),
                        "utilisation": busy[system][-1],
                        "loadavg": loadavg(),
                    }
                )
    eco_sps, even_sps = statistics.median(measured["ecofl"]), statistics.median(measured["even"])

    def median_busy(system: str) -> dict[str, float]:
        names = busy[system][0]
        return {n: round(statistics.median(b[n] for b in busy[system]), 3) for n in names}

    return {
        "ecofl_over_even_partition_throughput": round(eco_sps / even_sps, 3),
        "ecofl_over_even_partition_predicted": round(
            ecofl.predicted["samples_per_s"] / even.predicted["samples_per_s"], 3
        ),
        "partition_ecofl_samples_per_s": round(eco_sps, 2),
        "partition_even_samples_per_s": round(even_sps, 2),
        "partition_ecofl_utilisation": median_busy("ecofl"),
        "partition_even_utilisation": median_busy("even"),
        "partition_plans": {
            name: [[list(s.devices), s.start, s.end] for s in plan.stages] for name, plan in systems
        },
        "partition_microbatches": ecofl.num_microbatches,
        "partition_home": list(HOME),
        "partition_slowdown_scale": scale,
    }


def pipeline_partition_section(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    out = asyncio.run(_measure(args))
    out["partition_wall_s"] = round(time.perf_counter() - started, 1)
    return out


def check_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.pipeline_partition_steps < SKIP + 2 or args.pipeline_partition_repeats < 1:
        p.error(
            f"--pipeline-partition-steps must be >= {SKIP + 2} and "
            "--pipeline-partition-repeats >= 1"
        )
    scale = args.pipeline_partition_scale
    if scale is not None and not scale > 0:
        p.error("--pipeline-partition-scale must be > 0")


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--skip-pipeline-partition",
        action="store_true",
        help="leave out the partition section (Fig. 12)",
    )
    p.add_argument("--pipeline-partition-steps", type=int, default=12, help="mini-batches a run")
    p.add_argument("--pipeline-partition-repeats", type=int, default=2)
    p.add_argument(
        "--pipeline-partition-scale",
        type=float,
        default=None,
        help="every slowdown times this (default: fit the home on half the cores)",
    )
