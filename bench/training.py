"""Synchronous pipeline training with zpipe: against PyTorch's own pipelining, a planned
1F1B against an even GPipe, and hybrid pipeline parallelism (Asteroid's HPP) against data
parallelism, a straight 1F1B pipeline and GPipe on emulated heterogeneous clusters.

Every run trains from the same initial weights (each stage builds its units from the
model's seed) on the same seeded mini-batches, with plain SGD (lr 0.05) and one
optimizer step per mini-batch of M micro-batches. Each section first trains on
``--warmup-steps`` mini-batches per system (not timed: stage processes import and
warm up their kernels, torch infers its stages' shapes, PipeEdge profiles), then its
timed runs alternate between the things it compares (``--repeats`` each) and the
median run of each (by steady throughput) is reported.

Throughput, two ways (both in every JSON line):

* ``steady_samples_per_s``, used for every ratio: the samples of mini-batches 2..N
  over the time from the end of mini-batch 1 to the end of mini-batch N, i.e. the
  period of a round once the pipeline runs, the first round's start-up left out. A
  mini-batch "ends" for zpipe when the client has all its losses (``on_step``), for
  torch when stage 0 has applied its optimizer step; in steady state both recur once
  per round.
* ``samples_per_s``: what each system measures over a whole run. zpipe's
  ``TrainReport.samples_per_s`` runs from the first send to the last loss, which
  leaves out the last round's backwards and optimizer steps; torch's runs between two
  barriers around all the steps, which includes them. So this one flatters zpipe a
  little (about half a round per run).

1. ``torch`` (``--skip-torch`` leaves it out): zpipe 1F1B against
   ``torch.distributed.pipelining.Schedule1F1B`` (``bench/_torch_pipelining_baseline.py``:
   one spawned process per stage, ``gloo`` on loopback TCP, ``PipelineStage`` over the
   same units ``load_layer_sequence(spec).build_units(start, end)``), on a BERT-style
   model (``bert-base`` shrunk: 4 blocks, hidden 256; 128 with ``--quick``), ``--stages``
   stages (4) on the same even split (``even_ranges``), the same M, mini-batches and
   optimizer, homogeneous (no slowdown, no link cap), ``cores // stages`` torch threads
   (at least 1) per stage process in both. zpipe's 1F1B runs with its default warm-up
   policy, ``warmup="auto"`` (:mod:`zpipe.training.warmup`): Asteroid's counts
   ``K_p = min(2 (P - p) - 1, M)``. The loss sequences of the two are compared
   (``loss_max_abs_diff``): equal losses show that the baseline does the same work.
   ``zpipe_1f1b_torch_warmups`` (``warmup="torch"``: Schedule1F1B's ``P - p``) is the
   evidence for that default, measured in the same run:
   ``ratio_vs_torch_1f1b_torch_warmups`` and ``auto_over_torch_warmups``. zpipe
   GPipe runs on the same split too, all four alternating:
   ``gpipe_over_1f1b_peak_memory_stage0`` is the ratio of stage 0's peak bytes of saved
   activations (``peak_activation_bytes``, counted by the stage) under GPipe and under
   1F1B, expected ``M / K_0``. ``predicted_over_measured_round``: the round that
   :func:`zpipe.planner.schedules.simulate` predicts for the median zpipe 1F1B run,
   over its measured steady round. The simulation gets each stage's compute per
   micro-batch from the run itself (``busy_s / microbatches``, the optimizer step
   folded in), split into forward and backward in the proportion a single-process
   profile of the stage's units (``zpipe.stage.profiling.profile_model(train=True)``, taken
   before any cluster starts) measures, and each link's transfer time from the sending
   stage's ``send_s`` per message.

2. ``hetero`` (``--skip-hetero`` leaves it out): on a LocalCluster of three emulated
   Jetson-like devices, ``nano`` (3x slower than ``nx``), ``tx2`` (1.5x) and ``nx``
   (1x), every slowdown multiplied by one factor (``--hetero-slowdown-scale``; by
   default the least at which the devices, all busy, need at most half this machine's
   cores: 2 on two cores, giving 6, 3, 2), each with a 100 Mbit/s outgoing link
   (``--bandwidth-mbps``, one link per device for both directions), a CNN whose first
   convolutions keep a 32x32 resolution (1 MB of activations per micro-batch of 4 at
   the early cuts, 84 ms at 100 Mbit/s, against 64 KB near the end): zpipe 1F1B with
   the coordinator's PipeEdge plan (no partition given: every stage profiles the
   model, the links are measured, the DP picks devices, order and split) against
   GPipe on the even partition (``even_ranges``) over the devices in the listed order.
   ``planned_1f1b_over_even_gpipe_cnn`` = steady samples/s of the first over the
   second. PipeEdge plans a training run with its inference cost model (forward times
   at the micro-batch size, activations one way: no backward, no gradients), from
   profiles the stages take at once on this shared machine, so the plan can differ from
   one run of the bench to the next; it is reported. Each run's losses are checked
   against the single-process reference for the same micro-batching (within 1e-3;
   ``hetero_*_loss_max_abs_diff_vs_reference``), not against each other: this run
   diverges and amplifies any rounding difference (see ``bench/_training_hetero.py``).

3. ``hpp`` (``--skip-hpp`` leaves it out): Asteroid's comparison. For each of two models,
   the hetero section's CNN and a BERT-style model (``bert-base`` shrunk as in the torch
   section, ``--hidden``), ONE LocalCluster of four emulated devices, fastest first:
   ``nx`` (1x), ``tx2`` (1.5x), ``nano-a`` and ``nano-b`` (3x), every slowdown scaled to
   fit the cores as in the hetero section (``--hpp-slowdown-scale``; 2.5 on two cores:
   2.5, 3.75, 7.5, 7.5), each with a ``--bandwidth-mbps`` (100) outgoing link, trains
   ``--hpp-steps`` mini-batches of ``--hpp-batch-size`` (16) samples in
   ``--hpp-microbatches`` (4) micro-batches with four plans the coordinator makes from
   the stages' training profiles and the measured links (``fit(planner=...)``):
   ``hpp`` (Asteroid's HPP DP, 1F1B), ``data_parallel`` (one group of all the devices
   worth a sample, shares by capacity, 1F1B), ``straight_1f1b`` (Eco-FL's straight
   pipeline, one device per stage, 1F1B) and ``even_gpipe`` (the even partition, GPipe).
   The straight and even plans run through the devices in the listed order, and so does
   HPP's DP (it sorts them by memory, and none declares a limit). Each system's first
   (warm-up) run pays the profiles and link probes, which the coordinator then keeps for
   the cluster's life, so every later run plans from the same numbers; the timed runs
   alternate (forward, then reversed order). ``hpp_over_best_baseline_cnn`` and
   ``hpp_over_best_baseline_bert`` = HPP's steady samples/s over the best of the other
   three. ``predicted_over_measured_round``: HPP's predicted round
   (``report.training_plan.predicted["round_s"]``, the cost model run through the
   schedule simulator) over its measured steady round, the model that misses more (the
   per-model keys ``hpp_predicted_over_measured_round_*`` hold both). Every JSON line of
   this section carries its plan (``describe`` and ``training_plan``), per stage the
   cost model's times beside every device's counters (``forward_s`` and ``backward_s``
   per micro-batch; all-reduce, step, idle and send time per round), and the plan's
   round simulated with measured and modelled parts swapped (see
   :func:`_what_if_rounds`), which tells a wrong compute or all-reduce estimate from a
   wrong schedule or link model. ``note`` puts the findings in words: whether the goals
   are met (HPP at least 1.3x the best baseline on the CNN, never below it on the
   transformer, the prediction within 20%), with the numbers and plans either way.
   Straight and even plans do the same maths, so their losses must agree; HPP and data
   parallelism split micro-batches (the CNN's BatchNorm then sees other batches), so
   theirs are reported only.

Caveats: every stage process, the coordinator, this process (zpipe's client, torch's
launcher) and whatever else runs on the machine share its cores (2 here: the torch
section's 4 one-thread stages already oversubscribe them), so throughput is CPU-bound
and noisy: compare only numbers from one run, look at the ``*_runs`` lists, and mind
the load averages in the summary. ``cpu_ms_per_sample`` is the CPU time of all of a
system's processes (this one included) over a whole call (zpipe's run set-up and
weight gathering, torch's weight reset, too). Slowdowns are emulated by sleeping in
the compute thread (``slowdown - 1`` times a step's CPU time), links by pacing sends,
not by real devices and radios.

Output: one JSON line per system (sections ``torch`` and ``hpp``, the latter's systems
prefixed with the model) or per configuration (section ``hetero``), then one summary
object: the issue's keys always (``null`` where not measured), the other keys of the
sections that ran, and ``ok`` (the losses matched). The torch section's prediction is
``zpipe_1f1b_predicted_over_measured_round`` there.

Run: ``.venv/bin/python bench/training.py`` (about 6 minutes on two cores, 3 of them
the hpp section) or ``.venv/bin/python bench/training.py --quick`` (a smaller model,
fewer steps and one repeat each: about 2 minutes, noisier).
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
from bench._training_common import BENCH, SKIPPED_HPP_NOTE, _log
from bench._training_hetero import run_hetero
from bench._training_hpp import run_hpp
from bench._training_torch import run_torch
from zpipe.cli.common import positive_float, positive_int
from zpipe.log import configure_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=".venv/bin/python bench/training.py",
        description="Synchronous pipeline training throughput of zpipe: 1F1B against "
        "torch.distributed.pipelining's Schedule1F1B on the same split, GPipe's and 1F1B's "
        "activation memory, the PipeEdge-planned 1F1B against an even GPipe, and HPP "
        "against data parallelism, a straight 1F1B and an even GPipe on emulated "
        "heterogeneous clusters. Prints JSON lines, then a summary.",
    )
    parser.add_argument(
        "--stages",
        type=int,
        choices=range(2, 9),
        default=4,
        metavar="P",
        help="torch section: pipeline stages, 2..8 (default: 4)",
    )
    parser.add_argument(
        "--hidden",
        type=positive_int,
        default=256,
        help="torch and hpp sections: the BERT-style model's hidden size (default: 256)",
    )
    parser.add_argument(
        "--microbatches",
        type=positive_int,
        default=16,
        metavar="M",
        help="torch section: micro-batches per mini-batch (default: 16)",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=32,
        help="torch section: samples per mini-batch, a multiple of M (default: 32)",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=8,
        help="torch section: mini-batches (optimizer steps) per timed run (default: 8)",
    )
    parser.add_argument(
        "--hetero-microbatches",
        type=positive_int,
        default=4,
        help="hetero section: micro-batches per mini-batch (default: 4)",
    )
    parser.add_argument(
        "--hetero-batch-size",
        type=positive_int,
        default=16,
        help="hetero section: samples per mini-batch (default: 16)",
    )
    parser.add_argument(
        "--hetero-steps",
        type=positive_int,
        default=5,
        help="hetero section: mini-batches per timed run (default: 5)",
    )
    parser.add_argument(
        "--hetero-slowdown-scale",
        type=positive_float,
        default=None,
        help="hetero section: multiply every slowdown (3, 1.5, 1) by this "
        "(default: the least multiple of 0.25, at least 1, at which the "
        "devices, all busy, need at most half the cores)",
    )
    parser.add_argument(
        "--bandwidth-mbps",
        type=positive_float,
        default=100.0,
        help="hetero section: every device's outgoing link (default: 100)",
    )
    parser.add_argument(
        "--hpp-microbatches",
        type=positive_int,
        default=4,
        help="hpp section: micro-batches per mini-batch (default: 4)",
    )
    parser.add_argument(
        "--hpp-batch-size",
        type=positive_int,
        default=16,
        help="hpp section: samples per mini-batch, at least M (default: 16)",
    )
    parser.add_argument(
        "--hpp-steps",
        type=positive_int,
        default=5,
        help="hpp section: mini-batches per timed run (default: 5)",
    )
    parser.add_argument(
        "--hpp-repeats",
        type=positive_int,
        default=3,
        help="hpp section: timed runs per system and model, alternating (default: 3)",
    )
    parser.add_argument(
        "--hpp-slowdown-scale",
        type=positive_float,
        default=None,
        help="hpp section: multiply every slowdown (1, 1.5, 3, 3) by this (default: "
        "the least multiple of 0.25, at least 1, at which the devices, all busy, need "
        "at most half the cores)",
    )
    parser.add_argument(
        "--warmup-steps",
        type=positive_int,
        default=2,
        help="mini-batches of the untimed warm-up run of each system (default: 2)",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=7,
        help="torch section: timed runs per system, alternating (default: 7)",
    )
    parser.add_argument(
        "--hetero-repeats",
        type=positive_int,
        default=3,
        help="hetero section: timed runs per configuration (default: 3)",
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch threads per stage process, every system (default: cores "
        "// stages, at least 1, as LocalCluster gives its stages)",
    )
    parser.add_argument(
        "--skip-torch",
        action="store_true",
        help="leave out the zpipe vs torch.distributed.pipelining section",
    )
    parser.add_argument(
        "--skip-hetero",
        action="store_true",
        help="leave out the planned 1F1B vs even GPipe section",
    )
    parser.add_argument(
        "--skip-hpp",
        action="store_true",
        help="leave out the HPP vs data-parallel, straight and GPipe section",
    )
    parser.add_argument("--seed", type=int, default=0, help="weights and data seed")
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=1500.0,
        help="the whole benchmark gives up after this many seconds (default: 1500)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="hidden 128, M = 8 of 16 samples, 4 steps, 1 warm-up step, one "
        "timed run per system; hetero and hpp: 4 steps, one run each",
    )
    return parser


def _apply_quick(args: argparse.Namespace) -> None:
    if args.quick:
        args.hidden, args.microbatches, args.batch_size, args.steps = 128, 8, 16, 4
        args.warmup_steps, args.repeats = 1, 1
        args.hetero_steps, args.hetero_repeats = 4, 1
        args.hpp_steps, args.hpp_repeats = 4, 1


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the sections asked for; emit and return the one summary object."""
    keys: dict[str, Any] = {
        "ratio_vs_torch_1f1b": None,
        "planned_1f1b_over_even_gpipe_cnn": None,
        "gpipe_over_1f1b_peak_memory_stage0": None,
        "hpp_over_best_baseline_cnn": None,
        "hpp_over_best_baseline_bert": None,
        "predicted_over_measured_round": None,
        "note": SKIPPED_HPP_NOTE,
        "loadavg_start": loadavg(),
    }
    sections: list[tuple[str, Callable[[argparse.Namespace], tuple[dict[str, Any], bool]]]] = []
    if not args.skip_torch:
        sections.append(("torch", run_torch))
    if not args.skip_hetero:
        sections.append(("hetero", run_hetero))
    if not args.skip_hpp:
        sections.append(("hpp", run_hpp))
    ok = True
    for _, section in sections:
        section_keys, section_ok = section(args)
        keys.update(section_keys)
        ok = ok and section_ok
    keys["loadavg_end"] = loadavg()  # other work on this machine skews every number
    return summary(BENCH, sections=[name for name, _ in sections], ok=ok, **keys)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.skip_torch and args.skip_hetero and args.skip_hpp:
        parser.error("--skip-torch, --skip-hetero and --skip-hpp leave nothing to run")
    _apply_quick(args)
    if args.batch_size % args.microbatches:
        parser.error(
            "--batch-size must be a multiple of --microbatches (torch's chunks are "
            "equal, and the losses are compared)"
        )
    if args.hetero_batch_size < args.hetero_microbatches:
        parser.error("--hetero-batch-size must be at least --hetero-microbatches")
    if args.hpp_batch_size < args.hpp_microbatches:
        parser.error("--hpp-batch-size must be at least --hpp-microbatches")
    configure_logging(level="warning")  # zpipe's logs to stderr: stdout is for JSON lines
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(max(1, int(args.timeout)))
    started = time.perf_counter()
    try:
        result = run(args)
    finally:
        signal.alarm(0)
    _log(f"  done in {time.perf_counter() - started:.1f} s")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
