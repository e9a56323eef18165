"""Inference throughput of zpipe: against a PipeEdge-style torch.distributed.rpc
pipeline, and PipeEdge's plan against the even partition on a heterogeneous cluster.

Both sections run one ViT-Base-style model (``vit-base`` with fewer blocks, so
that the run takes minutes on two cores) over emulated heterogeneous devices
(slower compute by a factor, slower outgoing links in Mbit/s plus a latency)
and push a stream of batches through it in micro-batches. Each section first
streams ``--warmup-batches`` batches (not timed), then its timed runs
alternate between the two things it compares (``--repeats`` each) and the
median run of each is reported. Throughput is samples over the streaming part
of a run, pipeline fill and drain included.

1. ``rpc`` (``--skip-rpc`` leaves it out): zpipe against torch RPC. The model
   is split evenly over the first 3 or 4 of the demo's devices, with at most
   ``--max-in-flight`` micro-batches in the pipeline. Both systems run the same
   partition (zpipe's even one, stages in the device list's order):

   * ``zpipe``: a :class:`zpipe.cluster.LocalCluster` (a coordinator and one
     stage process per device, ZeroMQ over loopback TCP); throughput is
     ``RunReport.throughput`` and a stage's utilisation is the stage's own
     ``utilisation`` counter, ``busy_s / (busy_s + idle_s + blocked_s)`` of its
     compute loop from the first input on.
   * ``torch_rpc``: PipeEdge's runtime over ``torch.distributed.rpc``
     (TensorPipe), one spawned worker process per stage plus this process as
     the driver, stages chained with ``rpc_async`` (see
     ``bench/_torch_rpc_baseline.py``). It computes with the same
     :class:`zpipe.stage.shard.Shard` (hence the same slowdown emulation) and
     pays the same emulated link (serialisation time at the sender, latency in
     flight). Its utilisation is ``busy_s / elapsed_s``.

   zpipe runs with ``planner="even"``: this section compares runtimes, not
   plans. Both use the same number of torch threads per stage (``cores // stages``,
   at least 1, what ``LocalCluster`` gives its stages). The outputs of the
   first batch are compared between the systems (and with a single-process run
   of the whole model). Each system's CPU seconds over the timed part of a run
   (its processes and this one, from /proc) are reported too: the model's
   compute is the same in both, so the difference is what the runtimes cost.
   Summary keys: ``ratio_vs_torch_rpc`` = zpipe samples/s / torch_rpc
   samples/s, and the other keys without a ``hetero_`` prefix.

2. ``hetero`` (``--skip-hetero`` leaves it out): PipeEdge's plan against the
   even partition, measured in the same run. A LocalCluster of three devices,
   ``fast`` (1x, 800 Mbit/s), ``slow`` (4x slower, 400 Mbit/s) and ``mid``
   (1.5x slower, 200 Mbit/s), their slowdowns all multiplied by one factor
   (``--hetero-slowdown-scale``; by default the least at which the three
   devices, busy at once, use at most half this machine's cores: 2 on two
   cores; ``HOST_CORE_SHARE`` says why), runs the model with
   ``planner="pipeedge"`` (the coordinator's default: every stage profiles the
   model itself, all at once, and the PipeEdge DP picks the devices, their
   order and the split) and with ``planner="even"`` (GPipe's partition over
   the devices in the given order), with at most ``--hetero-max-in-flight``
   micro-batches in flight. One warm-up run per planner keeps profiling and
   shard building out of the timed runs. The even run carries no prediction
   (the coordinator plans it without profiles), so its prediction is that of
   the pipeedge run's ``RunReport.baseline``: the even partition over the same
   devices, predicted from the same profiles; the bench checks that the two
   partitions are the same (``hetero_even_is_baseline``). One JSON line per
   planner gives the plan, the measured and predicted throughput and, per
   stage, the predicted compute and send time of a micro-batch beside the
   measured ``busy_s`` and ``send_s`` per micro-batch, and the utilisation.
   Summary keys: ``ratio_vs_even`` (measured pipeedge / measured even),
   ``predicted_ratio_vs_even``, ``measured_over_predicted`` (measured pipeedge
   / its plan's ``throughput_samples_per_s``), ``even_measured_over_predicted``,
   the same three over the steady state (``steady_*``: the micro-batches after
   the first result over the time from the first result to the last, i.e.
   without the pipeline's fill, which the cost model's ``b / bottleneck``
   leaves out) and the other ``hetero_*`` keys.

3. ``imported`` (only with ``--imported-hf-vit``; needs transformers): real
   imported weights. A random-init ``transformers`` ViTForImageClassification
   of ``--model``'s size with ``--layers`` blocks is converted by ``python -m
   zpipe import hf-vit`` and run over ``--imported-stages`` equal devices (no
   link emulation, even partition); its outputs are compared with the
   transformers model's logits, and its samples/s with the transformers model
   and zpipe's model each run whole in this process (see
   ``bench/_imported_vit.py``). One JSON line per stage gives the planners'
   predicted memory against the measured (and the stage process's peak RSS).
   Summary keys: ``imported_ratio_vs_hf``, ``imported_outputs_match_hf``,
   ``imported_max_abs_diff_vs_hf``, ``imported_memory_predicted_over_measured``
   and the other ``imported_*`` keys.

Output: JSON lines (one per system or planner), then one summary object with
the keys of the sections that ran, and the machine's load averages at the start
and the end (other work on the machine skews every number).

Run: ``.venv/bin/python bench/inference.py`` (a few minutes on two cores), or
``.venv/bin/python bench/inference.py --quick`` (a tiny model, about a minute;
its numbers are dominated by per-message costs and say little).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench._common import emit, loadavg, on_alarm, summary
from bench._torch_rpc_baseline import RpcRunResult, StageSetup, TorchRpcPipeline
from zpipe.cli_common import positive_float, positive_int
from zpipe.client import RunReport
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.demo import DEMO_DEVICES
from zpipe.log import configure_logging
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence
from zpipe.planner import Plan

BENCH = "inference"
DRIVER_KEY = "client/driver"  # this process: zpipe's client, or the rpc driver
VIT_PRESETS = ("vit-tiny", "vit-base", "vit-large")
Outputs = tuple[torch.Tensor, ...]

# The heterogeneous section's cluster: one device 4x slower than the fastest (the
# demo's first three devices, named apart so that this benchmark stays put when the
# demo changes). Links are fast enough that compute sets the pipeline's pace (a
# ViT-Base activation of a micro-batch of 2 is 1.2 MB: 12 ms at 800 Mbit/s, 48 ms at
# 200), unless a plan cuts after an MLP's first layer (4x that), which the planner
# sees and avoids.
HETERO_DEVICES = (
    DeviceSpec("fast", slowdown=1.0, bandwidth_mbps=800.0, latency_ms=2.0),
    DeviceSpec("slow", slowdown=4.0, bandwidth_mbps=400.0, latency_ms=5.0),
    DeviceSpec("mid", slowdown=1.5, bandwidth_mbps=200.0, latency_ms=5.0),
)
# Emulated devices share this machine's cores. A device with slowdown s computes for
# 1/s of its busy time (it sleeps the rest), so a pipeline whose stages are all busy
# needs sum(threads / s) cores. Past about half the cores, stages wait for a core,
# and a stage's emulated slowdown stretches that wait s times over (it sleeps s - 1
# times its measured compute): the devices stop being independent, which neither a
# real cluster nor the planner's cost model has. By default every slowdown is scaled
# up (the same factor for all, so their ratios stay) until the devices need at most
# this share of the cores.
HOST_CORE_SHARE = 0.5
HETERO_PLANNERS = ("pipeedge", "even")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=".venv/bin/python bench/inference.py",
        description="Pipelined inference throughput of zpipe: against a PipeEdge-style "
        "torch.distributed.rpc pipeline on the same emulated heterogeneous devices, and "
        "PipeEdge's plan against the even partition on a cluster with one 4x slower device. "
        "Prints JSON lines: one per system or planner, then a summary.",
    )
    parser.add_argument(
        "--model", choices=VIT_PRESETS, default="vit-base", help="ViT preset (default: vit-base)"
    )
    parser.add_argument(
        "--layers", type=positive_int, default=4, help="transformer blocks to keep (default: 4)"
    )
    parser.add_argument(
        "--stages",
        type=int,
        choices=(3, 4),
        default=3,
        help="rpc section: emulated devices, the first N of the demo's (default: 3)",
    )
    parser.add_argument(
        "--batches", type=positive_int, default=8, help="batches per timed run (default: 8)"
    )
    parser.add_argument("--batch-size", type=positive_int, default=8, help="(default: 8)")
    parser.add_argument("--microbatch-size", type=positive_int, default=2, help="(default: 2)")
    parser.add_argument(
        "--max-in-flight",
        type=positive_int,
        default=4,
        help="rpc section: micro-batches in the pipeline at once, both systems (default: 4)",
    )
    parser.add_argument(
        "--hetero-max-in-flight",
        type=positive_int,
        default=8,
        help="hetero section: micro-batches in the pipeline at once (default: 8; "
        "the cost model assumes a pipeline that never starves, and one "
        "micro-batch's trip through the stages and links takes about four "
        "periods of the pipeedge plan)",
    )
    parser.add_argument(
        "--hetero-slowdown-scale",
        type=positive_float,
        default=None,
        help="hetero section: multiply every device's slowdown (1, 4, 1.5) by "
        "this (default: the least multiple of 0.25, at least 1, at which "
        "the devices busy at once need at most half the cores; 2 on two "
        "cores; 1 runs the slowdowns as they are)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="compute dtype on the stages (default: float32)",
    )
    parser.add_argument(
        "--warmup-batches",
        type=positive_int,
        default=2,
        help="batches streamed before the timed runs (default: 2)",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=5,
        help="timed runs per system or planner, alternating; the median is reported (default: 5)",
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch threads per stage, both systems (default: cores // stages, "
        "at least 1, as LocalCluster does)",
    )
    parser.add_argument(
        "--rpc-transport",
        choices=("tcp", "auto"),
        default="tcp",
        help="TensorPipe transport: 'tcp' = uv transport and basic channel, "
        "loopback TCP as zpipe uses (default); 'auto' = TensorPipe's "
        "choice, shared memory on one host, whose reactor thread busy-polls "
        "(about 0.4 core per process, which slows both systems on a small "
        "machine)",
    )
    parser.add_argument(
        "--no-links",
        action="store_true",
        help="no link emulation (bandwidth, latency) in either section",
    )
    parser.add_argument(
        "--skip-rpc", action="store_true", help="leave out the zpipe vs torch RPC section"
    )
    parser.add_argument(
        "--skip-hetero", action="store_true", help="leave out the pipeedge vs even section"
    )
    parser.add_argument(
        "--imported-hf-vit",
        action="store_true",
        help="add the imported section: a random-init Hugging Face ViT (--model's size, "
        "--layers blocks) converted by 'python -m zpipe import hf-vit' and run over "
        "--imported-stages stages in float32, against transformers' own outputs and samples/s, "
        "with memory predicted against measured per stage (needs transformers)",
    )
    parser.add_argument(
        "--imported-stages",
        type=positive_int,
        default=2,
        help="imported section: stages, equal devices without link emulation (default: 2)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weights and inputs seed")
    parser.add_argument(
        "--rpc-timeout",
        type=positive_float,
        default=120.0,
        help="torch.rpc call timeout and per-result wait, seconds (default: 120)",
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=1800.0,
        help="the whole benchmark gives up after this many seconds (default: 1800)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny run: vit-tiny, 2 layers, 2 batches of 4, micro-batches of 2, "
        "1 warm-up batch, 1 repeat",
    )
    return parser


def _apply_quick(args: argparse.Namespace) -> None:
    if args.quick:
        args.model, args.layers, args.batches, args.batch_size = "vit-tiny", 2, 2, 4
        args.microbatch_size, args.warmup_batches, args.repeats = 2, 1, 1


def _devices(
    args: argparse.Namespace, threads: int | None, specs: tuple[DeviceSpec, ...], scale: float = 1.0
) -> list[DeviceSpec]:
    devices = []
    for d in specs:
        link: dict[str, Any] = {"bandwidth_mbps": d.bandwidth_mbps, "latency_ms": d.latency_ms}
        if args.no_links:
            link = {"bandwidth_mbps": None, "latency_ms": 0.0}
        devices.append(DeviceSpec(d.name, slowdown=d.slowdown * scale, threads=threads, **link))
    return devices


def _cpu_demand(devices: list[DeviceSpec], threads: int) -> float:
    """Cores the emulated devices use when every one of them is busy all the time."""
    return sum((d.threads or threads) / max(d.slowdown, 1.0) for d in devices)


def _auto_slowdown_scale(specs: tuple[DeviceSpec, ...], threads: int, cores: int) -> float:
    """The least multiple of 0.25 (at least 1) that keeps ``specs`` within their cores' share."""
    demand = _cpu_demand(list(specs), threads)
    return max(1.0, math.ceil(4.0 * demand / (HOST_CORE_SHARE * cores)) / 4.0)


