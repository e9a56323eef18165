"""A pipeline client's re-scheduling when a device of its home slows down (Eco-FL
section 4.4 and Fig. 13, in small): ``resched_over_static_throughput_after_slowdown``.

A home of four emulated devices (Jetson Xavier NX, TX2 and two Nanos, ``--slowdown``
1, 1.5, 3, 3 times a scale that fits this machine's cores, as
``bench/_federated_pipeline.py``) trains a client's MLP as a
:class:`~zpipe.federated.pipeline_trainer.PipelineTrainer`, one local task
(``--steps`` mini-batches of 32, FedProx's SGD) after another; every slowdown is
scaled by at least :data:`MIN_SCALE`. ``--slow-at-s``
seconds after its first compute, the TX2 gets an external load: it computes
``--factor`` times slower from then on (a ``--slowdown-schedule``, as Fig. 13's
external GPU workload on device 2). Each arm is a fresh home, the same tasks:

- ``resched``: Eco-FL's re-scheduling between tasks
  (:mod:`zpipe.federated.home_resched`: the next task after a departure trains on
  a new plan, device order included);
- ``static``: the first plan throughout (``reschedule=None``);
- ``rebalance`` (``--arms resched,static,rebalance``): the first plan at every
  task's start, its cuts moved between neighbours during the task (a synchronous
  run's ``rebalance`` 0.2 at replicas every 3 mini-batches; the order kept), what
  zpipe did for a slow device before a home re-scheduled.

A task's throughput is its samples over its training time (the run's own
``elapsed_s``: from the first mini-batch fed to the last loss, as Fig. 13 plots
training speed); ``*_task_wall`` figures divide by the task's whole wall time
instead (the run's planning and set-up included: what a federated client's task
takes). Tasks that started at least
``--slow-at-s`` plus the first task's wall time after the first task began are
"after" (the slowdown had begun before they started: a stage's clock starts at
its first forward, inside the first task); those that ended before ``--slow-at-s``
are "before" (the first task, torch's warm-up, left out). A throughput is samples
over seconds summed over those tasks of every repeat (``--repeats``, the arms'
order alternating), so the task that detects the slowdown (slow, in both arms)
counts. ``*_after_over_before`` compares an arm with itself (Fig. 13: how close
it comes back), which the host's load drifting between arms does not bias.

Run: ``python -m bench._federated_resched`` (one JSON line per task, then a summary),
or as a section of ``bench/federated.py`` (:func:`pipeline_resched_section`, flags
``--pipeline-resched-*``, ``--skip-pipeline-resched``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emit, loadavg, summary
from bench._federated_pipeline import slowdown_scale
from zpipe.federated.model import MLPShape, init_weights
from zpipe.federated.pipeline_trainer import PipelineTrainer

BENCH = "federated_resched"
HOME = ("nx", "tx2", "nano", "nano")
# the pipeline-client bench's model: wide enough that compute sets the pace
DIMS = [64, 512, 512, 512, 512, 10]
BATCH = 32
# micro-batches of 8 or more (bench/_federated_pipeline.py says why)
MICROBATCH_SIZES = (8, 16, 32)
SLOWED = "tx20"
ARMS = ("resched", "static", "rebalance")
DEFAULT_ARMS = ("resched", "static")
# the rebalance arm's share and replica period (mini-batches)
REBALANCE, REBALANCE_EVERY = 0.2, 3
# emulated compute well above a message's overhead (a few ms under load), so that a
# device's slowdown shows in its times: a Nano computes 30x this machine's speed
MIN_SCALE = 10.0


def load_schedule(slow_at_s: float, factor: float) -> str:
    return f"0:1,{slow_at_s:g}:{factor:g}"


def task_rows(
    starts: Sequence[float],
    walls: Sequence[float],
    trains: Sequence[float],
    samples: int,
    slow_at_s: float,
) -> list[dict[str, Any]]:
    """Each task's offset, wall time, throughput and phase (before, after, or the
    task during which the slowdown began: "change")."""
    first = starts[0]
    after_from = slow_at_s + walls[0]
    rows = []
    for i, (start, wall, train) in enumerate(zip(starts, walls, trains, strict=True)):
        offset = start - first
        if offset >= after_from:
            phase = "after"
        elif offset + wall <= slow_at_s:
            phase = "before"
        else:
            phase = "change"
        rows.append(
            {
                "start_s": round(offset, 3),
                "wall_s": round(wall, 3),
                "train_s": round(train, 3),
                "samples_per_s": round(samples / train, 2),
                "phase": phase,
                "warmup": i == 0,
            }
        )
    return rows


def phase_throughput(
    rows: Sequence[dict[str, Any]], phase: str, samples: int, *, seconds: str = "train_s"
) -> float | None:
    """Samples over ``seconds``, summed over the tasks of ``phase`` (an arm's first task,
    which starts the stages' torch, is left out)."""
    chosen = [r for r in rows if r["phase"] == phase and not r["warmup"]]
    if not chosen:
        return None
    return len(chosen) * samples / sum(r[seconds] for r in chosen)


async def run_arm(arm: str, args: argparse.Namespace, scale: float) -> dict[str, Any]:
    shape = MLPShape.from_dims(DIMS)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * 16, DIMS[0]))
    y = rng.integers(0, DIMS[-1], size=len(x))
    weights = init_weights(shape, np.random.default_rng(1))
    starts: list[float] = []
    walls: list[float] = []
    trains: list[float] = []
    plans: list[Any] = []
    async with PipelineTrainer(
        home=HOME,
        slowdown_scale=scale,
        microbatch_sizes=MICROBATCH_SIZES,
        reschedule=args.threshold if arm == "resched" else None,
        rebalance=REBALANCE if arm == "rebalance" else None,
        rebalance_every=REBALANCE_EVERY,
        load_schedules={SLOWED: load_schedule(args.slow_at_s, args.factor)},
        threads=1,
        start_timeout_s=300.0,
    ) as trainer:
        for task in range(args.tasks):
            started = time.perf_counter()
            weights = await trainer.train(
                weights,
                shape,
                x,
                y,
                steps=args.steps,
                batch_size=BATCH,
                lr=0.05,
                mu=0.05,
                rng=np.random.default_rng(100 + task),
            )
            walls.append(time.perf_counter() - started)
            starts.append(started)
            plan, report = trainer.last_plan, trainer.last_report
            assert plan is not None and report is not None
            trains.append(report.elapsed_s)
            plans.append(
                {
                    "devices": plan.devices,
                    "cuts": [[s.start, s.end] for s in plan.stages],
                    "microbatch_size": plan.microbatch_size,
                    # mini-batches after which the task moved cuts (the rebalance arm)
                    "rebalanced_at": [r.get("at") for r in report.rebalances],
                }
            )
            emit(
                {
                    "bench": BENCH,
                    "arm": arm,
                    "task": task,
                    "wall_s": round(walls[-1], 3),
                    "train_s": round(trains[-1], 3),
                    "plan": plans[-1],
                    "look": trainer.reschedules[-1] if trainer.reschedules else None,
                    "loadavg": loadavg(),
                }
            )
        looks = list(trainer.reschedules)
    samples = args.steps * BATCH
    rows = task_rows(starts, walls, trains, samples, args.slow_at_s)
    for row, plan in zip(rows, plans, strict=True):
        row["plan"] = plan
    return {
        "tasks": rows,
        "rescheduled_after_tasks": [e["task"] for e in looks if e["rescheduled"]],
        "reordered": any(e.get("reordered") for e in looks),
    }


