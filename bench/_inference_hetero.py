"""``bench/inference.py``'s ``hetero`` section: PipeEdge's plan against the even
partition on one heterogeneous cluster (split out of that script to keep it
small; behaviour unchanged).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from bench._common import emit
from bench._inference_common import (
    BENCH,
    HETERO_DEVICES,
    HETERO_PLANNERS,
    Outputs,
    _auto_slowdown_scale,
    _close,
    _cpu_demand,
    _device_config,
    _devices,
    _median_index,
    _ratio,
    _round,
)
from zpipe.client import RunReport
from zpipe.cluster import LocalCluster
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence
from zpipe.planner import Plan


@dataclass
class HeteroRun:
    """One timed run of one planner: its report, outputs and when each result arrived."""

    planner: str
    report: RunReport
    outputs: list[Outputs]
    arrivals: list[float] = field(default_factory=list)  # perf_counter per result

    @property
    def throughput(self) -> float:
        return self.report.throughput

    def steady_throughput(self, microbatch_size: int, exact: bool) -> float | None:
        """Samples/s from the first result to the last: the pipeline's fill left out.

        ``None`` unless every micro-batch holds ``microbatch_size`` samples (``exact``).
        """
        if not exact or len(self.arrivals) < 2:
            return None
        span = self.arrivals[-1] - self.arrivals[0]
        return (len(self.arrivals) - 1) * microbatch_size / span if span > 0 else None


def _stage_rows(report: RunReport, predicted: Mapping[str, float]) -> list[dict[str, Any]]:
    """Per stage: the plan's predicted compute and send per micro-batch beside the measured.

    ``busy_per_mb_s`` is the stage's compute loop time per micro-batch (the emulated
    slowdown included, as in the profile); ``send_per_mb_s`` is its sender's time per
    micro-batch on the emulated link and the downstream queue (waiting included).
    """
    rows = []
    for i, stage in enumerate(report.plan.stages):
        m = report.stages.get(stage.device, {})
        count = int(m.get("microbatches") or 0)
        busy, send = float(m.get("busy_s", 0.0)), float(m.get("send_s", 0.0))
        busy_per_mb = busy / count if count else None
        compute = predicted.get(f"stage{i}_compute_s")
        rows.append(
            {
                "stage": i,
                "device": stage.device,
                "units": [stage.start, stage.end],
                "microbatches": count,
                "predicted_compute_s": _round(compute, 5),
                "busy_per_mb_s": _round(busy_per_mb, 5),
                "busy_over_predicted": _ratio(busy_per_mb, compute),
                "predicted_comm_s": _round(predicted.get(f"stage{i}_comm_s"), 5),
                "send_per_mb_s": round(send / count, 5) if count else None,
                "utilisation": round(float(m.get("utilisation", 0.0)), 4),
                "busy_s": round(busy, 4),
                "idle_s": round(float(m.get("idle_s", 0.0)), 4),
                "blocked_s": round(float(m.get("blocked_s", 0.0)), 4),
                "send_s": round(send, 4),
            }
        )
    return rows


def _timed_hetero_run(
    cluster: LocalCluster,
    spec: ModelSpec,
    batches: list[Outputs],
    planner: str,
    stream: Mapping[str, Any],
) -> HeteroRun:
    arrivals: list[float] = []

    def progress(done: int, sent: int) -> None:
        arrivals.append(time.perf_counter())

    outputs, report = cluster.infer(spec, batches, planner=planner, progress=progress, **stream)
    return HeteroRun(planner, report, outputs, arrivals)


def run_hetero(
    args: argparse.Namespace, spec: ModelSpec, warmup: list[Outputs], batches: list[Outputs]
) -> tuple[dict[str, Any], bool]:
    """PipeEdge's plan against the even partition on one cluster: summary keys, outputs match."""
    sequence = load_layer_sequence(spec)
    cores = os.cpu_count() or 1
    threads = args.threads or max(1, cores // len(HETERO_DEVICES))  # as LocalCluster does
    scale = args.hetero_slowdown_scale or _auto_slowdown_scale(HETERO_DEVICES, threads, cores)
    devices = _devices(args, threads, HETERO_DEVICES, scale)
    stream = {
        "microbatch_size": args.microbatch_size,
        "max_in_flight": args.hetero_max_in_flight,
        "dtype": args.dtype,
    }
    exact = args.batch_size % args.microbatch_size == 0
    print(
        f"hetero section: pipeedge vs even, slowdowns x{scale:g} "
        f"({', '.join(f'{d.name} {d.slowdown:g}' for d in devices)})",
        file=sys.stderr,
        flush=True,
    )
    runs: dict[str, list[HeteroRun]] = {p: [] for p in HETERO_PLANNERS}
    warm_plans: dict[str, Plan] = {}
    with LocalCluster(devices, log_level="warning") as cluster:
        for planner in HETERO_PLANNERS:  # profiling (pipeedge's first run) and shard builds
            started = time.perf_counter()
            _, warm = cluster.infer(spec, warmup, planner=planner, **stream)
            warm_plans[planner] = warm.plan
            print(
                f"  warm-up {planner}: {time.perf_counter() - started:.1f} s, plan "
                f"{warm.plan.to_dict()['stages']}",
                file=sys.stderr,
                flush=True,
            )
        for repeat in range(args.repeats):
            turn = HETERO_PLANNERS if repeat % 2 == 0 else HETERO_PLANNERS[::-1]
            for planner in turn:
                result = _timed_hetero_run(cluster, spec, batches, planner, stream)
                if result.report.plan.stages != warm_plans[planner].stages:
                    raise RuntimeError(f"the {planner} plan changed between runs")
                runs[planner].append(result)
                rate = result.steady_throughput(args.microbatch_size, exact)
                print(
                    f"  repeat {repeat + 1}/{args.repeats} {planner}: "
                    f"{result.throughput:.2f} samples/s"
                    + (f" (steady {rate:.2f})" if rate is not None else ""),
                    file=sys.stderr,
                    flush=True,
                )

    medians = {p: runs[p][_median_index([r.throughput for r in runs[p]])] for p in runs}
    pipeedge, even = medians["pipeedge"], medians["even"]
    baseline = pipeedge.report.baseline
    # The even run is planned without profiles, so it has no prediction of its own; the
    # pipeedge run's baseline is the even partition over the same devices, predicted on
    # the same profiles (None when PipeEdge's plan is itself the even one).
    even_is_baseline = baseline is not None and baseline.stages == even.report.plan.stages
    if even.report.plan.predicted:
        even_predicted, even_source = dict(even.report.plan.predicted), "even run's plan"
    elif even_is_baseline:
        assert baseline is not None
        even_predicted, even_source = dict(baseline.predicted), "pipeedge run's baseline"
    elif pipeedge.report.plan.stages == even.report.plan.stages:
        even_predicted = dict(pipeedge.report.plan.predicted)
        even_source = "pipeedge plan (the same partition)"
    else:
        even_predicted, even_source = {}, "none"

    config = {
        "hetero_model": args.model,
        "hetero_layers": args.layers,
        "hetero_units": sequence.num_units,
        "hetero_batches": args.batches,
        "hetero_batch_size": args.batch_size,
        "hetero_microbatch_size": args.microbatch_size,
        "hetero_max_in_flight": args.hetero_max_in_flight,
        "hetero_dtype": args.dtype,
        "hetero_threads_per_stage": threads,
        "hetero_cores": cores,
        "hetero_repeats": args.repeats,
        "hetero_devices": _device_config(devices),
        "hetero_slowdown_scale": scale,
        "hetero_host_cpu_demand": round(_cpu_demand(devices, threads), 3),
    }
    measured: dict[str, float] = {}
    steady: dict[str, float | None] = {}
    predicted_tput: dict[str, float | None] = {}
    stage_rows: dict[str, list[dict[str, Any]]] = {}
    for planner, result, predicted in (
        ("pipeedge", pipeedge, pipeedge.report.plan.predicted),
        ("even", even, even_predicted),
    ):
        tputs = [r.throughput for r in runs[planner]]
        steadies = [r.steady_throughput(args.microbatch_size, exact) for r in runs[planner]]
        known = [s for s in steadies if s is not None]
        measured[planner] = statistics.median(tputs)
        steady[planner] = statistics.median(known) if known else None
        predicted_tput[planner] = predicted.get("throughput_samples_per_s")
        stage_rows[planner] = _stage_rows(result.report, predicted)
        report = result.report
        emit(
            {
                "bench": BENCH,
                "section": "hetero",
                "system": "zpipe",
                "planner": planner,
                "samples_per_s": round(measured[planner], 4),
                "samples_per_s_runs": [round(t, 4) for t in tputs],
                "steady_samples_per_s": _round(steady[planner]),
                "steady_samples_per_s_runs": [_round(s) for s in steadies],
                "predicted_samples_per_s": _round(predicted_tput[planner]),
                "prediction_source": "its plan" if planner == "pipeedge" else even_source,
                "measured_over_predicted": _ratio(measured[planner], predicted_tput[planner]),
                "measured_period_s": round(report.elapsed_s / report.microbatches, 5)
                if report.microbatches
                else None,
                "predicted_bottleneck_s": _round(predicted.get("bottleneck_s"), 5),
                "plan": report.plan.to_dict(),
                "baseline": report.baseline.to_dict() if report.baseline is not None else None,
                "samples": report.samples,
                "microbatches": report.microbatches,
                "elapsed_s": round(report.elapsed_s, 4),
                "stage_utilisation": {
                    row["device"]: row["utilisation"] for row in stage_rows[planner]
                },
                "utilisation_definition": "busy_s / (busy_s + idle_s + blocked_s)",
                "stages": stage_rows[planner],
                **config,
            }
        )

    tol = 1e-4 if args.dtype == "float32" else 1e-1
    with torch.inference_mode():
        reference = build_full_model(spec)(*batches[0])
    outputs_match = _close(pipeedge.outputs[0], even.outputs[0], tol) and _close(
        pipeedge.outputs[0], reference, tol
    )
    keys = {
        "ratio_vs_even": _ratio(measured["pipeedge"], measured["even"]),
        "predicted_ratio_vs_even": _ratio(predicted_tput["pipeedge"], predicted_tput["even"]),
        "measured_over_predicted": _ratio(measured["pipeedge"], predicted_tput["pipeedge"]),
        "even_measured_over_predicted": _ratio(measured["even"], predicted_tput["even"]),
        "steady_ratio_vs_even": _ratio(steady["pipeedge"], steady["even"]),
        "steady_measured_over_predicted": _ratio(steady["pipeedge"], predicted_tput["pipeedge"]),
        "steady_even_measured_over_predicted": _ratio(steady["even"], predicted_tput["even"]),
        "hetero_pipeedge_samples_per_s": round(measured["pipeedge"], 4),
        "hetero_even_samples_per_s": round(measured["even"], 4),
        "hetero_pipeedge_predicted_samples_per_s": _round(predicted_tput["pipeedge"]),
        "hetero_even_predicted_samples_per_s": _round(predicted_tput["even"]),
        "hetero_pipeedge_plan": pipeedge.report.plan.to_dict()["stages"],
        "hetero_even_plan": even.report.plan.to_dict()["stages"],
        "hetero_even_is_baseline": even_is_baseline,
        "hetero_even_prediction_source": even_source,
        "hetero_pipeedge_busy_over_predicted": {
            row["device"]: row["busy_over_predicted"] for row in stage_rows["pipeedge"]
        },
        "hetero_even_busy_over_predicted": {
            row["device"]: row["busy_over_predicted"] for row in stage_rows["even"]
        },
        "hetero_pipeedge_stage_utilisation": {
            row["device"]: row["utilisation"] for row in stage_rows["pipeedge"]
        },
        "hetero_even_stage_utilisation": {
            row["device"]: row["utilisation"] for row in stage_rows["even"]
        },
        "hetero_outputs_match": outputs_match,
        **config,
    }
    return keys, outputs_match