def _device_config(devices: list[DeviceSpec]) -> list[dict[str, Any]]:
    return [
        {
            "name": d.name,
            "slowdown": d.slowdown,
            "bandwidth_mbps": d.bandwidth_mbps,
            "latency_ms": d.latency_ms,
        }
        for d in devices
    ]


def _make_batches(args: argparse.Namespace, spec: ModelSpec) -> tuple[list[Outputs], list[Outputs]]:
    """The warm-up batches and the timed batches, seeded (the same in both sections)."""
    sequence = load_layer_sequence(spec)
    generator = torch.Generator().manual_seed(args.seed)

    def make(count: int) -> list[Outputs]:
        return [
            sequence.example_input(
                args.batch_size, seed=int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
            )
            for _ in range(count)
        ]

    return make(args.warmup_batches), make(args.batches)


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


def _median_index(values: list[float]) -> int:
    order = sorted(range(len(values)), key=values.__getitem__)
    return order[(len(order) - 1) // 2]


def _max_abs_diff(a: Outputs, b: Outputs) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))


def _close(a: Outputs, b: Outputs, tol: float) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and torch.allclose(x.float(), y.float(), atol=tol, rtol=tol)
        for x, y in zip(a, b, strict=True)
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def _round(x: float | None, digits: int = 4) -> float | None:
    return round(x, digits) if x is not None else None


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc); 0.0 if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds that this process and the given processes spend between start and stop."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._start: dict[str, float] = {}
        self.cpu_s: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        now = {name: _proc_cpu_s(pid) for name, pid in self.pids.items()}
        now[DRIVER_KEY] = time.process_time()
        return now

    def start(self) -> None:
        self._start = self._now()

    def stop(self) -> None:
        now = self._now()
        self.cpu_s = {name: round(now[name] - self._start[name], 3) for name in now}
        self.cpu_s["total"] = round(sum(self.cpu_s.values()), 3)