def pooled(runs: Sequence[dict[str, Any]], samples: int) -> dict[str, Any]:
    """An arm's repeats as one: throughputs over every repeat's tasks of a phase."""
    rows = [row for run in runs for row in run["tasks"]]
    return {
        "tasks": rows,
        "before": phase_throughput(rows, "before", samples),
        "after": phase_throughput(rows, "after", samples),
        "wall_before": phase_throughput(rows, "before", samples, seconds="wall_s"),
        "wall_after": phase_throughput(rows, "after", samples, seconds="wall_s"),
        "rescheduled_after_tasks": [run["rescheduled_after_tasks"] for run in runs],
        "reordered": any(run["reordered"] for run in runs),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def figures(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    res, static = arms.get("resched"), arms.get("static")
    for arm in ("resched", "rebalance"):
        got = arms.get(arm)
        if got and static and got["after"] and static["after"]:
            out[f"{arm}_over_static_throughput_after_slowdown"] = round(
                got["after"] / static["after"], 3
            )
            out[f"{arm}_over_static_task_wall_after_slowdown"] = round(
                got["wall_after"] / static["wall_after"], 3
            )
    rebalanced = arms.get("rebalance")
    if res and rebalanced and res["after"] and rebalanced["after"]:
        out["resched_over_rebalance_throughput_after_slowdown"] = round(
            res["after"] / rebalanced["after"], 3
        )
    for arm, got in arms.items():
        for phase in ("before", "after"):
            value = got[phase]
            out[f"{arm}_samples_per_s_{phase}"] = None if value is None else round(value, 2)
        if got["before"] and got["after"]:
            # Fig. 13: how close to its pre-slowdown throughput each arm comes back
            out[f"{arm}_after_over_before"] = round(got["after"] / got["before"], 3)
    if res:
        out["resched_after_tasks"] = res["rescheduled_after_tasks"]
        out["resched_reordered"] = res["reordered"]
    out["series"] = {
        arm: [[r["start_s"], r["samples_per_s"], r["phase"]] for r in got["tasks"]]
        for arm, got in arms.items()
    }
    return out


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    cores = os.cpu_count() or 1
    scale = args.scale or max(MIN_SCALE, slowdown_scale(1, cores))
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in args.arms}
    for repeat in range(args.repeats):
        # alternate which arm goes first: the host's load drifts over minutes
        order = args.arms if repeat % 2 == 0 else args.arms[::-1]
        for arm in order:
            runs[arm].append(await run_arm(arm, args, scale))
    samples = args.steps * BATCH
    arms = {arm: pooled(got, samples) for arm, got in runs.items()}
    out = figures(arms)
    if "resched" in runs and "static" in runs:
        out["resched_over_static_after_per_repeat"] = [
            _ratio(pooled([a], samples)["after"], pooled([b], samples)["after"])
            for a, b in zip(runs["resched"], runs["static"], strict=True)
        ]
    out["plans"] = {arm: [r["plan"] for r in got["tasks"]] for arm, got in arms.items()}
    out.update(
        home=list(HOME),
        dims=DIMS,
        batch=BATCH,
        slowed=SLOWED,
        factor=args.factor,
        slow_at_s=args.slow_at_s,
        threshold=args.threshold,
        slowdown_scale=scale,
        tasks=args.tasks,
        steps=args.steps,
        repeats=args.repeats,
    )
    return out


# bench/federated.py's section: the flags its summary takes, prefixed, and --quick's
# smaller run (one repeat of fewer tasks: a smoke run, not a figure)
SECTION_DEFAULTS: dict[str, Any] = {
    "tasks": 10, "repeats": 2, "steps": 12, "slow_at_s": 15.0, "factor": 4.0,
}  # fmt: skip
QUICK = {"tasks": 6, "repeats": 1}
# the standalone run's keys that would be ambiguous in bench/federated.py's summary
_SECTION_RENAMED = (
    "home", "dims", "batch", "slowed", "factor", "slow_at_s", "threshold",
    "slowdown_scale", "tasks", "steps", "repeats",
)  # fmt: skip


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--skip-pipeline-resched",
        action="store_true",
        help="leave out the re-scheduling section (Fig. 13 in small)",
    )
    for name, default in SECTION_DEFAULTS.items():
        flag = "--pipeline-resched-" + name.replace("_", "-")
        p.add_argument(flag, type=type(default), default=None, help=f"default {default:g}")


