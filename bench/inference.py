"""Inference throughput of zpipe against a PipeEdge-style torch.distributed.rpc pipeline.

What is measured: one ViT-Base-style model (``vit-base`` with fewer blocks, so
that the run takes minutes on two cores) is split evenly over 3 or 4 emulated
heterogeneous devices (the demo's: slower compute by a factor, slower outgoing
links in Mbit/s plus a latency), and a stream of batches is pushed through it
in micro-batches, with at most ``--max-in-flight`` micro-batches in the
pipeline. Two systems run the same partition (zpipe's even one, stages in the
device list's order) on the same emulated devices:

* ``zpipe``: a :class:`zpipe.cluster.LocalCluster` (a coordinator and one stage
  process per device, ZeroMQ over loopback TCP); throughput is
  ``RunReport.throughput`` and a stage's utilisation is the stage's own
  ``utilisation`` counter, ``busy_s / (busy_s + idle_s + blocked_s)`` of its
  compute loop from the first input on.
* ``torch_rpc``: PipeEdge's runtime over ``torch.distributed.rpc`` (TensorPipe),
  one spawned worker process per stage plus this process as the driver, stages
  chained with ``rpc_async`` (see ``bench/_torch_rpc_baseline.py``). It computes
  with the same :class:`zpipe.stage.shard.Shard` (hence the same slowdown
  emulation) and pays the same emulated link (serialisation time at the
  sender, latency in flight). Its utilisation is ``busy_s / elapsed_s``.

Both use the same number of torch threads per stage (``cores // stages``, at
least 1, what ``LocalCluster`` gives its stages). Each system first streams
``--warmup-batches`` batches (not timed), then the timed runs alternate between
the systems (``--repeats``) and the median run of each is reported. The outputs
of the first batch are compared between the systems (and with a single-process
run of the whole model). Each system's CPU seconds over the timed part of a
run (its processes and this one, from /proc) are reported too: the model's
compute is the same in both, so the difference is what the runtimes cost.

Output: one JSON line per system, then one summary line with
``ratio_vs_torch_rpc`` = zpipe samples/s / torch_rpc samples/s.

Run: ``.venv/bin/python bench/inference.py`` (a few minutes on two cores), or
``.venv/bin/python bench/inference.py --quick`` (a tiny model, well under a minute).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import FrameType
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench._common import emit, summary
from bench._torch_rpc_baseline import RpcRunResult, StageSetup, TorchRpcPipeline
from zpipe.cli_common import positive_float, positive_int
from zpipe.client import RunReport
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.demo import DEMO_DEVICES
from zpipe.log import configure_logging
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence

BENCH = "inference"
DRIVER_KEY = "client/driver"  # this process: zpipe's client, or the rpc driver
VIT_PRESETS = ("vit-tiny", "vit-base", "vit-large")
Outputs = tuple[torch.Tensor, ...]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=".venv/bin/python bench/inference.py",
        description="Pipelined inference throughput of zpipe vs a PipeEdge-style "
        "torch.distributed.rpc pipeline on the same emulated heterogeneous devices. "
        "Prints JSON lines: one per system, then a summary.",
    )
    parser.add_argument("--model", choices=VIT_PRESETS, default="vit-base",
                        help="ViT preset (default: vit-base)")
    parser.add_argument("--layers", type=positive_int, default=4,
                        help="transformer blocks to keep (default: 4)")
    parser.add_argument("--stages", type=int, choices=(3, 4), default=3,
                        help="emulated devices, the first N of the demo's (default: 3)")
    parser.add_argument("--batches", type=positive_int, default=8,
                        help="batches per timed run (default: 8)")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="(default: 8)")
    parser.add_argument("--microbatch-size", type=positive_int, default=2,
                        help="(default: 2)")
    parser.add_argument("--max-in-flight", type=positive_int, default=4,
                        help="micro-batches in the pipeline at once, both systems (default: 4)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="compute dtype on the stages (default: float32)")
    parser.add_argument("--warmup-batches", type=positive_int, default=2,
                        help="batches streamed before the timed runs (default: 2)")
    parser.add_argument("--repeats", type=positive_int, default=5,
                        help="timed runs per system, alternating; the median is reported "
                             "(default: 5)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch threads per stage, both systems (default: cores // stages, "
                             "at least 1, as LocalCluster does)")
    parser.add_argument("--rpc-transport", choices=("tcp", "auto"), default="tcp",
                        help="TensorPipe transport: 'tcp' = uv transport and basic channel, "
                             "loopback TCP as zpipe uses (default); 'auto' = TensorPipe's "
                             "choice, shared memory on one host, whose reactor thread busy-polls "
                             "(about 0.4 core per process, which slows both systems on a small "
                             "machine)")
    parser.add_argument("--no-links", action="store_true",
                        help="no link emulation (bandwidth, latency) on either system")
    parser.add_argument("--seed", type=int, default=0, help="weights and inputs seed")
    parser.add_argument("--rpc-timeout", type=positive_float, default=120.0,
                        help="torch.rpc call timeout and per-result wait, seconds (default: 120)")
    parser.add_argument("--timeout", type=positive_float, default=1200.0,
                        help="the whole benchmark gives up after this many seconds "
                             "(default: 1200)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny run: vit-tiny, 2 layers, 2 batches of 4, micro-batches of 2, "
                             "1 warm-up batch, 1 repeat")
    return parser


def _apply_quick(args: argparse.Namespace) -> None:
    if args.quick:
        args.model, args.layers, args.batches, args.batch_size = "vit-tiny", 2, 2, 4
        args.microbatch_size, args.warmup_batches, args.repeats = 2, 1, 1


def _devices(args: argparse.Namespace, threads: int) -> list[DeviceSpec]:
    devices = []
    for d in DEMO_DEVICES[: args.stages]:
        link: dict[str, Any] = {"bandwidth_mbps": d.bandwidth_mbps, "latency_ms": d.latency_ms}
        if args.no_links:
            link = {"bandwidth_mbps": None, "latency_ms": 0.0}
        devices.append(DeviceSpec(d.name, slowdown=d.slowdown, threads=threads, **link))
    return devices


def _zpipe_line(report: RunReport, runs: list[float]) -> dict[str, Any]:
    utilisation, busy_fraction, stages = {}, {}, {}
    for name in report.plan.devices:
        m = report.stages.get(name, {})
        utilisation[name] = round(float(m.get("utilisation", 0.0)), 4)
        busy = float(m.get("busy_s", 0.0))
        busy_fraction[name] = round(busy / report.elapsed_s, 4) if report.elapsed_s else 0.0
        stages[name] = {k: m.get(k) for k in ("busy_s", "idle_s", "blocked_s", "send_s",
                                              "bytes_in", "bytes_out", "microbatches")}
    return {
        "bench": BENCH, "system": "zpipe", "samples_per_s": round(report.throughput, 4),
        "samples_per_s_runs": [round(r, 4) for r in runs], "samples": report.samples,
        "microbatches": report.microbatches, "elapsed_s": round(report.elapsed_s, 4),
        "stage_utilisation": utilisation, "stage_busy_fraction": busy_fraction,
        "utilisation_definition": "busy_s / (busy_s + idle_s + blocked_s)",
        "stages": stages,
    }


def _rpc_line(result: RpcRunResult, runs: list[float], transport: str) -> dict[str, Any]:
    utilisation = {
        name: round(float(m["busy_s"]) / result.elapsed_s, 4) if result.elapsed_s else 0.0
        for name, m in result.stages.items()
    }
    return {
        "bench": BENCH, "system": "torch_rpc", "samples_per_s": round(result.throughput, 4),
        "samples_per_s_runs": [round(r, 4) for r in runs], "samples": result.samples,
        "microbatches": result.microbatches, "elapsed_s": round(result.elapsed_s, 4),
        "stage_utilisation": utilisation, "stage_busy_fraction": utilisation,
        "utilisation_definition": "busy_s / elapsed_s", "transport": transport,
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


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise TimeoutError("the benchmark ran past --timeout")


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = ModelSpec.preset(args.model, seed=args.seed, num_layers=args.layers)
    sequence = load_layer_sequence(spec)
    cores = os.cpu_count() or 1
    threads = args.threads or max(1, cores // args.stages)
    devices = _devices(args, threads)
    generator = torch.Generator().manual_seed(args.seed)

    def make_batches(count: int) -> list[Outputs]:
        return [sequence.example_input(args.batch_size, seed=int(
            torch.randint(0, 2**31 - 1, (1,), generator=generator))) for _ in range(count)]

    warmup, batches = make_batches(args.warmup_batches), make_batches(args.batches)
    # Stages in the order of the device list (by default the coordinator orders them by name).
    stream = {"microbatch_size": args.microbatch_size, "max_in_flight": args.max_in_flight}
    order = {"stage_names": [d.name for d in devices], "dtype": args.dtype}
    transports, channels = (["uv"], ["basic"]) if args.rpc_transport == "tcp" else (None, None)
    transport = "tensorpipe uv/basic (loopback TCP)" if transports else "tensorpipe auto"
    config = {
        "model": args.model, "layers": args.layers, "units": sequence.num_units,
        "batches": args.batches, "batch_size": args.batch_size,
        "microbatch_size": args.microbatch_size, "max_in_flight": args.max_in_flight,
        "dtype": args.dtype, "threads_per_stage": threads, "cores": cores,
        "repeats": args.repeats, "warmup_batches": args.warmup_batches,
        "devices": [{"name": d.name, "slowdown": d.slowdown, "bandwidth_mbps": d.bandwidth_mbps,
                     "latency_ms": d.latency_ms} for d in devices],
    }
    microbatches = args.batches * -(-args.batch_size // args.microbatch_size)
    zpipe_runs: list[tuple[float, RunReport, list[Outputs], dict[str, float]]] = []
    rpc_runs: list[tuple[RpcRunResult, dict[str, float]]] = []
    with LocalCluster(devices, log_level="warning") as cluster:
        _, warm_report = cluster.infer(spec, warmup, **order, **stream)
        plan = warm_report.plan
        partition = [[s.start, s.end] for s in plan.stages]
        by_name = {d.name: d for d in devices}
        setups = [StageSetup(s.device, s.start, s.end, by_name[s.device].slowdown,
                             by_name[s.device].bandwidth_mbps, by_name[s.device].latency_ms)
                  for s in plan.stages]
        zpipe_pids = {name: int(p.pid) for name, p in cluster.processes.items()}
        with TorchRpcPipeline(spec, setups, dtype=args.dtype, threads=threads,
                              rpc_timeout_s=args.rpc_timeout, transports=transports,
                              channels=channels) as baseline:
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
                            spec, _metered(batches, meter), progress=progress, **order, **stream
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
                    print(f"  repeat {repeat + 1}/{args.repeats} {system}: {tput:.2f} samples/s"
                          f", {meter.cpu_s.get('total', 0.0):.2f} CPU s",
                          file=sys.stderr, flush=True)

    z_tputs = [t for t, _, _, _ in zpipe_runs]
    r_tputs = [r.throughput for r, _ in rpc_runs]
    _, z_report, z_outputs, z_cpu = zpipe_runs[_median_index(z_tputs)]
    r_result, r_cpu = rpc_runs[_median_index(r_tputs)]
    z_line = {**_zpipe_line(z_report, z_tputs), "samples_per_s": round(
        statistics.median(z_tputs), 4), "cpu_s": z_cpu,
        "cpu_ms_per_sample": round(1e3 * z_cpu.get("total", 0.0) / z_report.samples, 3),
        "partition": partition, **config}
    r_line = {**_rpc_line(r_result, r_tputs, transport), "samples_per_s": round(
        statistics.median(r_tputs), 4), "cpu_s": r_cpu,
        "cpu_ms_per_sample": round(1e3 * r_cpu.get("total", 0.0) / r_result.samples, 3),
        "partition": partition, **config}
    emit(z_line)
    emit(r_line)

    tol = 1e-4 if args.dtype == "float32" else 1e-1
    first_rpc = rpc_runs[-1][0].outputs[0]
    outputs_match = _close(z_outputs[0], first_rpc, tol)
    with torch.inference_mode():
        reference = build_full_model(spec)(*batches[0])
    matches_reference = _close(z_outputs[0], reference, tol) and _close(first_rpc, reference, tol)
    ratio = z_line["samples_per_s"] / r_line["samples_per_s"] if r_line["samples_per_s"] else 0.0
    return summary(
        BENCH,
        ratio_vs_torch_rpc=round(ratio, 4),
        zpipe_samples_per_s=z_line["samples_per_s"],
        torch_rpc_samples_per_s=r_line["samples_per_s"],
        zpipe_cpu_ms_per_sample=z_line["cpu_ms_per_sample"],
        torch_rpc_cpu_ms_per_sample=r_line["cpu_ms_per_sample"],
        outputs_match=outputs_match,
        outputs_max_abs_diff=_max_abs_diff(z_outputs[0], first_rpc),
        matches_single_process=matches_reference,
        zpipe_stage_utilisation=z_line["stage_utilisation"],
        torch_rpc_stage_utilisation=r_line["stage_utilisation"],
        partition=partition,
        transport=transport,
        **config,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _apply_quick(args)
    configure_logging(level="warning")  # zpipe's logs to stderr: stdout is for JSON lines
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(max(1, int(args.timeout)))
    started = time.perf_counter()
    try:
        result = run(args)
    finally:
        signal.alarm(0)
    print(f"  done in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return 0 if result["outputs_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
