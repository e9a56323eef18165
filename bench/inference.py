"""Inference throughput of zpipe: against a PipeEdge-style torch.distributed.rpc
pipeline (on a ViT and on a small MLP), and PipeEdge's plan against the even
partition on a heterogeneous cluster.

The ``rpc`` and ``hetero`` sections run one ViT-Base-style model (``vit-base`` with fewer blocks, so
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

2. ``hetero`` (``--skip-hetero`` leaves it out): PipeEdge's plan against the even
   partition, measured in the same run. A LocalCluster of three devices, ``fast``
   (1x, 800 Mbit/s), ``slow`` (4x slower, 400 Mbit/s) and ``mid`` (1.5x slower,
   200 Mbit/s), their slowdowns all multiplied by one factor
   (``--hetero-slowdown-scale``; by default the least at which the three devices,
   busy at once, use at most half this machine's cores: 2 on two cores;
   ``HOST_CORE_SHARE`` in ``bench/_inference_common.py`` says why), runs the model
   with ``planner="pipeedge"`` (the coordinator's default: every stage profiles
   the model itself, all at once, and the PipeEdge DP picks the devices, their
   order and the split) and with ``planner="even"`` (GPipe's partition over the
   devices in the given order), with at most ``--hetero-max-in-flight``
   micro-batches in flight. One warm-up run per planner keeps profiling and shard
   building out of the timed runs. The even run carries no prediction (the
   coordinator plans it without profiles), so its prediction is that of the
   pipeedge run's ``RunReport.baseline``: the even partition over the same
   devices, predicted from the same profiles; the bench checks that the two
   partitions are the same (``hetero_even_is_baseline``). One JSON line per
   planner gives the plan, the measured and predicted throughput and, per stage,
   the predicted compute and send time of a micro-batch beside the measured
   ``busy_s`` and ``send_s`` per micro-batch, and the utilisation. Summary keys:
   ``ratio_vs_even`` (measured pipeedge / measured even),
   ``predicted_ratio_vs_even``, ``measured_over_predicted`` (measured pipeedge /
   its plan's ``throughput_samples_per_s``), ``even_measured_over_predicted``, the
   same three over the steady state (``steady_*``: the micro-batches after the
   first result over the time from the first result to the last, i.e. without the
   pipeline's fill, which the cost model's ``b / bottleneck`` leaves out) and the
   other ``hetero_*`` keys.

3. ``small`` (``--skip-small`` leaves it out): zpipe against torch RPC where the
   runtimes' own per-message cost decides. The ``rpc`` section's comparison (the
   same code) on its own model and data: ``mlp-small`` (784-512-256-128-10; a
   forward of one sample takes tens of microseconds) split evenly over 3 equal
   devices at full speed (slowdown 1, no link emulation), ``--small-batches``
   (400) seeded batches of ``--small-batch-size`` (8) samples sent as
   micro-batches of one, after a tenth as many warm-up batches. Fair by
   construction: both systems run the same partition (zpipe's even plan, handed
   to the RPC stages), the same torch threads per stage (``cores // 3``, at least
   1), one process per stage plus one driver (zpipe's client, in the same
   process as the RPC driver; zpipe also has its coordinator, whose CPU it is
   charged), the same bound on micro-batches in flight, each bound of
   ``--small-max-in-flight`` (12, the headline, at which neither system is
   starved: both were slower at 4 and neither faster at 24 on two cores; and 4,
   about one micro-batch per stage and link, as the bound changes zpipe's
   figure), and
   ``--small-repeats`` (3) timed runs per system and bound, alternating which
   system goes first; medians are reported. CPU per sample counts every process
   of a system, from /proc, over the streaming part of its run. The outputs of
   the first batch are compared between the systems and with the whole model run
   in one process. The section runs in a process of its own (torch RPC does not
   start twice in one process). Summary keys: ``small_model_ratio_vs_torch_rpc``
   (zpipe samples/s / torch RPC samples/s at the first bound),
   ``small_zpipe_samples_per_s``, ``small_torch_rpc_samples_per_s``,
   ``small_zpipe_cpu_ms_per_sample``, ``small_torch_rpc_cpu_ms_per_sample``,
   ``small_outputs_match`` (at every bound), ``small_by_max_in_flight`` (these
   figures per bound), the model and settings (``small_model``, ``small_dims``,
   ``small_partition``, ...).

4. ``imported`` (only with ``--imported-hf-vit``; needs transformers): real
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
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from bench._common import loadavg, on_alarm, summary
from bench._inference_common import (
    BENCH,
    VIT_PRESETS,
    _make_batches,
)
from bench._inference_hetero import run_hetero
from bench._inference_rpc import run_rpc
from bench._inference_small import add_small_arguments, apply_small_quick, run_small
from zpipe.cli.common import positive_float, positive_int
from zpipe.log import configure_logging
from zpipe.models import ModelSpec


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
    add_small_arguments(parser)
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
        apply_small_quick(args)


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
    if not args.skip_small:
        sections.append(("small", run_small))
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
    if args.skip_rpc and args.skip_hetero and args.skip_small and not args.imported_hf_vit:
        parser.error("--skip-rpc, --skip-hetero and --skip-small leave nothing to run")
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
