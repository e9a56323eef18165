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
   policy, ``warmup="auto"`` (:mod:`zpipe.training.warmup`): the stages share this
   host's cores, so it takes torch's counts ``P - p``, as Schedule1F1B does. The loss
   sequences of the two are compared (``loss_max_abs_diff``): equal losses show that the
   baseline does the same work. ``zpipe_1f1b_asteroid_warmups`` (``warmup="asteroid"``:
   Asteroid's ``K_p = min(2 (P - p) - 1, M)``) measures what the deeper warm-up costs
   here: ``ratio_vs_torch_1f1b_asteroid_warmups`` and ``asteroid_over_auto_warmups``. zpipe
   GPipe runs on the same split too, all four alternating:
   ``gpipe_over_1f1b_peak_memory_stage0`` is the ratio of stage 0's peak bytes of saved
   activations (``peak_activation_bytes``, counted by the stage) under GPipe and under
   1F1B, expected ``M / K_0``. ``predicted_over_measured_round``: the round that
   :func:`zpipe.training.schedules.simulate` predicts for the median zpipe 1F1B run,
   over its measured steady round. The simulation gets each stage's compute per
   micro-batch from the run itself (``busy_s / microbatches``, the optimizer step
   folded in), split into forward and backward in the proportion a single-process
   profile of the stage's units (``zpipe.profiler.profile_model(train=True)``, taken
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
   one run of the bench to the next; it is reported. The losses of the two runs are
   compared as a check (different splits, the same maths).

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
import dataclasses
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench._common import emit, loadavg, on_alarm, summary
from bench._torch_pipelining_baseline import TorchPipeline, TorchRun, make_batches
from zpipe.cli_common import positive_float, positive_int
from zpipe.client import TrainReport
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.config import Timeouts
from zpipe.log import configure_logging
from zpipe.models import ModelSpec, load_layer_sequence
from zpipe.planner import even_ranges
from zpipe.planner.profile import ModelProfile
from zpipe.profiler import profile_model
from zpipe.training.schedules import pipeline_actions, simulate
from zpipe.training.warmup import resolve_warmup_policy, warmup_counts

BENCH = "training"
OPTIMIZER: dict[str, Any] = {"name": "sgd", "lr": 0.05}
SKIPPED_HPP_NOTE = (
    "the hpp section did not run (--skip-hpp): hpp_over_best_baseline_* and "
    "predicted_over_measured_round are null"
)

# Jetson Nano : TX2 : Xavier NX, roughly (Asteroid's and Eco-FL's testbeds): slowdowns
# relative to the fastest, before the scale that fits them on this machine's cores.
HETERO_DEVICES = (("nano", 3.0), ("tx2", 1.5), ("nx", 1.0))
# A device with slowdown s computes 1/s of its busy time and sleeps the rest, so stages
# that are all busy need sum(threads / s) cores. Past about half the cores the stages
# wait for a core, and the emulation stretches that wait s times over: the devices stop
# being independent. Every slowdown is scaled up (their ratios kept) until they fit.
HOST_CORE_SHARE = 0.5

# A CNN whose early layers keep the full 32x32 resolution: large activations at early
# cuts (1 MB for a micro-batch of 4), small ones late (64 KB after the last pool).
HETERO_CNN: dict[str, Any] = {
    "channels": [64, 64, 128, 128, 256, 256],
    "pool": [False, False, True, False, True, True],
    "image_size": 32,
    "in_channels": 3,
    "num_classes": 10,
}


def _bert_spec(hidden: int, seed: int) -> ModelSpec:
    """BERT-Base's shape, shrunk to run in seconds on two cores."""
    return ModelSpec.preset(
        "bert-base",
        seed=seed,
        num_layers=4,
        hidden=hidden,
        heads=4,
        mlp=4 * hidden,
        vocab_size=1000,
        seq_len=64,
        max_positions=64,
    )


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


# ------------------------------------------------------------------------------ helpers


@dataclass
class TimedRun:
    """One timed run of one system: its clock, its losses, and where each step ended."""

    system: str
    samples: int
    elapsed_s: float  # as the system itself measures a run (see the module docstring)
    step_ends: list[float]  # perf_counter when each mini-batch ended
    losses: list[float]
    report: TrainReport | None = None
    torch_run: TorchRun | None = None
    # CPU seconds of all the system's processes (this one included) over the whole call:
    # zpipe's run set-up and weight gathering, torch's weight reset and batch making too
    cpu_s: float | None = None

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def period_s(self) -> float | None:
        """Seconds per round once the pipeline runs: between the first and last step ends."""
        if len(self.step_ends) < 2:
            return None
        return (self.step_ends[-1] - self.step_ends[0]) / (len(self.step_ends) - 1)

    @property
    def steady_samples_per_s(self) -> float | None:
        period = self.period_s
        if not period or not self.step_ends:
            return None
        return self.samples / len(self.step_ends) / period


class _PatientCluster(LocalCluster):
    """A LocalCluster whose client waits longer for control replies.

    LocalCluster's client asks the coordinator for the cluster's state with the default
    10 s reply timeout and gives up on the first miss, even within ``start_timeout_s``;
    a coordinator that imports torch on a loaded 2-core machine can take longer.
    """

    @property
    def timeouts(self) -> Timeouts:
        return dataclasses.replace(super().timeouts, reply_s=60.0)


def _cluster(devices: Sequence[DeviceSpec]) -> LocalCluster:
    # Heartbeats every second, suspect after 5 missed: a stage that waits for a core on a
    # loaded machine must not be declared dead in the middle of a run.
    return _PatientCluster(
        list(devices),
        heartbeat_interval_s=1.0,
        suspect_after=5,
        log_level="warning",
        start_timeout_s=180.0,
    )


def _zpipe_run(
    cluster: LocalCluster,
    system: str,
    spec: ModelSpec,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    **fit: Any,
) -> TimedRun:
    ends: list[float] = []

    def on_step(step: int, loss: float) -> None:
        ends.append(time.perf_counter())

    pids = [p.pid for p in cluster.processes.values()] + [os.getpid()]
    cpu = _cpu_seconds(pids)
    report = cluster.fit(spec, batches, optimizer=OPTIMIZER, progress=False, on_step=on_step, **fit)
    cpu = _cpu_seconds(pids) - cpu
    return TimedRun(
        system,
        report.samples,
        report.elapsed_s,
        ends,
        list(report.losses),
        report=report,
        cpu_s=cpu,
    )


def _torch_run(pipe: TorchPipeline, system: str, **train: Any) -> TimedRun:
    pids = [*pipe.pids, os.getpid()]
    cpu = _cpu_seconds(pids)
    run = pipe.train(optimizer=OPTIMIZER, **train)
    cpu = _cpu_seconds(pids) - cpu
    return TimedRun(
        system, run.samples, run.elapsed_s, run.step_ends_s, run.losses, torch_run=run, cpu_s=cpu
    )


def _cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (Linux /proc; 0 for what is unreadable)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def _median_run(runs: list[TimedRun]) -> TimedRun:
    """The run with the median steady throughput (the lower middle one of an even count)."""
    keyed = sorted(runs, key=lambda r: r.steady_samples_per_s or 0.0)
    return keyed[(len(keyed) - 1) // 2]


def _max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float | None:
    if len(a) != len(b) or not a:
        return None
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def _round(x: float | None, digits: int = 4) -> float | None:
    return round(x, digits) if x is not None else None


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _warmups(schedule: str, num_stages: int, m: int) -> list[int]:
    """The warm-ups a run gets when it names none (what the coordinator fills in): every
    stage of these clusters runs on this host, so "auto" takes torch's counts."""
    if schedule == "gpipe":
        return [m] * num_stages
    policy = resolve_warmup_policy("auto", stages_share_cores=True)
    return warmup_counts(policy, num_stages, m)


def _profile(spec: ModelSpec, microbatch_size: int, threads: int) -> ModelProfile:
    """Forward and backward time of every unit at the micro-batch size, in this process."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return profile_model(spec, batch_sizes=[microbatch_size], warmup=2, repeats=5, train=True)
    finally:
        torch.set_num_threads(previous)


def _stage_rows(report: TrainReport) -> list[dict[str, Any]]:
    """Per stage of the plan: its units and counters."""
    rows = []
    for i, stage in enumerate(report.plan.stages):
        m = report.stages.get(stage.device, {})
        rows.append(
            {
                "stage": i,
                "device": stage.device,
                "units": [stage.start, stage.end],
                "microbatches": int(m.get("microbatches") or 0),
                "busy_s": _round(float(m.get("busy_s", 0.0))),
                "idle_s": _round(float(m.get("idle_s", 0.0))),
                "send_s": _round(float(m.get("send_s", 0.0))),
                "bytes_out": int(m.get("bytes_out") or 0),
                "peak_live_activations": int(m.get("peak_live_activations") or 0),
                "peak_activation_bytes": int(m.get("peak_activation_bytes") or 0),
            }
        )
    return rows


def _predict_round(
    report: TrainReport,
    profile: ModelProfile,
    microbatch_size: int,
    warmups: list[int],
    link_s: Callable[[int, list[dict[str, Any]]], tuple[list[float], list[float]]],
) -> dict[str, Any]:
    """``simulate``'s round for this run's plan, schedule and measured per-stage compute."""
    rows = _stage_rows(report)
    num_stages, m = len(rows), report.num_microbatches
    forward, backward = [], []
    unit_f = profile.times(microbatch_size)
    unit_b = profile.backward_times(microbatch_size)
    for row in rows:
        start, end = row["units"]
        per_mb = float(row["busy_s"]) / row["microbatches"] if row["microbatches"] else 0.0
        f, b = sum(unit_f[start:end]), sum(unit_b[start:end])
        share = f / (f + b) if f + b > 0 else 1.0 / 3.0
        forward.append(per_mb * share)
        backward.append(per_mb * (1.0 - share))
    send_f, send_b = link_s(m, rows)
    actions = pipeline_actions(
        report.schedule, num_stages=num_stages, num_microbatches=m, warmups=warmups
    )
    result = simulate(actions, forward, backward, send_f, send_b)
    return {
        "predicted_round_s": round(result.round_s, 5),
        "forward_s": [round(x, 5) for x in forward],
        "backward_s": [round(x, 5) for x in backward],
        "send_forward_s": [round(x, 5) for x in send_f],
        "send_backward_s": [round(x, 5) for x in send_b],
        "warmups": warmups,
        "predicted_bubble_fraction": round(result.bubble_fraction, 4),
    }


def _measured_link_s(m: int, rows: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """Per link, each sender's ``send_s`` per message (no emulated link: loopback)."""
    per_message = []
    for i, row in enumerate(rows):
        # per micro-batch: its activations (or, from the last stage, its loss) and,
        # from every stage but the first, its gradient
        messages = row["microbatches"] * (1 if i == 0 else 2)
        per_message.append(float(row["send_s"]) / messages if messages else 0.0)
    return per_message[:-1], per_message[1:]


def _run_line(
    section: str, system: str, runs: list[TimedRun], median: TimedRun, **extra: Any
) -> dict[str, Any]:
    return {
        "bench": BENCH,
        "section": section,
        "system": system,
        "steady_samples_per_s": _round(median.steady_samples_per_s),
        "steady_samples_per_s_runs": [_round(r.steady_samples_per_s) for r in runs],
        "samples_per_s": _round(median.samples_per_s),
        "samples_per_s_runs": [_round(r.samples_per_s) for r in runs],
        "round_s": _round(median.period_s, 5),
        "elapsed_s": _round(median.elapsed_s),
        "cpu_ms_per_sample": _round(1e3 * median.cpu_s / median.samples, 3)
        if median.cpu_s is not None and median.samples
        else None,
        "cpu_ms_per_sample_runs": [
            _round(1e3 * r.cpu_s / r.samples, 3) if r.cpu_s is not None and r.samples else None
            for r in runs
        ],
        "samples": median.samples,
        "steps": len(median.step_ends),
        "losses": [round(x, 6) for x in median.losses],
        **extra,
    }


# ------------------------------------------------------------------------ torch section

TORCH_SYSTEMS = ("zpipe_1f1b", "torch_1f1b", "zpipe_gpipe", "zpipe_1f1b_asteroid_warmups")


def run_torch(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    """zpipe 1F1B vs torch's Schedule1F1B, and zpipe GPipe's memory: summary keys, ok."""
    spec = _bert_spec(args.hidden, args.seed)
    num_units = load_layer_sequence(spec).num_units
    p, m = args.stages, args.microbatches
    ranges = even_ranges(num_units, p)
    partition = [list(r) for r in ranges]
    cores = os.cpu_count() or 1
    threads = args.threads or max(1, cores // p)
    microbatch_size = args.batch_size // m
    torch_warmups = [min(m, p - i) for i in range(p)]  # Schedule1F1B's warm-up
    warmups = {
        "zpipe_1f1b": _warmups("1f1b", p, m),
        "torch_1f1b": torch_warmups,
        "zpipe_gpipe": _warmups("gpipe", p, m),
        "zpipe_1f1b_asteroid_warmups": warmup_counts("asteroid", p, m),
    }
    zpipe_fits: dict[str, dict[str, Any]] = {
        "zpipe_1f1b": {"schedule": "1f1b"},
        "zpipe_gpipe": {"schedule": "gpipe"},
        "zpipe_1f1b_asteroid_warmups": {"schedule": "1f1b", "warmup": "asteroid"},
    }
    warm = make_batches(spec, args.warmup_steps, args.batch_size, args.seed + 1)
    batches = make_batches(spec, args.steps, args.batch_size, args.seed)
    _log(
        f"torch section: {p} stages {partition}, M = {m}, {args.batch_size} samples per "
        f"mini-batch, {threads} thread(s) per stage; profiling the units"
    )
    profile = _profile(spec, microbatch_size, threads)  # before any stage process runs
    devices = [DeviceSpec(f"s{i}", threads=threads) for i in range(p)]
    runs: dict[str, list[TimedRun]] = {s: [] for s in TORCH_SYSTEMS}
    started = time.perf_counter()
    with _cluster(devices) as cluster:
        # After the cluster: both starting at once can starve its coordinator of CPU.
        with TorchPipeline(spec, ranges, threads=threads) as pipe:
            _log(f"  started in {time.perf_counter() - started:.1f} s")

            def once(system: str, data: list[Any], steps: int, seed: int) -> TimedRun:
                if system == "torch_1f1b":
                    return _torch_run(
                        pipe,
                        system,
                        schedule="1f1b",
                        num_microbatches=m,
                        batch_size=args.batch_size,
                        batches=steps,
                        seed=seed,
                    )
                return _zpipe_run(
                    cluster,
                    system,
                    spec,
                    data,
                    num_microbatches=m,
                    partition=partition,
                    **zpipe_fits[system],
                )

            for system in TORCH_SYSTEMS:
                t0 = time.perf_counter()
                once(system, warm, args.warmup_steps, args.seed + 1)
                _log(f"  warm-up {system}: {time.perf_counter() - t0:.1f} s")
            for repeat in range(args.repeats):
                order = TORCH_SYSTEMS if repeat % 2 == 0 else TORCH_SYSTEMS[::-1]
                for system in order:
                    result = once(system, batches, args.steps, args.seed)
                    runs[system].append(result)
                    _log(
                        f"  repeat {repeat + 1}/{args.repeats} {system}: steady "
                        f"{result.steady_samples_per_s or 0:.2f} samples/s, whole run "
                        f"{result.samples_per_s:.2f}"
                    )

    medians = {s: _median_run(runs[s]) for s in TORCH_SYSTEMS}
    z1, tt, zg = medians["zpipe_1f1b"], medians["torch_1f1b"], medians["zpipe_gpipe"]
    zk = medians["zpipe_1f1b_asteroid_warmups"]
    assert z1.report is not None and zg.report is not None
    # Every run trains the same weights on the same data: one loss sequence for all.
    loss_diff = max(
        (d for r in runs["torch_1f1b"] if (d := _max_abs_diff(z1.losses, r.losses)) is not None),
        default=None,
    )
    zpipe_loss_diff = max(
        (
            d
            for s in zpipe_fits
            for r in runs[s]
            if (d := _max_abs_diff(z1.losses, r.losses)) is not None
        ),
        default=None,
    )
    losses_match = loss_diff is not None and loss_diff < 1e-4
    prediction = _predict_round(
        z1.report, profile, microbatch_size, warmups["zpipe_1f1b"], _measured_link_s
    )
    predicted_over_measured = _ratio(prediction["predicted_round_s"], z1.period_s)
    config = {
        "torch_model": "bert-base shrunk",
        "torch_model_config": dict(spec.config),
        "torch_units": num_units,
        "torch_stages": p,
        "torch_partition": partition,
        "torch_microbatches": m,
        "torch_batch_size": args.batch_size,
        "torch_steps": args.steps,
        "torch_repeats": args.repeats,
        "torch_threads_per_stage": threads,
        "cores": cores,
        "optimizer": OPTIMIZER,
    }
    rows: dict[str, list[dict[str, Any]]] = {}
    for system in TORCH_SYSTEMS:
        median = medians[system]
        extra: dict[str, Any] = {"warmups": warmups[system]}
        if median.report is not None:
            rows[system] = extra["stages"] = _stage_rows(median.report)
        if median.torch_run is not None:
            extra["stage_step_busy_s"] = [_round(b) for b in median.torch_run.busy_s]
        if system == "zpipe_1f1b":
            extra["prediction"] = prediction
        emit(_run_line("torch", system, runs[system], median, **extra, **config))

    peak_1f1b = rows["zpipe_1f1b"][0]["peak_activation_bytes"]
    peak_gpipe = rows["zpipe_gpipe"][0]["peak_activation_bytes"]
    keys = {
        "ratio_vs_torch_1f1b": _ratio(z1.steady_samples_per_s, tt.steady_samples_per_s),
        "ratio_vs_torch_1f1b_whole_run": _ratio(z1.samples_per_s, tt.samples_per_s),
        "ratio_vs_torch_1f1b_asteroid_warmups": _ratio(
            zk.steady_samples_per_s, tt.steady_samples_per_s
        ),
        "asteroid_over_auto_warmups": _ratio(zk.steady_samples_per_s, z1.steady_samples_per_s),
        "zpipe_1f1b_steady_samples_per_s": _round(z1.steady_samples_per_s),
        "torch_1f1b_steady_samples_per_s": _round(tt.steady_samples_per_s),
        "zpipe_gpipe_steady_samples_per_s": _round(zg.steady_samples_per_s),
        "zpipe_1f1b_asteroid_warmups_steady_samples_per_s": _round(zk.steady_samples_per_s),
        "zpipe_1f1b_over_gpipe": _ratio(z1.steady_samples_per_s, zg.steady_samples_per_s),
        "loss_max_abs_diff": loss_diff,
        "losses_match_torch": losses_match,
        "zpipe_schedules_loss_max_abs_diff": zpipe_loss_diff,
        "gpipe_over_1f1b_peak_memory_stage0": _ratio(peak_gpipe, peak_1f1b),
        "expected_gpipe_over_1f1b_peak_memory_stage0": round(m / warmups["zpipe_1f1b"][0], 4),
        "warmups_1f1b": warmups["zpipe_1f1b"],
        "peak_activation_bytes_1f1b": [r["peak_activation_bytes"] for r in rows["zpipe_1f1b"]],
        "peak_activation_bytes_gpipe": [r["peak_activation_bytes"] for r in rows["zpipe_gpipe"]],
        "peak_live_activations_1f1b": [r["peak_live_activations"] for r in rows["zpipe_1f1b"]],
        "peak_live_activations_gpipe": [r["peak_live_activations"] for r in rows["zpipe_gpipe"]],
        "zpipe_1f1b_predicted_over_measured_round": predicted_over_measured,
        "predicted_round_s": prediction["predicted_round_s"],
        "measured_round_s": _round(z1.period_s, 5),
        **config,
    }
    return keys, losses_match


# ----------------------------------------------------------------------- hetero section

HETERO_SYSTEMS = ("planned_1f1b", "even_gpipe")


def _auto_slowdown_scale(
    threads: int, cores: int, devices: Sequence[tuple[str, float]] = HETERO_DEVICES
) -> float:
    """The least multiple of 0.25 (at least 1) that keeps the devices within their share."""
    demand = sum(threads / s for _, s in devices)
    return max(1.0, math.ceil(4.0 * demand / (HOST_CORE_SHARE * cores)) / 4.0)


def _modelled_link_s(
    profile: ModelProfile, microbatch_size: int, bandwidth_mbps: float
) -> Callable[[int, list[dict[str, Any]]], tuple[list[float], list[float]]]:
    """Per link: a stage boundary's activation (and, back, its gradient) over the link."""
    out = profile.output_bytes(microbatch_size)

    def link_s(m: int, rows: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
        times = [out[row["units"][1] - 1] * 8.0 / (bandwidth_mbps * 1e6) for row in rows[:-1]]
        return times, list(times)

    return link_s


def run_hetero(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    """PipeEdge-planned 1F1B vs even GPipe on emulated Jetsons: summary keys, ok."""
    spec = ModelSpec("cnn", HETERO_CNN, seed=args.seed)
    num_units = load_layer_sequence(spec).num_units
    m = args.hetero_microbatches
    cores = os.cpu_count() or 1
    threads = args.threads or max(1, cores // len(HETERO_DEVICES))
    scale = args.hetero_slowdown_scale or _auto_slowdown_scale(threads, cores)
    devices = [
        DeviceSpec(name, slowdown=s * scale, bandwidth_mbps=args.bandwidth_mbps, threads=threads)
        for name, s in HETERO_DEVICES
    ]
    even = [list(r) for r in even_ranges(num_units, len(devices))]
    microbatch_size = math.ceil(args.hetero_batch_size / m)
    warm = make_batches(spec, args.warmup_steps, args.hetero_batch_size, args.seed + 1)
    batches = make_batches(spec, args.hetero_steps, args.hetero_batch_size, args.seed)
    _log(
        f"hetero section: slowdowns x{scale:g} "
        f"({', '.join(f'{d.name} {d.slowdown:g}' for d in devices)}), "
        f"{args.bandwidth_mbps:g} Mbit/s, M = {m}, even partition {even}; profiling"
    )
    profile = _profile(spec, microbatch_size, threads)
    fits: dict[str, dict[str, Any]] = {
        "planned_1f1b": {"schedule": "1f1b", "num_microbatches": m, "planner": "pipeedge"},
        "even_gpipe": {"schedule": "gpipe", "num_microbatches": m, "partition": even},
    }
    runs: dict[str, list[TimedRun]] = {s: [] for s in HETERO_SYSTEMS}
    plans: dict[str, list[list[Any]]] = {}
    plan_changed = False
    started = time.perf_counter()
    with _cluster(devices) as cluster:
        _log(f"  started in {time.perf_counter() - started:.1f} s")
        for system in HETERO_SYSTEMS:  # profiling and link probes (planned), kernels
            t0 = time.perf_counter()
            warm_run = _zpipe_run(cluster, system, spec, warm, **fits[system])
            assert warm_run.report is not None
            plans[system] = warm_run.report.plan.to_dict()["stages"]
            _log(f"  warm-up {system}: {time.perf_counter() - t0:.1f} s, plan {plans[system]}")
        for repeat in range(args.hetero_repeats):
            order = HETERO_SYSTEMS if repeat % 2 == 0 else HETERO_SYSTEMS[::-1]
            for system in order:
                result = _zpipe_run(cluster, system, spec, batches, **fits[system])
                assert result.report is not None
                if result.report.plan.to_dict()["stages"] != plans[system]:
                    plan_changed = True
                runs[system].append(result)
                _log(
                    f"  repeat {repeat + 1}/{args.hetero_repeats} {system}: steady "
                    f"{result.steady_samples_per_s or 0:.2f} samples/s, whole run "
                    f"{result.samples_per_s:.2f}, plan {result.report.plan.to_dict()['stages']}"
                )

    medians = {s: _median_run(runs[s]) for s in HETERO_SYSTEMS}
    link_s = _modelled_link_s(profile, microbatch_size, args.bandwidth_mbps)
    config = {
        "hetero_model": "cnn",
        "hetero_model_config": HETERO_CNN,
        "hetero_units": num_units,
        "hetero_microbatches": m,
        "hetero_batch_size": args.hetero_batch_size,
        "hetero_steps": args.hetero_steps,
        "hetero_repeats": args.hetero_repeats,
        "hetero_devices": [
            {"name": d.name, "slowdown": d.slowdown, "bandwidth_mbps": d.bandwidth_mbps}
            for d in devices
        ],
        "hetero_slowdown_scale": scale,
        "hetero_threads_per_stage": threads,
    }
    predictions = {}
    for system in HETERO_SYSTEMS:
        report = medians[system].report
        assert report is not None
        warmups = _warmups(fits[system]["schedule"], len(report.plan.stages), m)
        predictions[system] = _predict_round(report, profile, microbatch_size, warmups, link_s)
        emit(
            _run_line(
                "hetero",
                system,
                runs[system],
                medians[system],
                plan=report.plan.to_dict(),
                stages=_stage_rows(report),
                prediction=predictions[system],
                predicted_over_measured_round=_ratio(
                    predictions[system]["predicted_round_s"], medians[system].period_s
                ),
                **config,
            )
        )
    planned, baseline = medians["planned_1f1b"], medians["even_gpipe"]
    loss_diff = _max_abs_diff(planned.losses, baseline.losses)
    losses_match = loss_diff is not None and loss_diff < 1e-3
    keys = {
        "planned_1f1b_over_even_gpipe_cnn": _ratio(
            planned.steady_samples_per_s, baseline.steady_samples_per_s
        ),
        "planned_1f1b_over_even_gpipe_cnn_whole_run": _ratio(
            planned.samples_per_s, baseline.samples_per_s
        ),
        "hetero_planned_1f1b_steady_samples_per_s": _round(planned.steady_samples_per_s),
        "hetero_even_gpipe_steady_samples_per_s": _round(baseline.steady_samples_per_s),
        "hetero_planned_1f1b_samples_per_s": _round(planned.samples_per_s),
        "hetero_even_gpipe_samples_per_s": _round(baseline.samples_per_s),
        "hetero_planned_plan": plans["planned_1f1b"],
        "hetero_even_plan": plans["even_gpipe"],
        "hetero_plan_changed_between_runs": plan_changed,
        "hetero_planned_predicted_over_measured_round": _ratio(
            predictions["planned_1f1b"]["predicted_round_s"], planned.period_s
        ),
        "hetero_even_predicted_over_measured_round": _ratio(
            predictions["even_gpipe"]["predicted_round_s"], baseline.period_s
        ),
        "hetero_loss_max_abs_diff": loss_diff,
        "hetero_losses_match": losses_match,
        **config,
    }
    return keys, losses_match


# -------------------------------------------------------------------------- hpp section

# Four emulated devices, fastest first (Jetson Xavier NX, TX2 and two Nanos, before the
# scale that fits them on this machine's cores). The straight and even plans run through
# them in this order, and so does HPP's DP: it takes the devices in memory order, and
# none declares a memory limit (the models need a few MB), so the listed order stands.
# Fastest first is also the order Eco-FL's order search picks for the CNN's straight
# pipeline, so the straight baseline is not handicapped by it.
HPP_DEVICES = (("nx", 1.0), ("tx2", 1.5), ("nano-a", 3.0), ("nano-b", 3.0))
HPP_SYSTEMS = ("hpp", "data_parallel", "straight_1f1b", "even_gpipe")
HPP_BASELINES = HPP_SYSTEMS[1:]
HPP_FITS: dict[str, dict[str, Any]] = {
    "hpp": {"planner": "hpp", "schedule": "1f1b"},
    "data_parallel": {"planner": "data-parallel", "schedule": "1f1b"},
    "straight_1f1b": {"planner": "straight", "schedule": "1f1b"},
    "even_gpipe": {"planner": "even", "schedule": "gpipe"},
}
# The goals, reported next to the numbers (never used to tune the experiment).
HPP_GOAL_CNN = 1.3
HPP_GOAL_BERT = 1.0
PREDICTION_TOLERANCE = 0.2


def _per(counters: dict[str, Any], key: str, count: int) -> float | None:
    value = counters.get(key)
    return _round(float(value) / count, 5) if value is not None and count else None


def _group_rows(report: TrainReport) -> list[dict[str, Any]]:
    """Per stage of the training plan: the cost model's times beside each device's counters.

    Compute is per micro-batch the device ran (``forward_s`` per forward, ``backward_s``
    per backward: what the device itself computed, its emulated slowdown included);
    all-reduce, optimizer step, idle and send time are per round.
    """
    tplan = report.training_plan
    assert tplan is not None
    pred = tplan.predicted
    steps = report.steps
    rows = []
    for i, stage in enumerate(tplan.stages):
        devices = []
        for name, share in zip(stage.devices, stage.shares, strict=True):
            c = dict(report.stages.get(name) or {})
            forwards, backwards = int(c.get("microbatches") or 0), int(c.get("backwards") or 0)
            devices.append(
                {
                    "device": name,
                    "share": share,
                    "forwards": forwards,
                    "backwards": backwards,
                    "forward_s": _per(c, "forward_s", forwards),
                    "backward_s": _per(c, "backward_s", backwards),
                    "allreduce_s_per_round": _per(c, "allreduce_s", steps),
                    "step_s_per_round": _per(c, "step_s", steps),
                    "busy_s_per_round": _per(c, "busy_s", steps),
                    "idle_s_per_round": _per(c, "idle_s", steps),
                    "send_s_per_round": _per(c, "send_s", steps),
                    "bytes_out": int(c.get("bytes_out") or 0),
                    "peak_activation_bytes": int(c.get("peak_activation_bytes") or 0),
                }
            )
        rows.append(
            {
                "stage": i,
                "units": [stage.start, stage.end],
                "warmup": stage.warmup,
                "predicted_forward_s": _round(pred.get(f"stage{i}_forward_s"), 5),
                "predicted_backward_s": _round(pred.get(f"stage{i}_backward_s"), 5),
                "predicted_allreduce_s": _round(pred.get(f"stage{i}_allreduce_s"), 5),
                "predicted_send_forward_s": _round(pred.get(f"stage{i}_send_forward_s"), 5),
                "predicted_send_backward_s": _round(pred.get(f"stage{i}_send_backward_s"), 5),
                "devices": devices,
            }
        )
    return rows


def _what_if_rounds(report: TrainReport, rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """The plan's round from ``simulate``, with measured and modelled parts swapped in.

    Measured, per stage: the slowest computing device's forward and backward per
    micro-batch, the fastest device's all-reduce per round (the others also wait there
    for the slowest to arrive) and the slowest's optimizer step. Modelled: the plan's
    own stage times (eq. 8, eq. 5). Links are always the cost model's.

    * ``resimulated_round_s``: measured compute and all-reduce. Near the measured round,
      it shows the schedule and link model hold, and any miss of the plan's prediction
      comes from the compute or all-reduce estimates.
    * ``predicted_round_s_measured_allreduce``: modelled compute, measured all-reduce:
      the prediction with the all-reduce estimate taken out.
    * ``resimulated_round_s_modelled_allreduce``: measured compute, modelled all-reduce:
      the round this run would have if its all-reduces took what eq. 5 says at the
      links' bandwidth (a simulation, not a measurement).
    """
    tplan = report.training_plan
    assert tplan is not None
    names = (
        "resimulated_round_s",
        "predicted_round_s_measured_allreduce",
        "resimulated_round_s_modelled_allreduce",
    )
    forward, backward, allreduce, step = [], [], [], []
    for row in rows:
        working = [d for d in row["devices"] if d["share"] > 0 and d["forward_s"] is not None]
        if not working:
            return dict.fromkeys(names)
        forward.append(max(d["forward_s"] for d in working))
        backward.append(max(d["backward_s"] or 0.0 for d in working))
        allreduce.append(min(d["allreduce_s_per_round"] or 0.0 for d in row["devices"]))
        step.append(max(d["step_s_per_round"] or 0.0 for d in row["devices"]))
    model_f = [float(row["predicted_forward_s"] or 0.0) for row in rows]
    model_b = [float(row["predicted_backward_s"] or 0.0) for row in rows]
    model_ar = [float(row["predicted_allreduce_s"] or 0.0) for row in rows]
    send_f = [float(row["predicted_send_forward_s"] or 0.0) for row in rows]
    send_b = [float(row["predicted_send_backward_s"] or 0.0) for row in rows]
    actions = pipeline_actions(
        tplan.schedule,
        num_stages=tplan.num_stages,
        num_microbatches=tplan.num_microbatches,
        warmups=tplan.warmups,
        data_parallel=any(len(s.devices) > 1 for s in tplan.stages),
    )

    def sim(f: list[float], b: list[float], ar: list[float], st: list[float]) -> float | None:
        return _round(simulate(actions, f, b, send_f, send_b, ar, step_s=st).round_s, 5)

    zero = [0.0] * len(rows)
    return {
        names[0]: sim(forward, backward, allreduce, step),
        names[1]: sim(model_f, model_b, allreduce, zero),
        names[2]: sim(forward, backward, model_ar, step),
    }


def _predicted_round(run: TimedRun) -> float | None:
    tplan = run.report.training_plan if run.report is not None else None
    return tplan.predicted.get("round_s") if tplan is not None else None


def _plan_summary(report: TrainReport) -> list[list[Any]]:
    """The plan in one line: [[devices, start, end, shares], ...]."""
    tplan = report.training_plan
    assert tplan is not None
    return [[list(s.devices), s.start, s.end, list(s.shares)] for s in tplan.stages]


def _hpp_model(
    args: argparse.Namespace,
    model: str,
    spec: ModelSpec,
    devices: list[DeviceSpec],
) -> tuple[dict[str, Any], bool]:
    """The four systems on one cluster of ``devices`` training ``spec``: keys, ok."""
    m = args.hpp_microbatches
    warm = make_batches(spec, args.warmup_steps, args.hpp_batch_size, args.seed + 1)
    batches = make_batches(spec, args.hpp_steps, args.hpp_batch_size, args.seed)
    runs: dict[str, list[TimedRun]] = {s: [] for s in HPP_SYSTEMS}
    plans: dict[str, list[list[Any]]] = {}
    described: dict[str, str] = {}
    plan_changed: dict[str, bool] = {s: False for s in HPP_SYSTEMS}
    sequence = load_layer_sequence(spec)
    unit_names = sequence.unit_names()
    started = time.perf_counter()
    with _cluster(devices) as cluster:
        _log(f"  {model}: cluster started in {time.perf_counter() - started:.1f} s")
        for system in HPP_SYSTEMS:  # the first pays the profiles and link probes
            t0 = time.perf_counter()
            fit = {"num_microbatches": m, **HPP_FITS[system]}
            warm_run = _zpipe_run(cluster, system, spec, warm, **fit)
            report = warm_run.report
            assert report is not None and report.training_plan is not None
            plans[system] = _plan_summary(report)
            described[system] = report.training_plan.describe(unit_names)
            _log(f"  {model} warm-up {system}: {time.perf_counter() - t0:.1f} s, plan")
            _log("    " + described[system].replace("\n", "\n    "))
        for repeat in range(args.hpp_repeats):
            order = HPP_SYSTEMS if repeat % 2 == 0 else HPP_SYSTEMS[::-1]
            for system in order:
                fit = {"num_microbatches": m, **HPP_FITS[system]}
                result = _zpipe_run(cluster, system, spec, batches, **fit)
                assert result.report is not None
                if _plan_summary(result.report) != plans[system]:
                    plan_changed[system] = True
                runs[system].append(result)
                _log(
                    f"  {model} repeat {repeat + 1}/{args.hpp_repeats} {system}: steady "
                    f"{result.steady_samples_per_s or 0:.2f} samples/s, round "
                    f"{result.period_s or 0:.3f} s, predicted "
                    f"{_predicted_round(result) or 0:.3f} s"
                )
    elapsed = time.perf_counter() - started
    medians = {s: _median_run(runs[s]) for s in HPP_SYSTEMS}
    config = {
        "hpp_model": model,
        "hpp_model_config": dict(spec.config),
        "hpp_units": sequence.num_units,
        "hpp_microbatches": m,
        "hpp_batch_size": args.hpp_batch_size,
        "hpp_steps": args.hpp_steps,
        "hpp_repeats": args.hpp_repeats,
        "hpp_devices": [
            {"name": d.name, "slowdown": d.slowdown, "bandwidth_mbps": d.bandwidth_mbps}
            for d in devices
        ],
    }
    results: dict[str, dict[str, Any]] = {}
    rows_by_system: dict[str, list[dict[str, Any]]] = {}
    for system in HPP_SYSTEMS:
        median = medians[system]
        report = median.report
        assert report is not None and report.training_plan is not None
        predicted = report.training_plan.predicted
        rows = rows_by_system[system] = _group_rows(report)
        results[system] = {
            "steady_samples_per_s": median.steady_samples_per_s,
            "predicted_samples_per_s": _round(predicted.get("samples_per_s")),
            "predicted_round_s": _round(predicted.get("round_s"), 5),
            "measured_round_s": _round(median.period_s, 5),
            "predicted_over_measured_round": _ratio(predicted.get("round_s"), median.period_s),
            **_what_if_rounds(report, rows),
            "plan": plans[system],
        }
        emit(
            _run_line(
                "hpp",
                f"{model}_{system}",
                runs[system],
                median,
                **{k: v for k, v in results[system].items() if k != "steady_samples_per_s"},
                plan_changed_between_runs=plan_changed[system],
                training_plan=report.training_plan.to_dict(),
                describe=described[system],
                stages=rows,
                **config,
            )
        )
    hpp = results["hpp"]
    best = max(HPP_BASELINES, key=lambda s: results[s]["steady_samples_per_s"] or 0.0)
    # Straight and even pipelines do the same maths; HPP and data parallelism split
    # micro-batches, which changes BatchNorm's batch statistics (the CNN) and the order
    # of float sums, so their losses are reported, not required to match.
    straight, even = medians["straight_1f1b"], medians["even_gpipe"]
    pipeline_diff = _max_abs_diff(straight.losses, even.losses)
    finite = all(math.isfinite(x) for s in HPP_SYSTEMS for r in runs[s] for x in r.losses)
    ok = finite and pipeline_diff is not None and pipeline_diff < 1e-3
    keys: dict[str, Any] = {
        f"hpp_over_best_baseline_{model}": _ratio(
            hpp["steady_samples_per_s"], results[best]["steady_samples_per_s"]
        ),
        f"hpp_best_baseline_{model}": best,
        f"hpp_predicted_over_measured_round_{model}": hpp["predicted_over_measured_round"],
        # what the 100 Mbit/s links would make of the all-reduces (simulated)
        f"hpp_over_best_baseline_{model}_modelled_allreduce": _ratio(
            min(
                (
                    r
                    for s in HPP_BASELINES
                    if (r := results[s]["resimulated_round_s_modelled_allreduce"])
                ),
                default=None,
            ),
            hpp["resimulated_round_s_modelled_allreduce"],
        ),
        f"hpp_{model}": {
            system: {
                **{k: v for k, v in r.items() if k != "steady_samples_per_s"},
                "steady_samples_per_s": _round(r["steady_samples_per_s"]),
                "steady_samples_per_s_runs": [_round(x.steady_samples_per_s) for x in runs[system]],
            }
            for system, r in results.items()
        },
        f"hpp_{model}_predicted_over_best_baseline": _ratio(
            hpp["predicted_samples_per_s"],
            max(results[s]["predicted_samples_per_s"] or 0.0 for s in HPP_BASELINES),
        ),
        f"hpp_{model}_loss_max_abs_diff_vs_straight": _max_abs_diff(
            medians["hpp"].losses, straight.losses
        ),
        # the first mini-batch's loss comes from the initial weights: only the split of
        # its micro-batches (BatchNorm's statistics, float sums) tells the two apart
        f"hpp_{model}_first_loss_abs_diff_vs_straight": _max_abs_diff(
            medians["hpp"].losses[:1], straight.losses[:1]
        ),
        f"hpp_{model}_pipelines_loss_max_abs_diff": pipeline_diff,
        f"hpp_{model}_allreduce_check": _allreduce_shortfall(rows_by_system),
        f"hpp_{model}_section_s": round(elapsed, 1),
        f"hpp_{model}_model_config": dict(spec.config),
        f"hpp_{model}_units": sequence.num_units,
    }
    return keys, ok


def _farthest_from_one(ratios: Sequence[float | None]) -> float | None:
    """The ratio that misses 1 the most (by factor), None if none was measured."""
    known = [r for r in ratios if r is not None and r > 0]
    return max(known, key=lambda r: abs(math.log(r)), default=None)


def _hpp_note(keys: dict[str, Any], models: Sequence[str]) -> str:
    """What the numbers say about the issue's goals, in words, with the plans."""
    goals = {"cnn": HPP_GOAL_CNN, "bert": HPP_GOAL_BERT}
    parts = []
    for model in models:
        ratio = keys.get(f"hpp_over_best_baseline_{model}")
        best = keys.get(f"hpp_best_baseline_{model}")
        systems = keys.get(f"hpp_{model}") or {}
        if ratio is None or best is None:
            continue
        plans = "; ".join(
            f"{s} {systems[s]['steady_samples_per_s']} samples/s (predicted "
            f"{systems[s]['predicted_samples_per_s']}), plan {systems[s]['plan']}"
            for s in HPP_SYSTEMS
        )
        parts.append(
            f"{model}: HPP runs at {ratio:g}x the best baseline ({best}): goal "
            f"{goals[model]:g}x {'met' if ratio >= goals[model] else 'NOT met'}; the cost "
            f"model predicted {keys.get(f'hpp_{model}_predicted_over_best_baseline')}x. "
            f"{plans}."
        )
        hpp = systems["hpp"]
        off = keys.get(f"hpp_predicted_over_measured_round_{model}")
        verdict = (
            "within" if off is not None and abs(off - 1.0) <= PREDICTION_TOLERANCE else "outside"
        )
        parts.append(
            f"{model}: HPP's predicted round {hpp['predicted_round_s']} s is {off}x the "
            f"measured {hpp['measured_round_s']} s ({verdict} {PREDICTION_TOLERANCE:.0%}); "
            f"simulated from the run's measured compute and all-reduce "
            f"{hpp['resimulated_round_s']} s, from the model's compute and the measured "
            f"all-reduce {hpp['predicted_round_s_measured_allreduce']} s."
        )
        allreduce = keys.get(f"hpp_{model}_allreduce_check")
        if allreduce:
            modelled = keys.get(f"hpp_over_best_baseline_{model}_modelled_allreduce")
            parts.append(
                f"{model}: {allreduce} Simulated with the measured compute and eq. 5's "
                f"all-reduce at the links' bandwidth, HPP would run at {modelled}x the best "
                "baseline."
            )
    return " ".join(parts)


def _allreduce_shortfall(rows_by_system: dict[str, list[dict[str, Any]]]) -> str:
    """Where groups all-reduced much faster than the cost model's links would let them."""
    found = []
    for system, rows in rows_by_system.items():
        for row in rows:
            predicted = row.get("predicted_allreduce_s") or 0.0
            measured = [d["allreduce_s_per_round"] or 0.0 for d in row["devices"]]
            if len(measured) > 1 and predicted > 0.02 and min(measured) < 0.5 * predicted:
                found.append(
                    f"{system} stage {row['stage']} all-reduced in {min(measured):.3f} s per "
                    f"round against {predicted:.3f} s predicted"
                )
    if not found:
        return ""
    return (
        "; ".join(found) + " (the stages pace their ring all-reduce on their emulated "
        "links, so a shortfall means the cost model's eq. 5 overestimates it)."
    )


def run_hpp(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    """HPP against data parallelism, a straight 1F1B and an even GPipe: summary keys, ok."""
    cores = os.cpu_count() or 1
    threads = args.threads or max(1, cores // len(HPP_DEVICES))
    scale = args.hpp_slowdown_scale or _auto_slowdown_scale(threads, cores, HPP_DEVICES)
    devices = [
        DeviceSpec(name, slowdown=s * scale, bandwidth_mbps=args.bandwidth_mbps, threads=threads)
        for name, s in HPP_DEVICES
    ]
    models = [
        ("cnn", ModelSpec("cnn", HETERO_CNN, seed=args.seed)),
        ("bert", _bert_spec(args.hidden, args.seed)),
    ]
    _log(
        f"hpp section: slowdowns x{scale:g} "
        f"({', '.join(f'{d.name} {d.slowdown:g}' for d in devices)}), "
        f"{args.bandwidth_mbps:g} Mbit/s, M = {args.hpp_microbatches} of "
        f"{args.hpp_batch_size} samples, systems {', '.join(HPP_SYSTEMS)}"
    )
    keys: dict[str, Any] = {}
    ok = True
    for model, spec in models:
        model_keys, model_ok = _hpp_model(args, model, spec, devices)
        keys.update(model_keys)
        ok = ok and model_ok
    names = [model for model, _ in models]
    keys["predicted_over_measured_round"] = _farthest_from_one(
        [keys.get(f"hpp_predicted_over_measured_round_{m}") for m in names]
    )
    keys["note"] = _hpp_note(keys, names)
    keys.update(
        {
            "hpp_microbatches": args.hpp_microbatches,
            "hpp_batch_size": args.hpp_batch_size,
            "hpp_steps": args.hpp_steps,
            "hpp_repeats": args.hpp_repeats,
            "hpp_devices": [
                {"name": d.name, "slowdown": d.slowdown, "bandwidth_mbps": d.bandwidth_mbps}
                for d in devices
            ],
            "hpp_slowdown_scale": scale,
            "hpp_threads_per_stage": threads,
        }
    )
    return keys, ok


# -------------------------------------------------------------------------------- main


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
