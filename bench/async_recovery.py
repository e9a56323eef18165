"""What recovery costs an asynchronous 1F1B run: flushes for replicas, and a killed stage.

One LocalCluster of three emulated devices (``--slowdowns``, default 4x each: the
emulated speeds, not the contention for this machine's cores, set the period), an
MLP of three equal hidden layers cut one layer per stage, Adam, the same seeded
random mini-batches (``--steps``) for every run. Every run of the first section is
timed after an untimed warm-up run; the systems alternate (``--repeats`` each, the
median by throughput is reported):

* ``async``: ``fit(schedule="async-1f1b")`` without ``recover``;
* ``recover_every_R`` for each R of ``--periods``: the same with ``recover=True,
  replicate_every=R``: before every R-th mini-batch the client pauses its feed, the
  stages flush (the pipeline empties and fills again) and the coordinator keeps a
  global copy of every unit with its weight versions
  (:mod:`zpipe.coordinator.runs.async_replicas`).

``killed`` (``--skip-kill`` leaves it out): the run with the first period, whose
middle stage is SIGKILLed after ``--kill-after`` mini-batches: the recovery's
``restart_s`` (from the client's notice until the survivors run again from the
replica), the mini-batches replayed, the whole run's throughput, and
``weights_exact`` (the trained weights equal the same run without the kill).

``fast_vs_exact`` (``--skip-fast`` leaves it out): the mini-batches of progress a
death loses, FTPipeHD's fast recovery against exact rollback, each run killed the
same way (b SIGKILLed once mini-batch ``--kill-after``'s loss is back, nothing
waited for; ``--fast-kill-after`` for several points: where a death falls in the
copy periods decides what each loses, so their mean is the fair figure).
``exact``: ``recover=True, replicate_every=G`` (flush replicas every
``--global-every``, what an exact rollback resumes from); lost = the mini-batches
acknowledged at the death minus the replica's (trained again). ``fast``:
``live_copies=True, consistency="fast", chain_every=C, global_every=G``
(``--chain-every``; FTPipeHD's periods 50/100 scaled to the run); lost = the
report's ``progress_lost`` (the most mini-batches of updates any unit missed:
the dead stage's, restored from a copy, and a survivor behind the acknowledged
count). Each repeat runs both. Before the trials, one traced ``fast`` run without a
kill times each stage's chain copies from snapshot to holder, in mini-batches
(``chain_copy_transfer_mb``: the window in which a death finds its newest copy not
there yet). Beside the issue's key (unchanged), two counts that explain it
(:mod:`bench._progress_lost`): ``async_fast_over_exact_progress_lost_if_instant``,
fast's loss if every copy were at its holder when taken (with a death anywhere in
a global period its mean is (C + 1) / (G + 1) of exact's: 0.524 at 10 / 20, 0.505 at
FTPipeHD's 50 / 100, so a ratio under 0.5 needs the deaths to fall early in their
chain periods), and ``async_fast_over_exact_model_progress_lost``, each unit's loss
weighted by its parameters (fast loses only the dead stage's units; exact rolls
every unit back and trains it again).

``recut`` (``--recut``, a cluster of its own): what eq. 5 over measured capacities
buys a fast recovery. An MLP of four equal layers (``--recut-hidden``) on devices
a, b, c slowed ``--recut-slowdowns`` (default 1x, 1x, 8x), cut 2 | 1 | 1; b is
SIGKILLed after ``--recut-kill-after`` mini-batches and the survivors a and c are
re-cut. ``unmeasured``: no re-partition, every capacity 1 (each survivor two
layers: the slow c sets the period); ``measured``: the same with a live
re-partition that looks every 5 mini-batches and never moves (gain 0.99), whose
capacities eq. 5 then takes (the slow c keeps one layer). The figure is each run's
rate after the recovery (mini-batches per second over the steps from 5 after the
resume point, each step's last loss): ``async_fast_measured_over_unmeasured_rate_after``
(the medians' ratio).

The summary: ``recover_every_R_over_async_throughput`` per period, the killed
run's ``killed_over_recover_throughput``, and ``async_fast_over_exact_progress_lost``
(the mean of fast's lost over the mean of exact's; issue 30's goal < 0.5). Load
makes the numbers noisy: the load average is printed beside them.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench._common import emit, loadavg, on_alarm, summary
from bench._progress_lost import copy_transfer_mb, lost_if_instant, model_lost, unit_params
from zpipe.client import TrainReport
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.models import ModelSpec

BENCH = "async_recovery"
ADAM = {"name": "adam", "lr": 1e-3}
NAMES = ["a", "b", "c"]
PARTITION = [[0, 2], [2, 3], [3, 4]]


def batches(count: int, size: int, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(size, width, generator=generator), torch.randint(0, 10, (size,)))
        for _ in range(count)
    ]


def fit(cluster: LocalCluster, spec: ModelSpec, data: list[Any], **extra: Any) -> TrainReport:
    return cluster.fit(
        spec, data, optimizer=ADAM, num_microbatches=1, schedule="async-1f1b",
        partition=PARTITION, stage_names=NAMES, progress=False, **extra,
    )  # fmt: skip


def killed_run(
    cluster: LocalCluster, spec: ModelSpec, data: list[Any], kill_after: int, slowdown: float,
    stamps: list[tuple[int, float]] | None = None, **extra: Any,
) -> tuple[TrainReport, list[int]]:  # fmt: skip
    """A run whose stage b is SIGKILLed once mini-batch ``kill_after``'s loss is back
    (started again afterwards); the report and every step's loss callback, in order
    (and, into ``stamps``, each callback's step and time)."""
    killed: list[str] = []
    seen: list[int] = []

    def on_step(step: int, _loss: float) -> None:
        seen.append(step)
        if stamps is not None:
            stamps.append((step, time.monotonic()))
        if step == kill_after and not killed:
            killed.append("b")
            cluster.kill("b")

    try:
        report = fit(cluster, spec, data, on_step=on_step, **extra)
    finally:
        for name in killed:
            cluster.start_stage(DeviceSpec(name, slowdown=slowdown))
        cluster.wait_for_stages(len(NAMES), timeout_s=120)
    return report, seen


def acknowledged_at_death(seen: list[int]) -> int:
    """The mini-batches acknowledged before a recovery sent some again (all of them, if
    none was sent again): the first step that does not go past every earlier one."""
    top = -1
    for step in seen:
        if step <= top:
            return top + 1
        top = step
    return top + 1


def rate_after(stamps: Sequence[tuple[int, float]], start: int) -> float | None:
    """Mini-batches per second over the steps from ``start`` on, each at the last time
    its loss came back (a step trained again counts once, when it came back again):
    (n - 1) over the time from the first to the last; None with fewer than two."""
    last: dict[int, float] = {}
    for step, at in stamps:
        last[step] = at
    times = sorted(at for step, at in last.items() if step >= start)
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


def recut(args: argparse.Namespace) -> dict[str, Any]:
    """The ``recut`` section (see the module notes): its summary keys."""
    h = args.recut_hidden
    # four equal layers (the logits are h wide; the labels use the first 10)
    spec = ModelSpec("mlp", {"dims": [h] * 5, "activation": "relu"}, seed=1)
    data = batches(args.recut_steps, args.batch_size, h)
    devices = [DeviceSpec(n, slowdown=s) for n, s in zip(NAMES, args.recut_slowdowns, strict=True)]
    common = {"recover": True, "live_copies": True, "consistency": "fast", "chain_every": 5,
              "global_every": 10}  # fmt: skip
    systems: dict[str, dict[str, Any]] = {
        "unmeasured": common,
        "measured": {**common, "repartition": {"first": 5, "every": 5, "gain": 0.99}},
    }
    rates: dict[str, list[float]] = {k: [] for k in systems}
    with LocalCluster(
        devices, heartbeat_interval_s=0.5, suspect_after=6, probe_intervals=4,
        log_level="warning",
    ) as cluster:  # fmt: skip
        fit(cluster, spec, data[:6])  # untimed: the stages warm up
        for repeat in range(args.repeats):
            for name, extra in systems.items():
                stamps: list[tuple[int, float]] = []
                report, _ = killed_run(cluster, spec, data, args.recut_kill_after,
                                       args.recut_slowdowns[1], stamps, **extra)  # fmt: skip
                recovery = report.recoveries[0] if report.recoveries else {}
                resumed = int(recovery.get("resumed_at", args.recut_kill_after))
                rate = rate_after(stamps, resumed + 5)
                if rate is not None:
                    rates[name].append(rate)
                plan = report.training_plan
                emit({"bench": BENCH, "section": "recut", "system": name, "repeat": repeat,
                      "resumed_at": resumed, "rate_after": None if rate is None else round(rate, 2),
                      "cuts_after": None if plan is None else
                      [[s.devices[0], s.start, s.end] for s in plan.stages],
                      "eq5": recovery.get("eq5"), "samples_s": round(report.samples_per_s, 2),
                      "load": loadavg()})  # fmt: skip
    if not rates["measured"] or not rates["unmeasured"]:
        return {"async_fast_measured_over_unmeasured_rate_after": None}
    ratio = statistics.median(rates["measured"]) / statistics.median(rates["unmeasured"])
    return {"async_fast_measured_over_unmeasured_rate_after": round(ratio, 3)}


def copy_transfer(
    cluster: LocalCluster, spec: ModelSpec, data: list[Any], extra: dict[str, Any]
) -> dict[str, Any]:
    """One traced run of ``fast`` without a kill: each stage's chain copy's time from
    its snapshot until it was at its holder, in mini-batches (the window in which a
    death finds the copy not yet there), median and most."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        fit(cluster, spec, data, trace=str(path), **extra)
        document = json.loads(path.read_text())
    events = document["traceEvents"] if isinstance(document, dict) else document
    times = copy_transfer_mb(events, NAMES[-1])
    emit({"bench": BENCH, "section": "copy_transfer", "chain_copy_mb": times,
          "load": loadavg()})  # fmt: skip
    return {
        name: {"median": statistics.median(values), "max": max(values)}
        for name, values in times.items()
        if values
    }


def fast_vs_exact(
    cluster: LocalCluster, spec: ModelSpec, data: list[Any], args: argparse.Namespace
) -> dict[str, Any]:
    """The ``fast_vs_exact`` section (see the module notes): its summary keys."""
    lost: dict[str, list[int]] = {"exact": [], "fast": []}
    model: dict[str, list[float]] = {"exact": [], "fast": []}
    instant: list[int] = []
    systems = {
        "exact": {"recover": True, "replicate_every": args.global_every},
        "fast": {"recover": True, "live_copies": True, "consistency": "fast",
                 "chain_every": args.chain_every, "global_every": args.global_every},
    }  # fmt: skip
    transfer = copy_transfer(cluster, spec, data, systems["fast"])
    points = args.fast_kill_after or [args.kill_after]
    for repeat, kill_after in ((r, k) for r in range(args.repeats) for k in points):
        for name, extra in systems.items():
            report, seen = killed_run(cluster, spec, data, kill_after, args.slowdowns[1], **extra)
            recovery = report.recoveries[0] if report.recoveries else {}
            params = unit_params(report.state_dict)
            if name == "exact":
                acked = acknowledged_at_death(seen)
                count = acked - int(recovery.get("resumed_from", acked))
                per_unit = dict.fromkeys(params, count)  # every unit rolls back
                floor = None
            else:  # nothing is sent again: the coordinator resumed at the count
                acked = int(recovery.get("resumed_at", -1))
                count = int(recovery.get("progress_lost", 0))
                per_unit = {int(u): int(n) for u, n in
                            (recovery.get("lost_per_unit") or {}).items()}  # fmt: skip
                floor = lost_if_instant(acked, args.chain_every)
                instant.append(floor)
            lost[name].append(count)
            model[name].append(model_lost(per_unit, params))
            emit({"bench": BENCH, "section": "fast_vs_exact", "system": name, "repeat": repeat,
                  "killed_after": kill_after, "acknowledged_at_death": acked,
                  "resumed_at": recovery.get("resumed_at", recovery.get("resumed_from")),
                  "progress_lost": count, "lost_if_instant": floor,
                  "model_lost": round(model[name][-1], 2),
                  "lost_per_unit": recovery.get("lost_per_unit"),
                  "unit_sources": recovery.get("unit_sources"),
                  "restart_s": round(float(recovery.get("restart_s", 0.0)), 3),
                  "steps": report.steps, "samples_s": round(report.samples_per_s, 2),
                  "load": loadavg()})  # fmt: skip

    def over_exact(values: Sequence[float], of: Sequence[float]) -> float | None:
        base = statistics.mean(of)
        return round(statistics.mean(values) / base, 3) if base > 0 else None

    return {
        "async_fast_over_exact_progress_lost": over_exact(lost["fast"], lost["exact"]),
        "fast_progress_lost": lost["fast"],
        "exact_progress_lost": lost["exact"],
        # not the key: the floor the copy periods set, and the whole model's share
        "async_fast_over_exact_progress_lost_if_instant": over_exact(instant, lost["exact"]),
        "fast_progress_lost_if_instant": instant,
        "async_fast_over_exact_model_progress_lost": over_exact(model["fast"], model["exact"]),
        "kill_points": list(points),
        "chain_every": args.chain_every,
        "global_every": args.global_every,
        "chain_copy_transfer_mb": transfer,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slowdowns", type=float, nargs=3, default=[4.0, 4.0, 4.0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=60, help="mini-batches per run")
    parser.add_argument("--periods", type=int, nargs="+", default=[20, 5])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kill-after", type=int, default=30)
    parser.add_argument("--skip-kill", action="store_true")
    parser.add_argument(
        "--skip-flush-cost",
        action="store_true",
        help="leave out the flush-cost runs (and the killed run after them)",
    )
    parser.add_argument("--skip-fast", action="store_true", help="leave out fast_vs_exact")
    parser.add_argument("--chain-every", type=int, default=10)
    parser.add_argument(
        "--fast-kill-after",
        type=int,
        nargs="+",
        default=None,
        help="fast_vs_exact's kill points (default: --kill-after)",
    )
    parser.add_argument("--global-every", type=int, default=20)
    parser.add_argument("--recut", action="store_true", help="run the recut section too")
    parser.add_argument("--recut-only", action="store_true", help="run the recut section only")
    parser.add_argument("--recut-slowdowns", type=float, nargs=3, default=[1.0, 1.0, 8.0])
    parser.add_argument("--recut-hidden", type=int, default=512)
    parser.add_argument("--recut-steps", type=int, default=60)
    parser.add_argument("--recut-kill-after", type=int, default=15)
    parser.add_argument("--timeout", type=int, default=900, help="seconds for the whole bench")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(args.timeout)
    recut_keys = recut(args) if args.recut or args.recut_only else {}
    if args.recut_only:
        summary(BENCH, **recut_keys, load=loadavg())
        return 0
    h = args.hidden
    spec = ModelSpec("mlp", {"dims": [64, h, h, h, 10], "activation": "relu"}, seed=1)
    data = batches(args.steps, args.batch_size, 64)
    devices = [DeviceSpec(n, slowdown=s) for n, s in zip(NAMES, args.slowdowns, strict=True)]
    systems: dict[str, dict[str, Any]] = {"async": {}}
    for r in args.periods:
        systems[f"recover_every_{r}"] = {"recover": True, "replicate_every": r}
    speeds: dict[str, list[float]] = {k: [] for k in systems}
    ratios: dict[str, Any] = dict(recut_keys)
    with LocalCluster(
        devices, heartbeat_interval_s=0.5, suspect_after=6, probe_intervals=4,
        log_level="warning",
    ) as cluster:  # fmt: skip
        fit(cluster, spec, data[:6])  # untimed: the stages warm up
        if not args.skip_fast:
            ratios.update(fast_vs_exact(cluster, spec, data, args))
        reports: dict[str, TrainReport] = {}
        for repeat in range(0 if args.skip_flush_cost else args.repeats):
            for name, extra in systems.items():
                report = fit(cluster, spec, data, **extra)
                reports[name] = report
                speeds[name].append(report.samples_per_s)
                emit({"bench": BENCH, "section": "flush_cost", "system": name, "repeat": repeat,
                      "samples_s": round(report.samples_per_s, 2),
                      "replicas": len(report.replicas), "load": loadavg()})  # fmt: skip
        if args.skip_flush_cost:
            summary(BENCH, **ratios, load=loadavg())
            return 0
        base = statistics.median(speeds["async"])
        for name in systems:
            if name != "async":
                ratio = statistics.median(speeds[name]) / base
                ratios[f"{name}_over_async_throughput"] = round(ratio, 3)
        if not args.skip_kill:
            period = args.periods[0]
            plain = reports[f"recover_every_{period}"]
            killed: list[str] = []

            def on_step(step: int, _loss: float) -> None:
                if step == args.kill_after and not killed:
                    killed.append("b")
                    cluster.kill("b")

            try:
                report = fit(cluster, spec, data, recover=True, replicate_every=period,
                             on_step=on_step)  # fmt: skip
            finally:
                for name in killed:
                    cluster.start_stage(DeviceSpec(name, slowdown=args.slowdowns[1]))
                cluster.wait_for_stages(len(NAMES), timeout_s=120)
            exact = all(
                torch.allclose(report.state_dict[k], v, rtol=1e-5, atol=1e-6)
                for k, v in plain.state_dict.items()
            )
            recovery = report.recoveries[0] if report.recoveries else {}
            emit({"bench": BENCH, "section": "killed", "replicate_every": period,
                  "killed_after": args.kill_after,
                  "restart_s": round(float(recovery.get("restart_s", 0.0)), 3),
                  "replayed": recovery.get("replayed"), "depth": recovery.get("depth"),
                  "stages_after": len(report.training_plan.stages)
                  if report.training_plan is not None else None,
                  "samples_s": round(report.samples_per_s, 2), "weights_exact": exact,
                  "load": loadavg()})  # fmt: skip
            ratios["killed_over_recover_throughput"] = round(
                report.samples_per_s / statistics.median(speeds[f"recover_every_{period}"]), 3
            )
            ratios["killed_weights_exact"] = exact
    summary(BENCH, **ratios, load=loadavg())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
