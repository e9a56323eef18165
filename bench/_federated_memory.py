"""Peak memory of each stage process of a pipeline client, 1F1B-Sync against GPipe
(Eco-FL Table 2, in small): ``gpipe_over_1f1b_peak_memory``.

Eco-FL's Table 2 trains EfficientNet-B6 on a two-stage pipeline (a TX2 and a Nano),
micro-batches of 8: GPipe holds 6 micro-batches at most (8 run out of memory) at
2.70 and 1.20 GB of GPU memory on stages 0 and 1; 1F1B-Sync holds 16 at 1.70 and
0.92 GB. Here the same home (``tx2``, ``nano``) trains a small CNN, whose
activations are large against its weights as the paper's are, on Eco-FL's
1F1B-Sync plan (the section 4.3 search, eq. 1's cut and eq. 3's warm-ups, over
the model's training profile: its bytes measured in this process, its times
from multiply-accumulates, :func:`analytic_times`) with
``--pipeline-memory-microbatches`` (16, Eco-FL's) micro-batches of 8, and on the
same plan with GPipe's schedule (:func:`bench._federated_pipeline.gpipe_of`).

Each system runs on its own fresh cluster of spawned stage processes (not forks of
a zygote, whose pages a fork shares and counts differently; a process's peak is
for its whole life, so the systems never share one). Two figures a stage:

- ``peak_rss_mib``: the stage process's peak resident memory (``VmHWM`` of
  ``/proc/PID/status``), reset to its resident memory once the stages are up, so
  start-up's transients are left out; ``peak_over_idle_mib`` is that peak less the
  resident memory before the run (the process's base: Python, torch, zpipe);
- ``torch_saved_mib``: the most bytes autograd held at once for the backwards
  still to come, counted by the stage itself (``peak_activation_bytes``: torch's
  saved tensors, one count per storage, weights left out). On a CPU torch's
  allocator keeps no total of its own, so this is the torch figure there is.

``gpipe_over_1f1b_peak_memory`` is the largest stage's ``VmHWM`` under GPipe over
the largest under 1F1B-Sync; the per-stage ratios of all three figures and the
paper's figures are beside it. The paper's ratio compares GPipe at 6 micro-batches
with 1F1B-Sync at 16; here both run the same 16, so GPipe holds more than it could
on the paper's Nano.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from bench._common import emit, loadavg
from bench._federated_pipeline import gpipe_of
from bench._generate_memory import reset_peak, status_kib
from zpipe.cluster import AsyncLocalCluster, DeviceSpec
from zpipe.federated.fedprox import FACTORY, optimizer_config
from zpipe.federated.home_plan import REFERENCE_S_PER_MAC, home_devices
from zpipe.models import ModelSpec
from zpipe.planner.cluster import ClusterSpec
from zpipe.planner.profile import ModelProfile, synthetic_profile
from zpipe.planner.straight import search_microbatch_and_order
from zpipe.planner.training_plan import TrainingPlan

HOME = ("tx2", "nano")  # Table 2's pipeline: a TX2 and a Nano
# The first unit keeps the 32x32 image (no pool): a sample's activations are about
# 0.6 MB at stage 0, its weights 0.3 MB in all, so what a schedule keeps in flight shows.
IMAGE_SIZE, NUM_CLASSES, CNN_CHANNELS = 32, 10, [32, 32, 64, 64]
CNN = {"channels": CNN_CHANNELS, "image_size": IMAGE_SIZE, "num_classes": NUM_CLASSES}
MICROBATCH = 8  # Table 2's mbs
MICROBATCHES = 16  # Table 2's M for 1F1B-Sync
MIB = 1 << 20
# Eco-FL Table 2 (EfficientNet-B6, TX2 + Nano, micro-batches of 8): average peak GPU
# memory per stage in GB; GPipe at M = 6 (M = 8 ran out of memory), 1F1B-Sync at M = 16.
PAPER_TABLE2 = {
    "model": "EfficientNet-B6, micro-batches of 8, TX2 + Nano (GPU memory)",
    "gpipe_m6_gb": [2.70, 1.20],
    "ecofl_1f1b_m16_gb": [1.70, 0.92],
    "gpipe_over_1f1b_per_stage": [round(2.70 / 1.70, 3), round(1.20 / 0.92, 3)],
    "gpipe_m8": "out of memory on stage 1",
}


def model_spec() -> ModelSpec:
    return ModelSpec("cnn", CNN, seed=0)


def cnn_macs() -> list[int]:
    """Multiply-accumulates of each of the CNN's units for one sample, forward: a 3x3
    convolution at its input's size (it pools after), then the linear head."""
    macs, size, channels = [], IMAGE_SIZE, 3
    for i, out in enumerate(CNN_CHANNELS):
        macs.append(9 * channels * out * size * size)
        channels = out
        if i > 0:  # the family's default: every unit but the first pools
            size //= 2
    macs.append(channels * size * size * NUM_CLASSES)
    return macs


