"""FTPipeHD's Table III shape in real runs: an asynchronous 1F1B run's time per epoch
after a stage dies, and its recovery time, under three recoveries.

One LocalCluster of four emulated devices on loopback (``--slowdowns``, default
a 12x, b 12x, c 60x, d 12x: c five times slower than the others, every device slowed
so that the emulated sleeps, not this machine's two shared cores, set the pace;
``--bandwidth-mbps`` emulated data links, default 300), an MLP of ``--units`` (13)
equal layers of ``--hidden`` (256), Adam, ``--batch-size`` (64) random samples per
mini-batch, cut 4 | 4 | 1 | 4 (:func:`partition_of`: c, the slow one, holds one layer).
Each trial trains ``--steps`` mini-batches (``schedule="async-1f1b"``) and SIGKILLs
b once mini-batch ``--kill-after``'s loss is back (b is started again after the
trial). The stage after b is the slow c, so a recovery that hands b's units to the
next stage hurts most there. The recoveries (each a ``fit`` option set of zpipe,
nothing modelled):

* ``light``: FTPipeHD's (``consistency="fast"``, ``live_copies=True``, chain copies
  every ``--chain-every`` (25), global every ``--global-every`` (50): FTPipeHD's 50 and
  100 halved, so that a chain copy exists before the kill): the survivors keep their
  weights, b's units come from c's chain copy, and eq. 5 re-cuts the survivors over
  the capacities the run measured (a live re-partition that looks after 5 mini-batches,
  then every ``--look-every``, and never moves, gain 0.99, so eq. 5 has measured
  capacities);
* ``respipe``: ResPipe's (``recovery="respipe"``: the stage after the dead one takes
  all of its units, :func:`zpipe.recovery.replanning.respipe_replan`). zpipe's fast
  recovery re-cuts by eq. 5 only, so this runs under exact consistency (flush
  replicas every ``--kill-after - 2`` mini-batches: one just before the kill, none in
  the measured window); what the run does after the failure is the same: c runs b's
  units and its own;
* ``heavy``: heavy rescheduling (``recovery="heavy"``, exact consistency, the same
  replicas): the coordinator plans the survivors from scratch with its training
  planner, which first profiles every survivor (each trial's model has a seed of its
  own, so no profile is cached), then every unit's weights come from the replica.
  ``heavy_cached`` (``--heavy-cached``): the same again on the same model, profiles
  cached, which splits heavy's recovery time into profiling and the rest;
* ``light_one_look`` (``--one-look``): light with one look only (after mini-batch 5),
  which splits light's time after the failure into the looks and the rest.

A trial that fails (say, b died before its first chain copy reached c: under load
a copy takes many mini-batches) is a line with ``error``, left out of the medians;
the bench then exits 1. A cluster that fails (it did not start, or its coordinator
went away) ends the bench with the summary's ``error``. The cluster's process logs
(``--log-level``, default warning) are kept when a trial or the cluster failed, or
with ``--log-dir``: the directory is named on stderr and in the summary's ``logs``.

Per trial (one JSON line): ``recovery_s``, from the client's notice of the death to
the first mini-batch completed after it (detection, the same heartbeats for every
recovery, is left out: ``detection_s``, kill to notice; ``kill_to_first_step_s``
is their sum; losses in flight past b still come back after the kill); ``restart_s`` (the
client's: notice to the survivors running); ``epoch_s``, the time per
``--epoch-steps`` mini-batches after the failure, from the rate over the mini-batches
from 5 past the resume point to the end (each at the last time its loss came back);
``epoch_s_before``, the same over steps 5 to ``--kill-after - 3`` on the starting
cuts (the exact runs' flush before ``--kill-after - 2`` left out), and
``after_over_before``, their ratio: the trial's own yardstick of how fast the
machine was then; the cuts after; ``stage_ms_after``, each stage's busy ms per
mini-batch after the failure (which stage set the pace); for light, which copy each
of b's units came from (``unit_sources``, ``copies_used``) and the mini-batches of
progress each unit lost (``lost_per_unit``); and the load.

Why one trial says little on this machine: a device's emulated slowdown stretches
its compute by ``(factor - 1)`` times the compute thread's CPU time, on top of the
wall time the step took, and under a load of L runnable threads per core the wall
time is about L times the CPU time. A stage's time per unit is then about
``(L + factor - 1) x cpu``: at load 1, ResPipe's c (5 units at 15x) against light's
a (7 at 3x) is 75 / 21 = 3.6; at L = 10 (load 20 on two cores), 120 / 84 = 1.4,
whatever the cuts. And the rate of one configuration alone spreads 2-3x between
two runs a minute apart under that load. So each repeat runs the systems side by
side, in an order reversed every other repeat, and the key is the median over
repeats of each repeat's own ratio. The defaults keep the emulated work far above
the real one for the same reason: layers of 256 (about a quarter of the CPU time of
512) on devices four times slower than the 3x / 15x of the first version of this
bench (``--hidden 512 --slowdowns 3 3 15 3``), so the emulated times are about the
same on an idle machine and the load's share is a quarter of what it was.

Summary: ``async_light_over_respipe_epoch_time_after_failure`` (ResPipe's epoch time
after the failure over light's in the same repeat, the median over repeats; issue
30's goal >= 1.5, FTPipeHD reports 6.9; each repeat's in ``light_over_respipe_per_
repeat``, the ratio of the medians in ``light_over_respipe_of_medians``, and the
median of ResPipe's ``after_over_before`` over light's in ``light_over_respipe_
after_over_before``: the load each trial ran at divided out) and
``async_heavy_over_light_recovery_time`` (heavy's recovery time over light's; goal
>= 5), the per-recovery medians, and ``..._with_detection`` (kill to first step).
The other issue 30 keys come from their own benches: ``async_replication_throughput_
cost`` from ``bench/async_replication.py``, ``async_fast_over_exact_progress_lost``
from ``bench/async_recovery.py``, ``ftpipehd_over_pipedream_time_to_loss`` with
``measured_over_bound`` from ``bench/training_async.py``.

Run: ``.venv/bin/python bench/async_after_failure.py`` (three repeats; about 10
minutes on two cores at load 10) or ``--quick`` (fewer steps, three repeats, heavy in
the first only: about 4 minutes).
"""

