"""Asynchronous 1F1B (PipeDream, FTPipeHD) against synchronous 1F1B, on a real small data set.

One LocalCluster of three emulated devices (``--slowdowns``, default 1, 1.5, 2: a
heterogeneous chain), one plan for every system (``--partition``), an MLP on
scikit-learn's handwritten digits (8 x 8, 1437 train / 360 test, fixed split), Adam
(lr 1e-3), the same seeded mini-batches (``--batch-size``) and epochs for all:

* ``sync_1f1b``: zpipe's synchronous 1F1B, ``--microbatches`` per mini-batch, one
  optimizer step per mini-batch (the result equals single-process training);
* ``async``: asynchronous 1F1B with weight stashing and vertical sync (each stage
  updates after each backward; up to n mini-batches in flight);
* ``async_aggregate``: the same with FTPipeHD's weight aggregation.

Every system first trains ``--warmup-steps`` mini-batches (not timed: stage processes
warm up), then the timed runs alternate between the systems (``--repeats`` each; the
median by throughput is reported). Throughput is the client's samples over the time
from the first send to the last loss. Accuracy is the test accuracy after
``--epochs`` epochs of the same mini-batches (one run each, after the timed ones).

``straggler`` (``--skip-straggler`` leaves it out): a second cluster whose first
device (the most compute) follows ``--slowdown-schedule`` (default: 10x slower from
1.5 s after its first step): the asynchronous run's samples/s before and after the
change, from the losses' arrival times (``after_over_before``), showing a device
that turns slow mid-run.

``repartition`` (``--skip-repartition`` leaves it out): FTPipeHD's headline, on the
issue's cluster: four devices, the best 10 times the worst (``--capacities``, default
slowdowns 4, 8, 20, 40), one of them slowing 10x mid-run. ``pipedream``: asynchronous
1F1B on the even partition it starts with (units alike per stage), kept; ``ftpipehd``:
the same start with live re-partitioning (``--repartition-first``,
``--repartition-every``, gain 0.1, and an early look when the losses slow
``--repartition-watch`` times: :mod:`zpipe.training.repartition_watch`, or when a stage's
own forwards do ``--repartition-forward-watch`` times: :mod:`zpipe.stage.speed_watch`).
Each runs on a cluster of its own (the slowdown's clock starts at a stage's first step), on the same
mini-batches; with vertical sync both compute the same losses step by step, so time to a
loss is time to a step: ``ftpipehd_over_pipedream_time_to_loss`` is PipeDream's time
over FTPipeHD's to the lowest loss (averaged over 20 mini-batches) PipeDream reaches
(FTPipeHD reports 6.8x). The issue names neither the model's depth nor which device
slows, so four set-ups, equally faithful (``--setups``):

* ``u12_best``: an MLP of ``--units`` (12) gelu layers, the best device slowing
  ``--change-s`` (10) s after its first step, ``--repartition-steps`` (240);
* ``u12_middle``: the same model, the second device (slowdown 8) slowing to 80
  after 6 s, 160 steps;
* ``u16_best`` and ``u16_middle``: 16 relu layers, the same two changes (after 5 s,
  120 steps; after 4 s, 100 steps);
* ``r16_middle`` and ``r24_middle``: residual MLPs (``"residual": true``: every
  hidden unit a pre-norm block ``x + W2 gelu(W1 LayerNorm(x))``) of 16 and 24 units,
  the second device slowing (after 5 s, 160 steps; after 6 s, 200 steps).

Plain MLPs of 16 layers stay at ln 10 under asynchronous staleness
(``train_async_reference``, 140 steps, relu or gelu, Adam at 3e-4 or 1e-3), and 20
or 24 layers do not learn even synchronously. The ``u16`` set-ups still measure
what more units allow (their periods: the cuts are not limited to 12 units'
granularity), but their ratio is the time to their last step (``ratio_kind``; with
the same losses step by step that is the time to the same point of training), not
a time to a loss (``loss_drop``: how far the smoothed loss fell; under
``MIN_LOSS_DROP`` the lowest loss is a noisy dip). The residual MLPs learn at the
same depths under the same staleness (the reference, Adam at 3e-4, hidden 256, 160
steps: the smoothed loss from 2.1 to 0.28 at 16 units, from 2.7 to 1.3 at 24; at
lr 1e-3 they diverge), so their ratio is a time to a loss. Their first and last
units are single Linears, lighter than a block (``residual_unit_weights``: their
multiply-adds over a block's): their bounds cost each unit so, the others' take
units as equal.

FTPipeHD's runs leave a device out (``--repartition-leave-out``, on by default;
``--no-repartition-leave-out``: every device keeps a unit, zpipe's rule before):
FTPipeHD's eq. 5 admits a worker with no layers (``l = j``, PipeDream's DP also
picks how many machines to use), so after a middle device slows tenfold, a device
whose one unit and own cost per mini-batch cost more than the others' whole share
is left idle. The run's DP keeps the first and last devices (the client's feed and
sink) and leaves out only for a gain of 0.1; every ``bound_*`` below is computed
with that same call (:func:`bench._repartition_bounds.best_cuts`), so a run that
leaves a device out is not measured against a bound that keeps it
(``leave_out``, and ``left_out_moves``: the devices each such move kept).

Each set-up prints its bounds from zpipe's own cost model: ``bound_before`` and
``bound_after``, the even cuts' bottleneck period over the best integer cuts'
(eq. 5 on equal units, :func:`zpipe.planner.ftpipehd.ftpipehd_partition`, the
planner the coordinator re-partitions with); ``bound_run``, both pipelines at
those periods through the change to the target mini-batch (one unit-time from
PipeDream's measured period before the change; a faster pipeline does more of its
mini-batches before the change, so the run's bound need not lie between the
phases'); the measured phases (``measured_before``, ``measured_after``: the
median gaps' ratio, FTPipeHD's after the move that answers the phase) and
``measured_over_bound``. Bounds: u12_best 3.0 then 2.0, u12_middle 3.0 then 3.0,
u16_best 4.0 then 2.0, u16_middle 4.0 then 4.0, r16_middle 3.3 then 4.0,
r24_middle 3.8 then 6.0 (units costed; a continuous split: 4.5 before; 2.25 after
the best slows, 6.75 after the second does). Once the best device
slows to the worst's speed the even cuts' bottleneck (the worst device) does not
change and no cut can win more than 2.25: no set-up where the best device slows
can reach 3 after the change. The measured ratios stay well under the bounds
because a stage also has a per-mini-batch cost of its own (about 1.3 ms of CPU at
hidden 256 against 0.45 ms per unit, from the looks' capacities at load 2), which the
emulation, like a real slower device, multiplies by the slowdown, while eq. 3
scales a stage's time with its units only: a device cut down to one unit keeps
that cost (``--repartition-hidden 512`` makes the units' work dominate it). The
controller now fits that cost across its looks (``fixed_s`` in each look,
:mod:`zpipe.training.stage_cost`) and costs eq. 5's stages with it;
``fitted_bound_last_look`` is the bound it leaves (the even cuts' period over the
best cuts' under the last look's fitted capacities and fixed costs; the units
taken as equal), the honest ceiling for the measured ratio after the change.

What each bound includes: ``bound_run`` (and ``measured_over_bound``, the headline's
``ftpipehd_headline_measured_over_bound``) is eq. 5 as the paper states it, every
stage's time its units' work times its capacity, links free (loopback), the move
itself free and instant at the change; it leaves out the stage's own cost per
mini-batch, so no run of this emulation can reach it. ``bound_run_fixed`` (and
``measured_over_bound_fixed``) is the same run bound with each stage paying that
cost too, ``C_i * (fixed_units + its units)``, where ``fixed_units`` is the median
over FTPipeHD's looks of the cost they fitted (:mod:`zpipe.training.stage_cost`,
in units); still a free, instant move and no detection delay. None when no look
fitted one.

The headline key (``ftpipehd_headline_setup``) is chosen by a rule, not by its
number (:func:`headline_setup`): of the set-ups run whose model learned in this
run (``ratio_kind`` ``time_to_loss``, so a time to loss means something), one
where a middle device slows (the change makes a new straggler that a kept even
partition cannot leave, the case FTPipeHD's dynamic partition is for; its
experiment: "assigning less layer to the straggler"; when the best device slows
to the worst's speed the cluster becomes less heterogeneous instead, best over
worst 5x, and the even cuts' bottleneck does not change), and of those the one
with the most units (the finest cuts: the closest integer cuts can follow the
speeds, as FTPipeHD's layers do); ties go to the order of ``SETUP_NAMES``. With
every set-up run that is ``r24_middle`` (bounds 3.8 before the change, 6.0 after); with the
12-layer ones alone ``u12_middle`` (bound 3.0, the issue's goal exactly); when no
model learned, the first set-up run. This was chosen knowing the bounds; every
set-up's ratio, bounds and measured/bound are in the summary
(``ftpipehd_setups``, ``ftpipehd_time_to_loss_by_setup``; the original set-up is
``u12_best``). ``ftpipehd_over_pipedream_whole_run``,
``repartitions`` and the look pauses describe the headline set-up.

Each look's pause (``pause_s``: its gap between two losses beyond the run's median
gap; ``ftpipehd_look_pauses_s`` sums them) is also given in parts (``parts``),
from the stamps of the coordinator's and the stages' events (FTPipeHD's run logs
at info): ``request_s`` (last loss to the coordinator's start), ``prepare_s``
(every stage flushed and kept a snapshot; ``flush_wait_max_s`` of it waiting for
the flush), ``look_s``, ``allow_s`` (peers granted their fetches), ``fetch_s``,
``commit_s`` (``regroup_max_s`` building the new shards) and ``resume_s`` (the
reply, the feed and one mini-batch through the pipeline). A look made while the
pipeline ran, before the pause of the move it decided, is split from the move:
``look_before_s`` (its own time) and ``drain_s`` (from its answer to the move's
request: the client pausing, every loss in flight back), both inside ``request_s``.

``timeline`` (:mod:`bench._repartition_timeline`) says where FTPipeHD's run loses
against the bound: the periods before the change, on the old cuts after it
(``slow_s``) and after the move that answers it, each over the bound's best
period (``before_over_bound``, ``after_over_bound``), the time from the change to
that look (``detect_s``), the move's pause (``move_s``) and what both cost against
a move at the change itself (``lost_s``); ``decide_s`` and ``drain_s`` split
``detect_s`` into the change to the look that decided the move and the drain of the
mini-batches in flight after it. ``--keep-logs DIR`` keeps each run's logs and loss
times for a timeline by hand.

Prints JSON lines, then one summary with same-run ratios; every line has the load
average (timings on a loaded 2-core machine are noisy).
"""