def analytic_times(measured: ModelProfile) -> ModelProfile:
    """``measured``'s bytes (exact: tensor sizes) with times from multiply-accumulates
    (forward ``macs`` at :data:`REFERENCE_S_PER_MAC`, backward twice that), as the
    pipeline-client section plans. Times measured here under load are noise, and
    eq. 3's warm-ups follow them: one run planned stage 0 to hold 3 of 16
    micro-batches, another 13."""
    forward = [m * MICROBATCH * REFERENCE_S_PER_MAC for m in cnn_macs()]
    (k,) = [i for i, b in enumerate(measured.batch_sizes) if b == MICROBATCH]
    units = measured.units
    return synthetic_profile(
        forward,
        [u.output_bytes[k] for u in units],
        param_bytes=[u.param_bytes for u in units],
        memory_bytes=[u.memory_bytes[k] for u in units],
        backward_times_s=[2 * t for t in forward],
        activation_bytes=[(u.activation_bytes or (0,))[k] for u in units],
        input_bytes=measured.input_bytes[k],
        batch_size=MICROBATCH,
        names=[u.name for u in units],
    )


def plan_memory(profile: ModelProfile, num_microbatches: int) -> TrainingPlan:
    """Eco-FL's 1F1B-Sync plan of the CNN over the home (section 4.3's search at
    micro-batches of :data:`MICROBATCH`)."""
    cluster = ClusterSpec(tuple(home_devices(HOME)))
    return search_microbatch_and_order(
        profile, cluster, num_microbatches=num_microbatches, microbatch_sizes=[MICROBATCH]
    )


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def memory_figures(
    stages: Sequence[str], one_f1b: Mapping[str, Mapping[str, float]], gpipe: Mapping[str, Any]
) -> dict[str, Any]:
    """The summary keys from each system's per-stage figures (``peak_rss_mib``,
    ``peak_over_idle_mib``, ``torch_saved_mib``), stages in pipeline order."""

    def per_stage(key: str) -> list[float | None]:
        return [_ratio(gpipe[s][key], one_f1b[s][key]) for s in stages]

    largest = {
        name: max(figures[s]["peak_rss_mib"] for s in stages)
        for name, figures in (("1f1b", one_f1b), ("gpipe", gpipe))
    }
    return {
        "gpipe_over_1f1b_peak_memory": _ratio(largest["gpipe"], largest["1f1b"]),
        "gpipe_over_1f1b_peak_memory_per_stage": per_stage("peak_rss_mib"),
        "gpipe_over_1f1b_peak_over_idle_per_stage": per_stage("peak_over_idle_mib"),
        "gpipe_over_1f1b_torch_saved_per_stage": per_stage("torch_saved_mib"),
    }