from __future__ import annotations

import argparse
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench._common import emit, loadavg, on_alarm, summary
from bench.async_recovery import rate_after
from zpipe._errors import PipelineError, ZpipeError
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.models import ModelSpec

BENCH = "async_after_failure"
NAMES = ["a", "b", "c", "d"]


def partition_of(units: int) -> list[list[int]]:
    """The cuts every trial starts from: 4 | 4 | 1 | the rest (c, the slow one, one layer)."""
    return [[0, 4], [4, 8], [8, 9], [9, units]]


ADAM = {"name": "adam", "lr": 1e-3}
SYSTEMS = ("light", "light_one_look", "respipe", "heavy", "heavy_cached")


def recovery_options(system: str, args: argparse.Namespace) -> dict[str, Any]:
    """The fit options of one recovery (see the module notes)."""
    if system in ("light", "light_one_look"):
        # light_one_look: the capacities of one look (after mini-batch 5), none after
        every = args.look_every if system == "light" else 10**6
        return {"recover": True, "live_copies": True, "consistency": "fast",
                "chain_every": args.chain_every, "global_every": args.global_every,
                "repartition": {"first": 5, "every": every, "gain": 0.99}}  # fmt: skip
    policy = "respipe" if system == "respipe" else "heavy"
    return {"recover": True, "replicate_every": args.kill_after - 2, "recovery": policy}


def first_step_after(stamps: Sequence[tuple[int, float]], at: float) -> float | None:
    """Seconds from ``at`` to the first loss that came back after it (None: none did)."""
    later = [t for _, t in stamps if t > at]
    return None if not later else min(later) - at


def epoch_time(stamps: Sequence[tuple[int, float]], start: int, epoch_steps: int) -> float | None:
    """Seconds per ``epoch_steps`` mini-batches at the rate over the steps from ``start``
    on (:func:`bench.async_recovery.rate_after`); None without a rate."""
    rate = rate_after(stamps, start)
    return None if rate is None or rate <= 0 else epoch_steps / rate


def rate_between(stamps: Sequence[tuple[int, float]], first: int, last: int) -> float | None:
    """Mini-batches per second over steps ``first``..``last`` (each at the last time its
    loss came back), as :func:`bench.async_recovery.rate_after` counts them; None with
    fewer than two."""
    return rate_after([(s, t) for s, t in stamps if s <= last], first)


