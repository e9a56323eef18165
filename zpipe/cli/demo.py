"""``python -m zpipe demo``: a heterogeneous pipeline on this machine, end to end.

Starts a coordinator and stage processes that play devices of different speeds
and link bandwidths, streams inputs through a ViT-style model, and prints the
partition, throughput, where each stage's time went, and whether the outputs
equal a single-process run of the same model.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from zpipe.cli.common import DeprecatedAlias, non_negative_int, positive_int
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.models import ModelSpec, available_presets, build_full_model, load_layer_sequence
from zpipe.planner import Plan
from zpipe.progress import ResultBar, TerminalProgress

DEMO_TRACE = "zpipe-demo-trace.json"

# Phones, boards and laptops on Wi-Fi: slower compute and slower links.
DEMO_DEVICES = (
    DeviceSpec("laptop", slowdown=1.0, bandwidth_mbps=800.0, latency_ms=2.0),
    DeviceSpec("phone", slowdown=4.0, bandwidth_mbps=400.0, latency_ms=5.0),
    DeviceSpec("board", slowdown=1.5, bandwidth_mbps=200.0, latency_ms=5.0),
    DeviceSpec("jetson", slowdown=1.2, bandwidth_mbps=600.0, latency_ms=3.0),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m zpipe demo",
        description="Run pipelined inference of a ViT-style model across emulated heterogeneous "
        "devices on this machine and check the outputs against a single-process run.",
    )
    parser.add_argument(
        "--model",
        default="vit-base",
        choices=available_presets(),
        help="built-in model preset (default: vit-base)",
    )
    parser.add_argument(
        "--layers",
        type=positive_int,
        default=4,
        help="transformer blocks to keep, so the demo runs in about a minute on "
        "two cores (default: 4)",
    )
    parser.add_argument(
        "--local",
        "--stages",
        action=DeprecatedAlias,
        deprecated=("--stages",),
        dest="local",
        type=int,
        default=3,
        choices=range(1, len(DEMO_DEVICES) + 1),
        metavar="N",
        help=f"stage processes to start here, each an emulated device, 1-{len(DEMO_DEVICES)} "
        "(default: 3)",
    )
    parser.add_argument(
        "--batches",
        type=positive_int,
        default=8,
        help="number of input batches to stream (default: 8)",
    )
    parser.add_argument(
        "--batch-size", type=positive_int, default=8, help="samples per input batch (default: 8)"
    )
    parser.add_argument(
        "--microbatch-size",
        type=positive_int,
        default=4,
        help="samples per micro-batch; each batch is split into micro-batches (default: 4)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="compute dtype on the stages (default: float32)",
    )
    parser.add_argument(
        "--planner",
        choices=("pipeedge", "pipedream", "even"),
        default="pipeedge",
        help="how the coordinator partitions the model (default: pipeedge)",
    )
    parser.add_argument(
        "--no-compare",
        dest="compare",
        action="store_false",
        help="skip the second run on the even partition",
    )
    parser.add_argument("--seed", type=non_negative_int, default=0, help="weights and inputs seed")
    parser.add_argument(
        "--trace",
        type=Path,
        default=Path(DEMO_TRACE),
        metavar="FILE",
        help="where to write the run's per-micro-batch timeline, Chrome trace-event JSON "
        f"for https://ui.perfetto.dev or chrome://tracing (default: {DEMO_TRACE})",
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="no progress lines or bars on stderr (they show only on a terminal anyway)",
    )
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=("debug", "info", "warning", "error"),
        help="level of the stage and coordinator logs (default: warning)",
    )
    return parser


def _print_plan(plan: Plan, names: list[str]) -> None:
    # called as soon as the coordinator has planned, before the stream starts
    print(f"\nthe plan ({plan.algo}):")
    print(plan.describe(names))
    _print_prediction(plan)
    print(flush=True)


def _print_prediction(plan: Plan) -> None:
    predicted = plan.predicted.get("throughput_samples_per_s")
    if predicted is not None:
        print(
            f"  predicted {predicted:.2f} samples/s, bottleneck "
            f"{plan.predicted.get('bottleneck_s', 0.0) * 1e3:.0f} ms per micro-batch"
        )


def _stage_table(report_stages: dict[str, dict[str, Any]], plan_devices: list[str]) -> str:
    rows = [
        f"  {'stage':<8} {'busy s':>8} {'idle s':>8} {'blocked s':>9} {'link s':>8} "
        f"{'MB in':>8} {'MB out':>8} {'util':>6}"
    ]
    for name in plan_devices:
        m = report_stages.get(name, {})
        rows.append(
            f"  {name:<8} {float(m.get('busy_s', 0.0)):>8.2f} {float(m.get('idle_s', 0.0)):>8.2f} "
            f"{float(m.get('blocked_s', 0.0)):>9.2f} {float(m.get('send_s', 0.0)):>8.2f} "
            f"{m.get('bytes_in', 0) / 1e6:>8.1f} {m.get('bytes_out', 0) / 1e6:>8.1f} "
            f"{float(m.get('utilisation', 0.0)):>6.0%}"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides: dict[str, Any] = {}
    if args.model.startswith(("vit", "bert")):
        overrides["num_layers"] = args.layers
    spec = ModelSpec.preset(args.model, seed=args.seed, **overrides)
    sequence = load_layer_sequence(spec)
    devices = list(DEMO_DEVICES[: args.local])
    print(
        f"zpipe demo: {args.model} ({sequence.num_units} units) over {len(devices)} emulated "
        "devices"
    )
    for d in devices:
        print(
            f"  {d.name:<8} {d.slowdown:>4}x slower compute, {d.bandwidth_mbps:>5.0f} Mbit/s, "
            f"{d.latency_ms:g} ms link"
        )
    generator = torch.Generator().manual_seed(args.seed)
    batches = [
        sequence.example_input(
            args.batch_size, seed=int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        )
        for _ in range(args.batches)
    ]
    progress = TerminalProgress(False if args.quiet else None)
    print("starting the coordinator and stages ...", flush=True)
    total = args.batches * -(-args.batch_size // args.microbatch_size)
    names = sequence.unit_names()
    even_report = None
    with LocalCluster(devices, log_level=args.log_level, progress=progress.enabled) as cluster:
        print(
            f"each stage profiles the model, the coordinator plans with {args.planner} ...",
            flush=True,
        )
        bar = ResultBar(progress, total=total, desc="streaming")
        outputs, report = cluster.infer(
            spec,
            batches,
            microbatch_size=args.microbatch_size,
            dtype=args.dtype,
            planner=args.planner,
            progress=bar,
            on_plan=lambda plan: _print_plan(plan, names),
            phases=progress.enabled,
            trace=args.trace,
        )
        bar.close()
        if args.compare and args.planner != "even":
            print("\nthe same stream on the even partition, for comparison ...", flush=True)
            bar = ResultBar(progress, total=total, desc="streaming (even)")
            _, even_report = cluster.infer(
                spec,
                batches,
                microbatch_size=args.microbatch_size,
                dtype=args.dtype,
                planner="even",
                progress=bar,
                phases=progress.enabled,
            )
            bar.close()
    if report.baseline is not None:
        print("\nthe even partition it beat (GPipe's):")
        print(report.baseline.describe(names))
        _print_prediction(report.baseline)
    print(
        f"\nthroughput: {report.throughput:.2f} samples/s "
        f"({report.samples} samples, {report.microbatches} micro-batches in "
        f"{report.elapsed_s:.2f} s)"
    )
    if even_report is not None and even_report.throughput > 0:
        print(
            f"even partition: {even_report.throughput:.2f} samples/s measured; "
            f"{report.plan.algo} is {report.throughput / even_report.throughput:.2f}x faster"
        )
    print(
        "\nper-stage time: busy computing, idle waiting for input, blocked waiting for the "
        "sender,\nlink time spent sending (concurrent with compute), util = busy share:"
    )
    print(_stage_table(report.stages, report.plan.devices))
    print(
        f"\neach micro-batch's receive, compute and send per stage: {args.trace}\n"
        "(open it in https://ui.perfetto.dev or chrome://tracing)"
    )

    print("\nchecking against a single-process run ...", flush=True)
    reference = build_full_model(spec)
    started = time.perf_counter()
    worst = 0.0
    ok = True
    with torch.inference_mode():
        for batch, got in zip(batches, outputs, strict=False):
            expected = reference(*batch)
            for e, g in zip(expected, got, strict=False):
                worst = max(worst, float((e.float() - g.float()).abs().max()))
                tol = 1e-4 if args.dtype == "float32" else 1e-1
                ok = ok and torch.allclose(e.float(), g.float(), atol=tol, rtol=tol)
    single_s = time.perf_counter() - started
    print(
        f"  outputs {'EQUAL' if ok else 'DIFFER'} (max abs diff {worst:.2e}); "
        f"single process took {single_s:.2f} s"
    )
    return 0 if ok else 1
