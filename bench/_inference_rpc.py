"""``bench/inference.py``'s ``rpc`` section: zpipe against a PipeEdge-style
torch.distributed.rpc pipeline on the same devices and partition (split out of
that script to keep it small; behaviour unchanged).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

import torch

from bench._common import emit
from bench._inference_common import (
    BENCH,
    CpuMeter,
    Outputs,
    _close,
    _device_config,
    _devices,
    _max_abs_diff,
    _median_index,
    _metered,
)
from bench._torch_rpc_baseline import RpcRunResult, StageSetup, TorchRpcPipeline
from zpipe.client import RunReport
from zpipe.cluster import LocalCluster
from zpipe.demo import DEMO_DEVICES
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence


def _zpipe_line(report: RunReport, runs: list[float]) -> dict[str, Any]:
    utilisation, busy_fraction, stages = {}, {}, {}
    for name in report.plan.devices:
        m = report.stages.get(name, {})
        utilisation[name] = round(float(m.get("utilisation", 0.0)), 4)
        busy = float(m.get("busy_s", 0.0))
        busy_fraction[name] = round(busy / report.elapsed_s, 4) if report.elapsed_s else 0.0
        stages[name] = {
            k: m.get(k)
            for k in (
                "busy_s",
                "idle_s",
                "blocked_s",
                "send_s",
                "bytes_in",
                "bytes_out",
                "microbatches",
            )
        }
    return {
        "bench": BENCH,
        "system": "zpipe",
        "samples_per_s": round(report.throughput, 4),
        "samples_per_s_runs": [round(r, 4) for r in runs],
        "samples": report.samples,
        "microbatches": report.microbatches,
        "elapsed_s": round(report.elapsed_s, 4),
        "stage_utilisation": utilisation,
        "stage_busy_fraction": busy_fraction,
        "utilisation_definition": "busy_s / (busy_s + idle_s + blocked_s)",
        "stages": stages,
    }


def _rpc_line(result: RpcRunResult, runs: list[float], transport: str) -> dict[str, Any]:
    utilisation = {
        name: round(float(m["busy_s"]) / result.elapsed_s, 4) if result.elapsed_s else 0.0
        for name, m in result.stages.items()
    }
    return {
        "bench": BENCH,
        "system": "torch_rpc",
        "samples_per_s": round(result.throughput, 4),
        "samples_per_s_runs": [round(r, 4) for r in runs],
        "samples": result.samples,
        "microbatches": result.microbatches,
        "elapsed_s": round(result.elapsed_s, 4),
        "stage_utilisation": utilisation,
        "stage_busy_fraction": utilisation,
        "utilisation_definition": "busy_s / elapsed_s",
        "transport": transport,
        "stages": result.stages,
    }


def run_rpc(
    args: argparse.Namespace, spec: ModelSpec, warmup: list[Outputs], batches: list[Outputs]
) -> tuple[dict[str, Any], bool]:
    """zpipe against torch RPC on the same even partition: summary keys, outputs match."""
    sequence = load_layer_sequence(spec)
    cores = os.cpu_count() or 1
    threads = args.threads or max(1, cores // args.stages)
    devices = _devices(args, threads, DEMO_DEVICES[: args.stages])
    # Stages in the order of the device list (by default the coordinator orders them by name).
    stream = {"microbatch_size": args.microbatch_size, "max_in_flight": args.max_in_flight}
    order = {"stage_names": [d.name for d in devices], "dtype": args.dtype}
    transports, channels = (["uv"], ["basic"]) if args.rpc_transport == "tcp" else (None, None)
    transport = "tensorpipe uv/basic (loopback TCP)" if transports else "tensorpipe auto"
    config = {
        "model": args.model,
        "layers": args.layers,
        "units": sequence.num_units,
        "batches": args.batches,
        "batch_size": args.batch_size,
        "microbatch_size": args.microbatch_size,
        "max_in_flight": args.max_in_flight,
        "dtype": args.dtype,
        "threads_per_stage": threads,
        "cores": cores,
        "repeats": args.repeats,
        "warmup_batches": args.warmup_batches,
        "devices": _device_config(devices),
    }
    microbatches = args.batches * -(-args.batch_size // args.microbatch_size)
    zpipe_runs: list[tuple[float, RunReport, list[Outputs], dict[str, float]]] = []
    rpc_runs: list[tuple[RpcRunResult, dict[str, float]]] = []
    print("rpc section: zpipe vs torch RPC", file=sys.stderr, flush=True)
    with LocalCluster(devices, log_level="warning") as cluster:
        # An explicit even partition: the comparison is of runtimes, not of plans.
        _, warm_report = cluster.infer(spec, warmup, planner="even", **order, **stream)
        plan = warm_report.plan
        partition = [[s.start, s.end] for s in plan.stages]
        by_name = {d.name: d for d in devices}
        setups = [
            StageSetup(
                s.device,
                s.start,
                s.end,
                by_name[s.device].slowdown,
                by_name[s.device].bandwidth_mbps,
                by_name[s.device].latency_ms,
            )
            for s in plan.stages
        ]
        zpipe_pids = {name: int(p.pid) for name, p in cluster.processes.items()}
        with TorchRpcPipeline(
            spec,
            setups,
            dtype=args.dtype,
            threads=threads,
            rpc_timeout_s=args.rpc_timeout,
            transports=transports,
            channels=channels,
        ) as baseline:
            baseline.run(warmup, **stream)
            for repeat in range(args.repeats):
                # Alternate which system goes first, so a drift in machine load hits both.
                turn = ("zpipe", "torch_rpc") if repeat % 2 == 0 else ("torch_rpc", "zpipe")
                for system in turn:
                    if system == "zpipe":
                        meter = CpuMeter(zpipe_pids)

                        def progress(done: int, sent: int, meter: CpuMeter = meter) -> None:
                            if done == microbatches:
                                meter.stop()

                        outputs, report = cluster.infer(
                            spec,
                            _metered(batches, meter),
                            progress=progress,
                            planner="even",
                            **order,
                            **stream,
                        )
                        if report.plan.to_dict()["stages"] != plan.to_dict()["stages"]:
                            raise RuntimeError("zpipe changed its partition between runs")
                        zpipe_runs.append((report.throughput, report, outputs, meter.cpu_s))
                        tput = report.throughput
                    else:
                        meter = CpuMeter(baseline.pids)
                        meter.start()
                        result = baseline.run(batches, **stream)
                        meter.stop()
                        rpc_runs.append((result, meter.cpu_s))
                        tput = result.throughput
                    print(
                        f"  repeat {repeat + 1}/{args.repeats} {system}: {tput:.2f} samples/s"
                        f", {meter.cpu_s.get('total', 0.0):.2f} CPU s",
                        file=sys.stderr,
                        flush=True,
                    )

    z_tputs = [t for t, _, _, _ in zpipe_runs]
    r_tputs = [r.throughput for r, _ in rpc_runs]
    _, z_report, z_outputs, z_cpu = zpipe_runs[_median_index(z_tputs)]
    r_result, r_cpu = rpc_runs[_median_index(r_tputs)]
    z_line = {
        **_zpipe_line(z_report, z_tputs),
        "samples_per_s": round(statistics.median(z_tputs), 4),
        "cpu_s": z_cpu,
        "cpu_ms_per_sample": round(1e3 * z_cpu.get("total", 0.0) / z_report.samples, 3),
        "partition": partition,
        **config,
    }
    r_line = {
        **_rpc_line(r_result, r_tputs, transport),
        "samples_per_s": round(statistics.median(r_tputs), 4),
        "cpu_s": r_cpu,
        "cpu_ms_per_sample": round(1e3 * r_cpu.get("total", 0.0) / r_result.samples, 3),
        "partition": partition,
        **config,
    }
    emit(z_line)
    emit(r_line)

    tol = 1e-4 if args.dtype == "float32" else 1e-1
    first_rpc = rpc_runs[-1][0].outputs[0]
    outputs_match = _close(z_outputs[0], first_rpc, tol)
    with torch.inference_mode():
        reference = build_full_model(spec)(*batches[0])
    matches_reference = _close(z_outputs[0], reference, tol) and _close(first_rpc, reference, tol)
    ratio = z_line["samples_per_s"] / r_line["samples_per_s"] if r_line["samples_per_s"] else 0.0
    keys = {
        "ratio_vs_torch_rpc": round(ratio, 4),
        "zpipe_samples_per_s": z_line["samples_per_s"],
        "torch_rpc_samples_per_s": r_line["samples_per_s"],
        "zpipe_cpu_ms_per_sample": z_line["cpu_ms_per_sample"],
        "torch_rpc_cpu_ms_per_sample": r_line["cpu_ms_per_sample"],
        "outputs_match": outputs_match,
        "outputs_max_abs_diff": _max_abs_diff(z_outputs[0], first_rpc),
        "matches_single_process": matches_reference,
        "zpipe_stage_utilisation": z_line["stage_utilisation"],
        "torch_rpc_stage_utilisation": r_line["stage_utilisation"],
        "partition": partition,
        "transport": transport,
        **config,
    }
    return keys, outputs_match and matches_reference