def epoch_time_before(
    stamps: Sequence[tuple[int, float]], kill_after: int, epoch_steps: int
) -> float | None:
    """Seconds per ``epoch_steps`` mini-batches before the failure, on the cuts every
    trial starts from: steps 5 to ``kill_after - 3`` (the exact runs' replica flush
    before mini-batch ``kill_after - 2`` left out): the trial's own yardstick of the
    machine's speed at the time, against which its time after the failure is read."""
    rate = rate_between(stamps, 5, kill_after - 3)
    return None if rate is None or rate <= 0 else epoch_steps / rate


def stage_ms(stages: Mapping[str, Any]) -> dict[str, float]:
    """Each stage's busy milliseconds per mini-batch in the run's last attempt (after the
    failure): which stage set the pace."""
    out = {}
    for name, counters in stages.items():
        done = counters.get("microbatches") if isinstance(counters, Mapping) else None
        busy = counters.get("busy_s") if isinstance(counters, Mapping) else None
        if isinstance(done, int) and done > 0 and isinstance(busy, (int, float)):
            out[name] = round(1000.0 * busy / done, 1)
    return out


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _over(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else round(a / b, 3)


_MEDIAN_KEYS = (
    "epoch_s",
    "epoch_s_before",
    "after_over_before",
    "recovery_s",
    "kill_to_first_step_s",
    "restart_s",
)


def after_failure_summary(trials: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The summary keys from the trials' lines (``system``, ``epoch_s``,
    ``recovery_s``, ``kill_to_first_step_s``): per system the medians, and the issue's
    two ratios (None where a side has no figure)."""
    medians: dict[str, dict[str, float | None]] = {}
    for system in SYSTEMS:
        rows = [t for t in trials if t.get("system") == system]
        if rows:
            medians[system] = {key: _median([r.get(key) for r in rows]) for key in _MEDIAN_KEYS}
    light, respipe = medians.get("light", {}), medians.get("respipe", {})
    heavy = medians.get("heavy", {})
    pairs = paired_ratios(trials, "respipe", "light", "epoch_s")
    normalised = paired_ratios(trials, "respipe", "light", "after_over_before")
    return {
        # the median over repeats of ResPipe's epoch over light's in the same repeat (run
        # side by side, so at about the same load); without pairs, of the medians
        "async_light_over_respipe_epoch_time_after_failure": (
            round(statistics.median(pairs), 3)
            if pairs
            else _over(respipe.get("epoch_s"), light.get("epoch_s"))
        ),
        "light_over_respipe_per_repeat": pairs,
        "light_over_respipe_of_medians": _over(respipe.get("epoch_s"), light.get("epoch_s")),
        # each side's epoch after over its own before (the same cuts, the same trial):
        # the load each trial ran at divided out
        "light_over_respipe_after_over_before": (
            round(statistics.median(normalised), 3) if normalised else None
        ),
        "async_heavy_over_light_recovery_time": _over(
            heavy.get("recovery_s"), light.get("recovery_s")
        ),
        "async_heavy_over_light_recovery_time_with_detection": _over(
            heavy.get("kill_to_first_step_s"), light.get("kill_to_first_step_s")
        ),
        "by_system": {
            s: {k: None if v is None else round(v, 3) for k, v in m.items()}
            for s, m in medians.items()
        },
    }


def paired_ratios(
    trials: Sequence[Mapping[str, Any]], top: str, bottom: str, key: str
) -> list[float]:
    """``top``'s ``key`` over ``bottom``'s in each repeat where both have one."""
    out = []
    for repeat in sorted({t.get("repeat") for t in trials if t.get("repeat") is not None}):
        row = {t.get("system"): t.get(key) for t in trials if t.get("repeat") == repeat}
        a, b = row.get(top), row.get(bottom)
        ratio = _over(a, b)
        if ratio is not None:
            out.append(ratio)
    return out


def order_of(systems: Sequence[str], repeat: int) -> list[str]:
    """The systems' order in ``repeat``: reversed every other repeat, so that none is
    always the first to run after the warm-up (or always at the load's same phase)."""
    return list(systems) if repeat % 2 == 0 else list(reversed(systems))


def batches(
    count: int, size: int, width: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, width, generator=generator), torch.randint(0, 10, (size,)))
        for _ in range(count)
    ]