from __future__ import annotations

import argparse
import itertools
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench._common import emit, loadavg, on_alarm, summary
from bench._repartition_setups import (
    BENCH,
    SETUP_NAMES,
    headline_setup,
    minibatches,
    repartition_section,
    run_once,
)
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.lossy.data import load_digits_dataset
from zpipe.models import ModelSpec

SETUP_SUMMARY_KEYS = (
    "ratio",
    "bound_run",
    "measured_over_bound",
    "fixed_units",
    "bound_run_fixed",
    "measured_over_bound_fixed",
    "bound_before",
    "measured_before",
    "bound_after",
    "measured_after",
    "whole",
    "repartitions",
    "look_pauses_s",
    "target_step",
    "loss_drop",
    "ratio_kind",
    "change_inside_both",
    "timeline",
)


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.inference_mode():
        return float((model(x)[0].argmax(dim=1) == y).float().mean())


def systems(microbatches: int) -> dict[str, dict[str, Any]]:
    return {
        "sync_1f1b": {"schedule": "1f1b", "num_microbatches": microbatches},
        "async": {"schedule": "async-1f1b", "num_microbatches": 1},
        "async_aggregate": {"schedule": "async-1f1b", "num_microbatches": 1, "aggregate": True},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slowdowns", type=float, nargs=3, default=[1.0, 1.5, 2.0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40, help="timed mini-batches per run")
    parser.add_argument("--warmup-steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3, help="epochs of the accuracy runs")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per stage")
    parser.add_argument("--skip-straggler", action="store_true")
    parser.add_argument("--skip-comparison", action="store_true")
    parser.add_argument("--slowdown-schedule", default="0:1,1.5:10")
    parser.add_argument("--straggler-epochs", type=int, default=10)
    parser.add_argument("--skip-repartition", action="store_true")
    # every device at least 4x slower than this host: the emulated speeds, not the
    # contention for its two cores, set the periods (with 1, 2, 5, 10 at load 16
    # FTPipeHD's better cuts measured no faster than PipeDream's even ones)
    parser.add_argument("--capacities", type=float, nargs=4, default=[4.0, 8.0, 20.0, 40.0])
    parser.add_argument("--units", type=int, default=12)
    parser.add_argument("--repartition-hidden", type=int, default=256)
    parser.add_argument("--repartition-steps", type=int, default=240)
    # inside both runs: at 4, 8, 20, 40 PipeDream's 240 steps took 34 s, FTPipeHD's 24 s
    parser.add_argument("--change-s", type=float, default=10.0)
    # FTPipeHD's first look (10: the first few mini-batches warm up and mislead it);
    # a look every 10, not FTPipeHD's 100: a look that keeps the cuts no longer
    # pauses the pipeline, and after the change a look every 20 slow mini-batches
    # left the old cuts in place for about 10 s (hidden 512)
    parser.add_argument("--repartition-first", type=int, default=10)
    parser.add_argument("--repartition-every", type=int, default=10)
    # an early look when the losses come back this many times slower than between
    # the two looks before (0: scheduled looks only): a device that slows right
    # after a look no longer runs the old cuts for ten slow mini-batches
    parser.add_argument("--repartition-watch", type=float, default=2.0)
    # an early look when a stage's own forwards run this many times slower (or
    # faster) for good, told by the stage itself (0: off): it sees the change at its
    # third (far beyond any hiccup) or fourth slow forward, where the loss watch
    # waits for the period to show it
    parser.add_argument("--repartition-forward-watch", type=float, default=2.0)
    # FTPipeHD's eq. 5 admits a worker with no layers (l = j): its runs leave a device
    # out when that beats keeping it by the gain (--no-repartition-leave-out: zpipe's
    # rule before, every device keeps a unit); the bounds use the same DP
    parser.add_argument(
        "--repartition-leave-out", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument(
        "--setups",
        nargs="+",
        choices=SETUP_NAMES,
        default=list(SETUP_NAMES),
        help="repartition set-ups to run (the headline: headline_setup's rule)",
    )
    parser.add_argument("--timeout", type=int, default=1500, help="seconds for the whole bench")
    # the repartition runs' logs (coordinator, stages) and the client's loss times,
    # kept for a timeline by hand: DIR/<setup>_<system>/ (default: not kept)
    parser.add_argument("--keep-logs", type=Path, default=None, metavar="DIR")
    # a loaded host (load 25 on two cores) took over 120 s to start four stages
    parser.add_argument(
        "--start-timeout",
        type=float,
        default=120.0,
        help="seconds for a repartition cluster's stages to register",
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(args.timeout)

    torch.manual_seed(0)
    data = load_digits_dataset()
    x_train = torch.tensor(data.x_train, dtype=torch.float32)
    y_train = torch.tensor(data.y_train)
    x_test = torch.tensor(data.x_test, dtype=torch.float32)
    y_test = torch.tensor(data.y_test)
    h = args.hidden
    spec = ModelSpec("mlp", {"dims": [64, h, h, h, 10], "activation": "relu"}, seed=1)
    partition = [[0, 2], [2, 3], [3, 4]]
    names = ["fast", "mid", "slow"]
    devices = [
        DeviceSpec(n, slowdown=s, threads=args.threads)
        for n, s in zip(names, args.slowdowns, strict=True)
    ]
    timed = minibatches(x_train, y_train, batch_size=args.batch_size, epochs=1, seed=1)
    timed = timed[: args.steps]
    warm = timed[: args.warmup_steps]
    train = minibatches(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, seed=2)
    kinds = systems(args.microbatches)
    throughput: dict[str, list[float]] = {k: [] for k in kinds}
    acc: dict[str, float] = {}
    if not args.skip_comparison:
        with LocalCluster(devices, log_level="warning") as cluster:
            for settings in kinds.values():
                run_once(cluster, spec, warm, partition, settings)
            for repeat in range(args.repeats):
                for kind, settings in kinds.items():
                    report, _ = run_once(cluster, spec, timed, partition, settings)
                    throughput[kind].append(report.samples_per_s)
                    emit(
                        {
                            "bench": BENCH,
                            "system": kind,
                            "repeat": repeat,
                            "samples_per_s": round(report.samples_per_s, 2),
                            "steps": report.steps,
                            "final_loss": round(report.losses[-1], 4),
                            "loadavg": loadavg(),
                        }
                    )
            for kind, settings in kinds.items():
                started = time.perf_counter()
                report, _ = run_once(cluster, spec, train, partition, settings)
                acc[kind] = accuracy(report.model(), x_test, y_test)
                emit(
                    {
                        "bench": BENCH,
                        "system": kind,
                        "epochs": args.epochs,
                        "steps": report.steps,
                        "test_accuracy": round(acc[kind], 4),
                        "wall_s": round(time.perf_counter() - started, 2),
                        "samples_per_s": round(report.samples_per_s, 2),
                        "loadavg": loadavg(),
                    }
                )
    median = {k: statistics.median(v) for k, v in throughput.items() if v}
    straggler: dict[str, Any] = {}
    if not args.skip_straggler:
        # the first device (the most compute: units [0, 2)) turns slow mid-run
        slow = [
            DeviceSpec(names[0], threads=args.threads, slowdown_schedule=args.slowdown_schedule),
            *(
                DeviceSpec(n, slowdown=f, threads=args.threads)
                for n, f in zip(names[1:], args.slowdowns[1:], strict=True)
            ),
        ]
        with LocalCluster(slow, log_level="warning") as cluster:
            long = minibatches(
                x_train, y_train, batch_size=args.batch_size, epochs=args.straggler_epochs, seed=3
            )
            report, arrivals = run_once(cluster, spec, long, partition, kinds["async"])
        change = float(args.slowdown_schedule.split(",")[1].split(":")[0])
        gaps = [b - a for a, b in itertools.pairwise(arrivals)]
        start = arrivals[0]
        # the first half second warms up; the half second after the change drains
        timed_gaps = list(zip(gaps, arrivals[1:], strict=True))
        before = [g for g, t in timed_gaps if 0.5 < t - start < change]
        after = [g for g, t in timed_gaps if t - start > change + 0.5]
        if before and after:
            straggler = {
                "before_samples_per_s": round(args.batch_size / statistics.median(before), 2),
                "after_samples_per_s": round(args.batch_size / statistics.median(after), 2),
            }
            straggler["after_over_before"] = round(
                straggler["after_samples_per_s"] / straggler["before_samples_per_s"], 3
            )
        emit({"bench": BENCH, "section": "straggler", "schedule": args.slowdown_schedule,
              "steps": report.steps, "run_s": round(arrivals[-1] - start, 2),
              "gaps_before": len(before), "gaps_after": len(after),
              **straggler, "loadavg": loadavg()})  # fmt: skip
    results = {} if args.skip_repartition else repartition_section(args, x_train, y_train)
    # the headline set-up and why: the module notes; every set-up is in the summary
    chosen = headline_setup(results)
    headline = results.get(chosen, {}) if chosen is not None else {}
    compared = bool(median) and bool(acc)
    summary(
        BENCH,
        async_over_sync_1f1b_throughput=(
            round(median["async"] / median["sync_1f1b"], 3) if compared else None
        ),
        async_aggregate_over_sync_1f1b_throughput=(
            round(median["async_aggregate"] / median["sync_1f1b"], 3) if compared else None
        ),
        samples_per_s={k: round(v, 2) for k, v in median.items()},
        test_accuracy={k: round(v, 4) for k, v in acc.items()},
        aggregation_acc_gain=round(acc["async_aggregate"] - acc["async"], 4) if compared else None,
        async_acc_minus_sync=round(acc["async"] - acc["sync_1f1b"], 4) if compared else None,
        straggler_after_over_before=straggler.get("after_over_before"),
        ftpipehd_over_pipedream_time_to_loss=headline.get("ratio"),
        ftpipehd_headline_setup=chosen,
        ftpipehd_headline_bound=headline.get("bound_run"),
        ftpipehd_headline_measured_over_bound=headline.get("measured_over_bound"),
        ftpipehd_headline_bound_with_fixed_cost=headline.get("bound_run_fixed"),
        ftpipehd_headline_measured_over_bound_with_fixed_cost=headline.get(
            "measured_over_bound_fixed"
        ),
        ftpipehd_time_to_loss_by_setup={k: v["ratio"] for k, v in results.items()},
        ftpipehd_setups={
            k: {key: v[key] for key in SETUP_SUMMARY_KEYS if key in v} for k, v in results.items()
        },
        ftpipehd_over_pipedream_whole_run=headline.get("whole"),
        repartitions=headline.get("repartitions"),
        ftpipehd_look_pauses_s=headline.get("look_pauses_s"),
        ftpipehd_look_share_of_run=headline.get("look_share"),
        loadavg=loadavg(),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
