"""A pipeline client's local training against data parallelism and GPipe over the same
home (Eco-FL Figs. 10-11, in small): ``pipeline_client_over_dp_throughput`` and
``gpipe_over_1f1b_throughput``.

A home of four emulated devices (Jetson Xavier NX, TX2 and two Nanos: ``--slowdown``
1, 1.5, 3, 3, every one scaled up until they fit this machine's cores, as the
training benches do) trains a client's MLP, ``--pipeline-client-steps`` mini-batches
of 32 with FedProx's SGD, twice per system, in turn (each repeat starting with the
next system):

- ``pipeline``: Eco-FL's 1F1B-Sync plan (:func:`zpipe.federated.home_plan.plan_home`:
  device order, eq. 1 partition, the micro-batch count that divides the mini-batch);
- ``gpipe``: the same plan (cuts, device order, micro-batches) with GPipe's schedule,
  every forward of a mini-batch before its first backward (:func:`gpipe_of`);
- ``dp``: one stage over every device, Algorithm 1's shares, one all-reduce a
  mini-batch (:func:`zpipe.planner.training_baselines.plan_data_parallel`).

Both are planned from one analytic training profile (multiply-accumulates; see
:data:`MICROBATCH_SIZES` for why not a measured one), each device's speed
its emulated slowdown's inverse and the home's links at ``--pipeline-client-mbps``
(emulated by the stages, and told to the planners). Throughput is steady-state:
samples over the time from the end of the second mini-batch to the end of the
last (the first two include the run's set-up). The ratios are of the medians.
GPipe's peak memory against 1F1B-Sync's is :mod:`bench._federated_memory`'s.
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
from zpipe.cluster import AsyncLocalCluster, DeviceSpec
from zpipe.federated.fedprox import FACTORY, optimizer_config
from zpipe.federated.home_plan import home_devices, mlp_profile, plan_home
from zpipe.federated.model import MLPShape
from zpipe.models import ModelSpec
from zpipe.planner.cluster import ClusterSpec
from zpipe.planner.training_baselines import plan_data_parallel
from zpipe.planner.training_cost import TrainingCosts, predict_training
from zpipe.planner.training_plan import TrainingPlan

HOME = ("nx", "tx2", "nano", "nano")
# wide enough that compute, not per-message overhead, sets the pace on emulated devices
DIMS = [64, 512, 512, 512, 512, 10]
BATCH = 32
# Micro-batches of 8 or more: a profile measured here under load was noise (a sample
# cost 9x more in batches of 32 than alone), so both systems are planned on the analytic
# profile (multiply-accumulates), which does not see the per-operation overhead that
# makes micro-batches of 1-4 slow on a CPU.
MICROBATCH_SIZES = (8, 16, 32)
SKIP = 2
# A home's devices share its Wi-Fi (Eco-FL's setting); on unlimited loopback links data
# parallelism's all-reduce is free and the planners themselves predict it ahead.
HOME_MBPS = 100.0  # mini-batches left out of the steady state: the run's set-up
HOST_CORE_SHARE = 0.5  # as bench/_training_common.py: busy stages on half the cores


def slowdown_scale(threads: int, cores: int) -> float:
    """The least multiple of 0.25 (at least 1) that keeps the emulated home within
    half the cores (see bench/_training_common.py)."""
    demand = sum(threads * d.speed for d in home_devices(HOME))
    return max(1.0, float(np.ceil(4.0 * demand / (HOST_CORE_SHARE * cores)) / 4.0))


def gpipe_of(plan: TrainingPlan) -> TrainingPlan:
    """``plan`` with GPipe's schedule: the same stages, devices, cuts and micro-batches,
    every warm-up M (all forwards first). Its prediction is the 1F1B plan's, so it is
    dropped rather than carried over."""
    m = plan.num_microbatches
    stages = tuple(replace(s, warmup=m) for s in plan.stages)
    return replace(plan, schedule="gpipe", stages=stages, predicted={})


def plans(mbps: float | None, scale: float) -> tuple[TrainingPlan, TrainingPlan, list[Any]]:
    shape = MLPShape.from_dims(DIMS)
    profile = mlp_profile(shape, MICROBATCH_SIZES)
    devices = [replace(d, speed=d.speed / scale, bandwidth_mbps=mbps) for d in home_devices(HOME)]
    pipeline = plan_home(shape, devices, BATCH, profile=profile, microbatch_sizes=MICROBATCH_SIZES)
    costs = TrainingCosts(profile, ClusterSpec(tuple(devices)), microbatch_size=BATCH)
    dp = plan_data_parallel(costs, devices, num_microbatches=1, schedule="1f1b", block=1)
    return pipeline, dp, devices


def predicted_gpipe(pipeline: TrainingPlan, devices: list[Any]) -> TrainingPlan:
    """:func:`gpipe_of` ``pipeline``, with the prediction of the cost model that
    planned it (the same analytic profile and devices; the schedule simulator)."""
    profile = mlp_profile(MLPShape.from_dims(DIMS), MICROBATCH_SIZES)
    costs = TrainingCosts(
        profile, ClusterSpec(tuple(devices)), microbatch_size=pipeline.microbatch_size
    )
    gpipe = gpipe_of(pipeline)
    return replace(gpipe, predicted=predict_training(gpipe, costs))


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    cores = os.cpu_count() or 1
    threads = max(1, cores // len(HOME))
    scale = args.pipeline_client_scale or slowdown_scale(threads, cores)
    mbps = args.pipeline_client_mbps
    pipeline, dp, devices = plans(mbps, scale)
    rng = np.random.default_rng(0)
    x = torch.tensor(rng.normal(size=(BATCH * args.pipeline_client_steps, DIMS[0])))
    y = torch.tensor(rng.integers(0, DIMS[-1], size=len(x)))
    batches = [(x[i : i + BATCH].float(), y[i : i + BATCH]) for i in range(0, len(x), BATCH)]
    spec = ModelSpec("mlp", {"dims": DIMS, "activation": "relu"}, seed=0)
    # each device's speed is its class's over the scale: the stage's slowdown is its inverse
    stages = [
        DeviceSpec(d.name, slowdown=1.0 / d.speed, bandwidth_mbps=mbps, threads=threads)
        for d in devices
    ]
    gpipe = predicted_gpipe(pipeline, devices)
    systems = [("pipeline", pipeline), ("gpipe", gpipe), ("dp", dp)]
    measured: dict[str, list[float]] = {name: [] for name, _ in systems}
    async with AsyncLocalCluster(
        stages, measure_links=False, allow_factories=(FACTORY,), start_timeout_s=240.0
    ) as cluster:
        for repeat in range(args.pipeline_client_repeats):
            # each repeat starts with another system: none always runs first (or last)
            turn = repeat % len(systems)
            for system, plan in systems[turn:] + systems[:turn]:
                stamps: list[float] = []
                await cluster.fit(
                    spec,
                    batches,
                    optimizer=optimizer_config(0.05, 0.05),
                    num_microbatches=plan.num_microbatches,
                    plan=plan,
                    progress=False,
                    on_step=lambda step, loss, stamps=stamps: stamps.append(time.perf_counter()),
                )
                steady = (len(stamps) - SKIP) * BATCH / (stamps[-1] - stamps[SKIP - 1])
                measured[system].append(steady)
                emit(
                    {
                        "bench": "federated",
                        "section": "pipeline_client",
                        "system": system,
                        "steady_samples_per_s": round(steady, 2),
                        "loadavg": loadavg(),
                    }
                )
    pipe_sps = statistics.median(measured["pipeline"])
    dp_sps = statistics.median(measured["dp"])
    gpipe_sps = statistics.median(measured["gpipe"])
    return {
        "pipeline_client_over_dp_throughput": round(pipe_sps / dp_sps, 3),
        "gpipe_over_1f1b_throughput": round(gpipe_sps / pipe_sps, 3),
        "pipeline_client_samples_per_s": round(pipe_sps, 2),
        "gpipe_client_samples_per_s": round(gpipe_sps, 2),
        "dp_client_samples_per_s": round(dp_sps, 2),
        "pipeline_client_runs": {k: [round(v, 2) for v in vs] for k, vs in measured.items()},
        "pipeline_client_predicted_over_dp": round(
            pipeline.predicted["samples_per_s"] / dp.predicted["samples_per_s"], 3
        ),
        "gpipe_client_predicted_over_1f1b": round(
            gpipe.predicted["samples_per_s"] / pipeline.predicted["samples_per_s"], 3
        ),
        "pipeline_client_plan": {
            "stages": [[list(s.devices), s.start, s.end, s.warmup] for s in pipeline.stages],
            "num_microbatches": pipeline.num_microbatches,
        },
        "dp_client_shares": {
            d: s for d, s in zip(dp.stages[0].devices, dp.stages[0].shares, strict=True)
        },
        "pipeline_client_home": list(HOME),
        "pipeline_client_dims": DIMS,
        "pipeline_client_slowdown_scale": scale,
        "pipeline_client_mbps": mbps,
    }


def pipeline_client_section(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    out = asyncio.run(_measure(args))
    out["pipeline_client_wall_s"] = round(time.perf_counter() - started, 1)
    return out


def check_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.pipeline_client_steps < SKIP + 2 or args.pipeline_client_repeats < 1:
        p.error(f"--pipeline-client-steps must be >= {SKIP + 2} and --pipeline-client-repeats >= 1")
    for flag in ("pipeline_client_mbps", "pipeline_client_scale"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            p.error(f"--{flag.replace('_', '-')} must be > 0")


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--skip-pipeline-client", action="store_true", help="leave out the pipeline-client section"
    )
    p.add_argument("--pipeline-client-steps", type=int, default=12, help="mini-batches a run")
    p.add_argument("--pipeline-client-repeats", type=int, default=2)
    p.add_argument(
        "--pipeline-client-mbps",
        type=float,
        default=HOME_MBPS,
        help=f"the home's emulated links, Mbit/s (default {HOME_MBPS:g}: a home's Wi-Fi)",
    )
    p.add_argument(
        "--pipeline-client-scale",
        type=float,
        default=None,
        help="every slowdown times this (default: fit the home on half the cores)",
    )