def trial(
    cluster: LocalCluster, spec: ModelSpec, data: list[Any], system: str,
    args: argparse.Namespace, devices: Mapping[str, DeviceSpec],
) -> dict[str, Any]:  # fmt: skip
    """One killed run under ``system``: its JSON line."""
    stamps: list[tuple[int, float]] = []
    killed_at: list[float] = []

    def on_step(step: int, _loss: float) -> None:
        stamps.append((step, time.monotonic()))
        if step == args.kill_after and not killed_at:
            killed_at.append(time.monotonic())
            cluster.kill("b")

    try:
        report = cluster.fit(
            spec, data, optimizer=ADAM, num_microbatches=1, schedule="async-1f1b",
            partition=partition_of(args.units), stage_names=NAMES, progress=False,
            on_step=on_step,
            **recovery_options(system, args),
        )  # fmt: skip
    except PipelineError as exc:  # recorded, and the next trial goes on
        return {"bench": BENCH, "system": system, "error": str(exc), "load": loadavg()}
    finally:
        if killed_at:
            cluster.start_stage(devices["b"])
        cluster.wait_for_stages(len(NAMES), timeout_s=args.start_timeout)
    recovery = report.recoveries[0] if report.recoveries else {}
    noticed = recovery.get("noticed_at")
    resumed = recovery.get("resumed_at", recovery.get("resumed_from"))
    start = None if resumed is None else int(resumed) + 5
    plan = report.training_plan
    after = None if start is None else epoch_time(stamps, start, args.epoch_steps)
    before = epoch_time_before(stamps, args.kill_after, args.epoch_steps)
    fast = {
        key: recovery.get(key)
        for key in ("copies_used", "lost_per_unit", "unit_sources")
        if key in recovery
    }
    # losses in flight past b can still come back after the kill: the recovery's first
    # step is the first loss after the client's notice
    first = None if noticed is None else first_step_after(stamps, float(noticed))
    detection = None if noticed is None or not killed_at else float(noticed) - killed_at[0]
    return {
        "bench": BENCH,
        "system": system,
        "recovery_s": first,
        "detection_s": detection,
        "kill_to_first_step_s": None if detection is None or first is None else detection + first,
        "restart_s": recovery.get("restart_s"),
        "epoch_s": after,
        "epoch_s_before": before,
        "after_over_before": _over(after, before),
        "resumed_at": resumed,
        "cuts_after": None
        if plan is None
        else [[s.devices[0], s.start, s.end] for s in plan.stages],
        "eq5": recovery.get("eq5"),
        "progress_lost": recovery.get("progress_lost"),
        **fast,  # light: which copy each of b's units came from, and what each lost
        "stage_ms_after": stage_ms(report.stages),
        "load": loadavg(),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=".venv/bin/python bench/async_after_failure.py",
        description="An asynchronous run's time per epoch and recovery time after a stage "
        "dies: FTPipeHD's light recovery against ResPipe and heavy rescheduling. JSON lines, "
        "then a summary.",
    )
    p.add_argument("--slowdowns", type=float, nargs=4, default=[12.0, 12.0, 60.0, 12.0])
    p.add_argument("--bandwidth-mbps", type=float, default=300.0)
    p.add_argument("--units", type=int, default=13, help="equal MLP layers (at least 10)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=76, help="mini-batches per trial")
    p.add_argument("--kill-after", type=int, default=40, help="b dies after this step's loss")
    p.add_argument("--epoch-steps", type=int, default=100, help="mini-batches an epoch counts")
    p.add_argument("--chain-every", type=int, default=25)
    p.add_argument("--global-every", type=int, default=50)
    p.add_argument(
        "--look-every", type=int, default=10, help="light: mini-batches between its looks"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--heavy-repeats",
        type=int,
        default=None,
        help="repeats that run heavy (and heavy_cached), the first ones (default: all); "
        "heavy's recovery time is its profiling, seconds against light's fraction of one",
    )
    p.add_argument("--systems", default="light,respipe,heavy", help="comma-separated")
    p.add_argument("--heavy-cached", action="store_true", help="add heavy_cached")
    p.add_argument("--one-look", action="store_true", help="add light_one_look")
    p.add_argument("--heartbeat-s", type=float, default=0.3)
    p.add_argument("--suspect-after", type=int, default=3)
    p.add_argument("--probe-intervals", type=int, default=2)
    p.add_argument("--timeout", type=int, default=1800, help="seconds for the whole bench")
    p.add_argument(
        "--start-timeout",
        type=float,
        default=300.0,
        help="seconds for the stages to start (and b again after each kill): each imports "
        "torch, 25-40 s under load on two cores",
    )
    p.add_argument(
        "--quick", action="store_true", help="fewer steps, three repeats, heavy in the first only"
    )
    p.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="keep the cluster's process logs here (default: a temporary directory, "
        "removed unless a trial or the cluster failed: then kept, and named on stderr "
        "and in the summary's logs)",
    )
    p.add_argument("--log-level", default="warning", help="the cluster's processes' log level")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.kill_after = 3, 40, 22
        args.chain_every, args.global_every = 10, 20
        if args.heavy_repeats is None:
            args.heavy_repeats = 1
    if args.units < 10:
        raise SystemExit("--units must be at least 10")
    if not 3 <= args.kill_after < args.steps - 8 or args.steps > 2 * (args.kill_after - 2):
        raise SystemExit(
            "--kill-after must leave 8 steps after it, and --steps at most 2 x (--kill-after - 2) "
            "(the exact runs' second replica would fall in the measured window)"
        )
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if args.one_look:
        systems.insert(1, "light_one_look")
    if args.heavy_cached:
        systems.append("heavy_cached")
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(args.timeout)
    devices = {
        n: DeviceSpec(n, slowdown=s, bandwidth_mbps=args.bandwidth_mbps)
        for n, s in zip(NAMES, args.slowdowns, strict=True)
    }
    dims = [args.hidden] * (args.units + 1)
    lines: list[dict[str, Any]] = []
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="zpipe-after-failure-"))
    error = None
    try:
        run_trials(args, systems, devices, dims, lines, log_dir)
    except ZpipeError as exc:  # the cluster did not start, or its coordinator went away
        error = f"{type(exc).__name__}: {exc}"
    except BaseException:  # interrupted, or the bench's own timeout: the logs stay
        print(f"{BENCH}: the cluster's logs are in {log_dir}", file=sys.stderr)
        raise
    failed = [line["system"] for line in lines if "error" in line]
    keep = args.log_dir is not None or bool(failed) or error is not None
    if keep:  # the next failure is diagnosable from the processes' own logs
        print(f"{BENCH}: the cluster's logs are in {log_dir}", file=sys.stderr)
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    result = after_failure_summary(lines)
    summary(BENCH, **result, failed_trials=failed, error=error,
            logs=str(log_dir) if keep else None, load=loadavg())  # fmt: skip
    return 1 if failed or error is not None else 0


