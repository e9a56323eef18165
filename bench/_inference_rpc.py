"""``bench/inference.py``'s ``rpc`` section: zpipe against a PipeEdge-style
torch.distributed.rpc pipeline on the same devices and partition (split out of
that script to keep it small; behaviour unchanged).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass
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
from zpipe.cli.demo import DEMO_DEVICES
from zpipe.client import RunReport
from zpipe.cluster import DeviceSpec, LocalCluster
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


@dataclass(frozen=True)
class RpcComparison:
    """What both systems of one zpipe vs torch RPC comparison run, and how."""

    spec: ModelSpec
    devices: list[DeviceSpec]
    threads: int
    microbatch_size: int
    # each is measured (every repeat alternates the systems over each of them); the
    # first is the comparison's headline
    max_in_flight: tuple[int, ...]
    dtype: str
    repeats: int
    rpc_transport: str
    rpc_timeout_s: float
    config: dict[str, Any]  # on every JSON line and in the keys
    section: str = "rpc"  # names the JSON lines and the progress on stderr


def run_rpc(
    args: argparse.Namespace, spec: ModelSpec, warmup: list[Outputs], batches: list[Outputs]
) -> tuple[dict[str, Any], bool]:
    """zpipe against torch RPC on the same even partition: summary keys, outputs match."""
    sequence = load_layer_sequence(spec)
    cores = os.cpu_count() or 1
    threads = args.threads or max(1, cores // args.stages)
    devices = _devices(args, threads, DEMO_DEVICES[: args.stages])
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
    comparison = RpcComparison(
        spec=spec,
        devices=devices,
        threads=threads,
        microbatch_size=args.microbatch_size,
        max_in_flight=(args.max_in_flight,),
        dtype=args.dtype,
        repeats=args.repeats,
        rpc_transport=args.rpc_transport,
        rpc_timeout_s=args.rpc_timeout,
        config=config,
    )
    results = compare_with_torch_rpc(comparison, warmup, batches)
    return results[args.max_in_flight]


def compare_with_torch_rpc(
    comparison: RpcComparison, warmup: list[Outputs], batches: list[Outputs]
) -> dict[int, tuple[dict[str, Any], bool]]:
    """zpipe against torch RPC, the two alternating in one process each, for every
    in-flight bound: per bound, the summary keys and whether the outputs match."""
    c = comparison
    devices = c.devices
    # Stages in the order of the device list (by default the coordinator orders them by name).
    order: dict[str, Any] = {"stage_names": [d.name for d in devices], "dtype": c.dtype}
    transports, channels = (["uv"], ["basic"]) if c.rpc_transport == "tcp" else (None, None)
    transport = "tensorpipe uv/basic (loopback TCP)" if transports else "tensorpipe auto"
    microbatches = sum(-(-int(b[0].shape[0]) // c.microbatch_size) for b in batches)
    zpipe_runs: dict[int, list[tuple[float, RunReport, list[Outputs], dict[str, float]]]] = {
        bound: [] for bound in c.max_in_flight
    }
    rpc_runs: dict[int, list[tuple[RpcRunResult, dict[str, float]]]] = {
        bound: [] for bound in c.max_in_flight
    }
    print(f"{c.section} section: zpipe vs torch RPC", file=sys.stderr, flush=True)
    with LocalCluster(devices, log_level="warning") as cluster:
        # An explicit even partition: the comparison is of runtimes, not of plans.
        first: dict[str, Any] = {
            "microbatch_size": c.microbatch_size,
            "max_in_flight": c.max_in_flight[0],
        }
        _, warm_report = cluster.infer(c.spec, warmup, planner="even", **order, **first)
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
            c.spec,
            setups,
            dtype=c.dtype,
            threads=c.threads,
            rpc_timeout_s=c.rpc_timeout_s,
            transports=transports,
            channels=channels,
        ) as baseline:
            baseline.run(warmup, **first)
            for repeat in range(c.repeats):
                # Alternate which system goes first, so a drift in machine load hits both.
                turn = ("zpipe", "torch_rpc") if repeat % 2 == 0 else ("torch_rpc", "zpipe")
                for bound in c.max_in_flight:
                    stream: dict[str, Any] = {
                        "microbatch_size": c.microbatch_size,
                        "max_in_flight": bound,
                    }
                    for system in turn:
                        if system == "zpipe":
                            meter = CpuMeter(zpipe_pids)

                            def progress(done: int, sent: int, meter: CpuMeter = meter) -> None:
                                if done == microbatches:
                                    meter.stop()

                            outputs, report = cluster.infer(
                                c.spec,
                                _metered(batches, meter),
                                progress=progress,
                                planner="even",
                                **order,
                                **stream,
                            )
                            if report.plan.to_dict()["stages"] != plan.to_dict()["stages"]:
                                raise RuntimeError("zpipe changed its partition between runs")
                            zpipe_runs[bound].append(
                                (report.throughput, report, outputs, meter.cpu_s)
                            )
                            tput = report.throughput
                        else:
                            meter = CpuMeter(baseline.pids)
                            meter.start()
                            result = baseline.run(batches, **stream)
                            meter.stop()
                            rpc_runs[bound].append((result, meter.cpu_s))
                            tput = result.throughput
                        print(
                            f"  repeat {repeat + 1}/{c.repeats} max_in_flight {bound} {system}: "
                            f"{tput:.2f} samples/s, {meter.cpu_s.get('total', 0.0):.2f} CPU s",
                            file=sys.stderr,
                            flush=True,
                        )
    return {
        bound: _compared(
            c, zpipe_runs[bound], rpc_runs[bound], bound, partition, transport, batches
        )
        for bound in c.max_in_flight
    }


def _compared(
    c: RpcComparison,
    zpipe_runs: list[tuple[float, RunReport, list[Outputs], dict[str, float]]],
    rpc_runs: list[tuple[RpcRunResult, dict[str, float]]],
    bound: int,
    partition: list[list[int]],
    transport: str,
    batches: list[Outputs],
) -> tuple[dict[str, Any], bool]:
    """The JSON lines (emitted) and the summary keys of one in-flight bound's runs."""
    config = {**c.config, "max_in_flight": bound}
    section = {} if c.section == "rpc" else {"section": c.section}
    z_tputs = [t for t, _, _, _ in zpipe_runs]
    r_tputs = [r.throughput for r, _ in rpc_runs]
    _, z_report, z_outputs, z_cpu = zpipe_runs[_median_index(z_tputs)]
    r_result, r_cpu = rpc_runs[_median_index(r_tputs)]
    z_line = {
        **_zpipe_line(z_report, z_tputs),
        **section,
        "samples_per_s": round(statistics.median(z_tputs), 4),
        "cpu_s": z_cpu,
        "cpu_ms_per_sample": round(1e3 * z_cpu.get("total", 0.0) / z_report.samples, 3),
        "partition": partition,
        **config,
    }
    r_line = {
        **_rpc_line(r_result, r_tputs, transport),
        **section,
        "samples_per_s": round(statistics.median(r_tputs), 4),
        "cpu_s": r_cpu,
        "cpu_ms_per_sample": round(1e3 * r_cpu.get("total", 0.0) / r_result.samples, 3),
        "partition": partition,
        **config,
    }
    emit(z_line)
    emit(r_line)

    tol = 1e-4 if c.dtype == "float32" else 1e-1
    first_rpc = rpc_runs[-1][0].outputs[0]
    outputs_match = _close(z_outputs[0], first_rpc, tol)
    with torch.inference_mode():
        reference = build_full_model(c.spec)(*batches[0])
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
