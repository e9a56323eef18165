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
count). Each repeat runs both.

The summary: ``recover_every_R_over_async_throughput`` per period, the killed
run's ``killed_over_recover_throughput``, and ``async_fast_over_exact_progress_lost``
(the mean of fast's lost over the mean of exact's; issue 30's goal < 0.5). Load
makes the numbers noisy: the load average is printed beside them.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench._common import emit, loadavg, on_alarm, summary
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
    **extra: Any,
) -> tuple[TrainReport, list[int]]:  # fmt: skip
    """A run whose stage b is SIGKILLed once mini-batch ``kill_after``'s loss is back
    (started again afterwards); the report and every step's loss callback, in order."""
    killed: list[str] = []
    seen: list[int] = []

    def on_step(step: int, _loss: float) -> None:
        seen.append(step)
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


def fast_vs_exact(
    cluster: LocalCluster, spec: ModelSpec, data: list[Any], args: argparse.Namespace
) -> dict[str, Any]:
    """The ``fast_vs_exact`` section (see the module notes): its summary keys."""
    lost: dict[str, list[int]] = {"exact": [], "fast": []}
    systems = {
        "exact": {"recover": True, "replicate_every": args.global_every},
        "fast": {"recover": True, "live_copies": True, "consistency": "fast",
                 "chain_every": args.chain_every, "global_every": args.global_every},
    }  # fmt: skip
    points = args.fast_kill_after or [args.kill_after]
    for repeat, kill_after in ((r, k) for r in range(args.repeats) for k in points):
        for name, extra in systems.items():
            report, seen = killed_run(cluster, spec, data, kill_after, args.slowdowns[1], **extra)
            recovery = report.recoveries[0] if report.recoveries else {}
            if name == "exact":
                acked = acknowledged_at_death(seen)
                count = acked - int(recovery.get("resumed_from", acked))
            else:  # nothing is sent again: the coordinator resumed at the count
                acked = int(recovery.get("resumed_at", -1))
                count = int(recovery.get("progress_lost", 0))
            lost[name].append(count)
            emit({"bench": BENCH, "section": "fast_vs_exact", "system": name, "repeat": repeat,
                  "killed_after": kill_after, "acknowledged_at_death": acked,
                  "resumed_at": recovery.get("resumed_at", recovery.get("resumed_from")),
                  "progress_lost": count, "lost_per_unit": recovery.get("lost_per_unit"),
                  "unit_sources": recovery.get("unit_sources"),
                  "restart_s": round(float(recovery.get("restart_s", 0.0)), 3),
                  "steps": report.steps, "samples_s": round(report.samples_per_s, 2),
                  "load": loadavg()})  # fmt: skip
    exact = statistics.mean(lost["exact"])
    ratio = statistics.mean(lost["fast"]) / exact if exact > 0 else None
    return {
        "async_fast_over_exact_progress_lost": None if ratio is None else round(ratio, 3),
        "fast_progress_lost": lost["fast"],
        "exact_progress_lost": lost["exact"],
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
    parser.add_argument("--timeout", type=int, default=900, help="seconds for the whole bench")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(args.timeout)
    h = args.hidden
    spec = ModelSpec("mlp", {"dims": [64, h, h, h, 10], "activation": "relu"}, seed=1)
    data = batches(args.steps, args.batch_size, 64)
    devices = [DeviceSpec(n, slowdown=s) for n, s in zip(NAMES, args.slowdowns, strict=True)]
    systems: dict[str, dict[str, Any]] = {"async": {}}
    for r in args.periods:
        systems[f"recover_every_{r}"] = {"recover": True, "replicate_every": r}
    speeds: dict[str, list[float]] = {k: [] for k in systems}
    ratios: dict[str, Any] = {}
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