def run_trials(
    args: argparse.Namespace, systems: Sequence[str], devices: dict[str, DeviceSpec],
    dims: list[int], lines: list[dict[str, Any]], log_dir: Path,
) -> None:  # fmt: skip
    """Every repeat's trials on one cluster, each trial's line emitted and kept in ``lines``."""
    with LocalCluster(
        list(devices.values()), heartbeat_interval_s=args.heartbeat_s,
        suspect_after=args.suspect_after, probe_intervals=args.probe_intervals,
        log_level=args.log_level, start_timeout_s=args.start_timeout, log_dir=log_dir,
    ) as cluster:  # fmt: skip
        # b started again after each kill as it started: with the cluster's threads
        devices = {d.name: d for d in cluster.devices}
        for repeat in range(args.repeats):
            # a model of its own per repeat: heavy profiles it afresh (nothing cached)
            spec = ModelSpec("mlp", {"dims": dims, "activation": "relu"}, seed=100 + repeat)
            data = batches(args.steps, args.batch_size, args.hidden, seed=repeat)
            cluster.fit(
                spec,
                data[:6],
                optimizer=ADAM,
                num_microbatches=1,
                schedule="async-1f1b",
                partition=partition_of(args.units),
                stage_names=NAMES,
                progress=False,
            )  # fmt: skip  (untimed: the stages warm up)
            for system in order_of(systems, repeat):
                if system.startswith("heavy") and repeat >= (args.heavy_repeats or args.repeats):
                    continue
                line = {**trial(cluster, spec, data, system, args, devices), "repeat": repeat}
                emit(line)
                lines.append(line)


if __name__ == "__main__":
    raise SystemExit(main())