async def _run_system(
    plan: TrainingPlan, batches: list[tuple[torch.Tensor, torch.Tensor]], threads: int
) -> dict[str, dict[str, float]]:
    """One fresh cluster of spawned stages trains ``batches`` on ``plan``: each stage's
    resident memory before, its peak over the run, and torch's saved bytes."""
    devices = [DeviceSpec(name, threads=threads) for name in plan.devices]
    async with AsyncLocalCluster(
        devices,
        measure_links=False,
        allow_factories=(FACTORY,),
        start_timeout_s=240.0,
        zygote=False,  # a fork of a zygote shares its pages: spawn for a process's own peak
    ) as cluster:
        pids = {name: cluster.processes[name].pid for name in plan.devices}
        idle = {}
        for name, pid in pids.items():
            idle[name] = status_kib("VmRSS", pid) or 0
            if not reset_peak(pid):
                raise RuntimeError(f"cannot reset the peak memory of stage {name} (pid {pid})")
        report = await cluster.fit(
            model_spec(),
            batches,
            optimizer=optimizer_config(0.05, 0.05),
            num_microbatches=plan.num_microbatches,
            plan=plan,
            progress=False,
        )
        peaks = {name: status_kib("VmHWM", pid) or 0 for name, pid in pids.items()}
    out = {}
    for name in plan.devices:
        counters = report.stages.get(name, {})
        out[name] = {
            "idle_rss_mib": round(idle[name] / 1024, 1),
            "peak_rss_mib": round(peaks[name] / 1024, 1),
            "peak_over_idle_mib": round((peaks[name] - idle[name]) / 1024, 1),
            "torch_saved_mib": round(int(counters.get("peak_activation_bytes") or 0) / MIB, 2),
            "peak_live_activations": int(counters.get("peak_live_activations") or 0),
        }
    return out


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    # imported here: profiling builds the model's units in this process
    from zpipe.stage.profiling import profile_model

    m = args.pipeline_memory_microbatches
    measured = profile_model(model_spec(), batch_sizes=[MICROBATCH], train=True, repeats=1)
    one_f1b = plan_memory(analytic_times(measured), m)
    gpipe = gpipe_of(one_f1b)
    rng = np.random.default_rng(0)
    size = MICROBATCH * m
    batches = []
    for _ in range(args.pipeline_memory_steps):
        x = rng.normal(size=(size, 3, IMAGE_SIZE, IMAGE_SIZE))
        y = rng.integers(0, NUM_CLASSES, size=size)
        batches.append((torch.tensor(x, dtype=torch.float32), torch.tensor(y)))
    threads = 1  # two stages on a shared machine; memory does not depend on speed
    figures: dict[str, dict[str, dict[str, float]]] = {}
    for system, plan in (("1f1b", one_f1b), ("gpipe", gpipe)):
        figures[system] = await _run_system(plan, batches, threads)
        emit(
            {
                "bench": "federated",
                "section": "pipeline_memory",
                "system": system,
                "stages": figures[system],
                "loadavg": loadavg(),
            }
        )
    stages = one_f1b.devices
    return {
        **memory_figures(stages, figures["1f1b"], figures["gpipe"]),
        "pipeline_memory_stages": {s: {k: figures[k][s] for k in figures} for s in stages},
        "pipeline_memory_plan": {
            "stages": [[list(s.devices), s.start, s.end, s.warmup] for s in one_f1b.stages],
            "microbatch_size": one_f1b.microbatch_size,
            "num_microbatches": m,
        },
        "pipeline_memory_model": {"family": "cnn", **CNN},
        "pipeline_memory_paper_table2": PAPER_TABLE2,
    }


def pipeline_memory_section(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    out = asyncio.run(_measure(args))
    out["pipeline_memory_wall_s"] = round(time.perf_counter() - started, 1)
    return out


def check_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.pipeline_memory_steps < 1 or args.pipeline_memory_microbatches < 2:
        p.error("--pipeline-memory-steps must be >= 1 and --pipeline-memory-microbatches >= 2")


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--skip-pipeline-memory",
        action="store_true",
        help="leave out the pipeline-memory section (Table 2)",
    )
    p.add_argument("--pipeline-memory-steps", type=int, default=3, help="mini-batches a run")
    p.add_argument(
        "--pipeline-memory-microbatches",
        type=int,
        default=MICROBATCHES,
        help=f"micro-batches of {MICROBATCH} a mini-batch (default {MICROBATCHES}, Eco-FL's)",
    )