def section_args(args: argparse.Namespace) -> argparse.Namespace:
    """The standalone run's settings from bench/federated.py's flags (``--quick``:
    :data:`QUICK` where a flag is not given)."""
    quick = QUICK if getattr(args, "quick", False) else {}
    values = {}
    for name, default in SECTION_DEFAULTS.items():
        given = getattr(args, f"pipeline_resched_{name}")
        values[name] = given if given is not None else quick.get(name, default)
    return argparse.Namespace(**values, threshold=0.5, scale=None, arms=list(DEFAULT_ARMS))


def check_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    error = settings_error(section_args(args))
    if error:
        p.error(error.replace("--", "--pipeline-resched-"))


def settings_error(args: argparse.Namespace) -> str:
    """Why the settings cannot make a run ('' when they can)."""
    if (
        args.tasks < 3
        or args.steps < 1
        or args.repeats < 1
        or not args.slow_at_s > 0
        or not args.factor >= 1
    ):
        return "--tasks >= 3, --steps >= 1, --slow-at-s > 0 and --factor >= 1"
    if not args.threshold > 0 or (args.scale is not None and not args.scale > 0):
        return "--threshold and --scale must be > 0"
    return ""


def pipeline_resched_section(args: argparse.Namespace) -> dict[str, Any]:
    """bench/federated.py's section: the figures, the per-task series and plans left
    to the task lines; the set-up keys prefixed ``resched_``."""
    load = loadavg()
    started = time.perf_counter()
    out = asyncio.run(_measure(section_args(args)))
    for key in ("series", "plans"):
        out.pop(key, None)
    for key in _SECTION_RENAMED:
        out[f"resched_{key}"] = out.pop(key)
    out["resched_wall_s"] = round(time.perf_counter() - started, 1)
    out["resched_loadavg_start"] = load
    emit({"bench": BENCH, "section": "resched", **out, "loadavg": loadavg()})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=10, help="local tasks an arm")
    p.add_argument("--repeats", type=int, default=2, help="runs of each arm, alternating")
    p.add_argument("--steps", type=int, default=12, help="mini-batches of 32 a task")
    p.add_argument("--slow-at-s", type=float, default=15.0, help="when the TX2 slows down")
    p.add_argument("--factor", type=float, default=4.0, help="how much slower it gets")
    p.add_argument("--threshold", type=float, default=0.5, help="the re-scheduling threshold")
    p.add_argument(
        "--scale", type=float, default=None, help=f"default: fit the cores, at least {MIN_SCALE:g}"
    )
    p.add_argument(
        "--arms",
        default=",".join(DEFAULT_ARMS),
        help=f"some of {','.join(ARMS)} (default {','.join(DEFAULT_ARMS)})",
    )
    args = p.parse_args(argv)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not args.arms or set(args.arms) - set(ARMS):
        p.error(f"--arms must name some of {ARMS}")
    error = settings_error(args)
    if error:
        p.error(error)
    load = loadavg()
    started = time.perf_counter()
    out = asyncio.run(_measure(args))
    summary(
        BENCH,
        **out,
        wall_s=round(time.perf_counter() - started, 1),
        loadavg_start=load,
        loadavg=loadavg(),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