async def _metered(batches: list[Outputs], meter: CpuMeter) -> AsyncIterator[Outputs]:
    """The batches, starting ``meter`` when the client starts streaming (after set-up)."""
    meter.start()
    for batch in batches:
        yield batch


# ----------------------------------------------------------------------- rpc section


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


# -------------------------------------------------------------------- hetero section


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


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the sections asked for; emit and return the one summary object."""
    spec = ModelSpec.preset(args.model, seed=args.seed, num_layers=args.layers)
    warmup, batches = _make_batches(args, spec)
    keys: dict[str, Any] = {"loadavg_start": loadavg()}
    ok = True
    sections: list[tuple[str, Callable[..., tuple[dict[str, Any], bool]]]] = []
    if not args.skip_rpc:
        sections.append(("rpc", run_rpc))
    if not args.skip_hetero:
        sections.append(("hetero", run_hetero))
    if args.imported_hf_vit:
        from bench._imported_vit import run_imported  # transformers only when asked

        sections.append(("imported", run_imported))
    for _, section in sections:
        section_keys, section_ok = section(args, spec, warmup, batches)
        keys.update(section_keys)
        ok = ok and section_ok
    keys["loadavg_end"] = loadavg()  # other work on this machine skews every number
    return summary(BENCH, sections=[name for name, _ in sections], ok=ok, **keys)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.skip_rpc and args.skip_hetero and not args.imported_hf_vit:
        parser.error("--skip-rpc and --skip-hetero leave nothing to run")
    _apply_quick(args)
    configure_logging(level="warning")  # zpipe's logs to stderr: stdout is for JSON lines
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(max(1, int(args.timeout)))
    started = time.perf_counter()
    try:
        result = run(args)
    finally:
        signal.alarm(0)
    print(f"  done in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
