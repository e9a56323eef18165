"""Recovery from a killed stage: lightweight re-planning against heavy re-planning and
ResPipe's policy, on an inference stream over an emulated heterogeneous cluster.

One :class:`~zpipe.cluster.LocalCluster` of four emulated devices (``nx-a`` and
``nx-b`` at 1x, ``tx2`` at 1.5x, ``nano`` at 3x slower, every slowdown multiplied by
one factor that keeps the busy devices within half this machine's cores, as
``bench/inference.py`` explains; 200 Mbit/s links) streams ``--batches`` batches of a
shrunk ViT-Base through the PipeEdge plan the coordinator makes from the stages' own
profiles. After ``--kill-after`` outputs one stage of that plan is killed (SIGKILL);
the coordinator notices the silence (heartbeats, suspect, probe, dead), re-plans by
the run's recovery policy, reassigns the survivors under a new epoch, and the client
replays every micro-batch without a result. Each stage of the plan is killed in turn
under each policy:

* ``lightweight`` (Asteroid section 3.4): the surviving stages keep their order and
  their boundaries move so that each stage's profiled work matches its speed;
* ``heavy``: the full PipeEdge planner over the survivors (from cached profiles and
  measured links, so no profiling happens during recovery);
* ``respipe``: the stage after the dead one takes all of its units.

Per trial (one JSON line): ``detection_s`` (how long the stage had been silent when
the coordinator declared it dead), ``replan_s`` (from then until the survivors were
reassigned and connected), ``recovery_s`` (from the kill to the first output after
the client got the new plan: what a user waits), the throughput before the kill and
after recovery (outputs after the first new-plan output, over their time), both
plans, and whether every output arrived once and equals a single-process run. The
killed stage is then started again and one untimed run lets it profile and build,
so every trial begins from the same cluster.

Training, on the same cluster (``--skip-training`` leaves it out): the model is
trained with ``fit(recover=True, replicate_every=R)`` for ``--train-steps``
mini-batches (SGD with momentum) on the coordinator's HPP plan, and after
``--train-kill-after`` mini-batches one device of the plan is killed, under each
policy in turn. Per trial: ``detection_s`` (from the kill to the client's notice),
``restart_s`` (from the notice until the survivors run again from the replica),
``recovery_s`` (from the kill to the first mini-batch completed after it: the
issue's "failure to first completed step"), mini-batches replayed, throughput before
and after, both plans, and ``weights_exact`` (the trained weights equal
single-process training on the same mini-batches).

Slow stages (``--skip-rebalance`` leaves it out): the even partition over the four
devices, where the 3x slower nano holds as many units as the others, is trained as
it is and with ``fit(rebalance=0.2)``, which moves units off the slow stage at a
replica once its measured speed shows; ``rebalanced_over_static_throughput`` is the
ratio of their steady throughputs over the second half of the run.

Consistency, stall detection and coordinator restart (``--skip-consistency``,
``--skip-detection``, ``--skip-restart``), on a second cluster of the same devices
whose coordinator suspects a stage only after ``--slow-suspect-after`` (default 10)
silent heartbeats of ``--heartbeat-s`` and keeps its state in a directory
(``state_dir``). Each run trains ``--fault-steps`` mini-batches (epochs of eight
distinct ones, SGD at a step size that learns) with ``replicate_every=``
``--fault-replicate-every``; the stage in the middle of the HPP plan is killed after
mini-batch ``--fault-kill-after`` (between two replicas):

* ``exact`` against ``fast`` consistency (both with fit's default stall deadline):
  ``recovery_s`` (kill to the first mini-batch completed after it: under ``exact`` a
  replay of one the replica had not kept), ``progress_s`` (kill to the first
  mini-batch past those completed before it), ``retrained_minibatches`` (losses
  reported again), the whole run's ``wall_s`` and its final and last-epoch losses;
* detection with the stall deadline (the ``exact`` run above) against heartbeats
  alone (the same run with a deadline that never passes): ``detection_s`` is the kill
  to the coordinator's ``stage_dead`` (its log's timestamps against ``time.time()`` at
  the kill), ``suspected_by`` what made it probe (``stall`` or the heartbeats);
* the coordinator SIGKILLed after mini-batch ``--restart-after`` (default: just
  before a replica, so the client's next request waits for the new coordinator: the
  worst place) and started again at once, against the same run uninterrupted:
  ``restored_s`` (kill to the new coordinator's ``coordinator_restored``),
  ``next_replica_s`` (kill to the first replica it kept), ``overhead_s`` (extra wall
  time), and the weights, which must equal the uninterrupted run's bit for bit with
  no recovery (else the bench exits 1).

A run of these that fails is recorded as a line with ``error`` (listed in the
summary's ``fault_failed_runs``; the bench then exits 1) and the cluster is brought
back before the next one.

``--repeats`` runs each of these that many times (means in the summary).

Summary: per section and policy the means; the issue's ratios
``heavy_over_light_recovery_time``, ``light_over_heavy_throughput_after`` and
``light_over_respipe_throughput_after`` for training, and the same with an
``inference_`` prefix for the stream; ``fast_over_exact_recovery_time``,
``fast_over_exact_progress_time``, ``fast_over_exact_wall_time``,
``exact_retrained_minibatches``, ``fast_retrained_minibatches``,
``stall_over_heartbeat_detection_time`` (lower is better) with
``stall_detection_s`` and ``heartbeat_detection_s``, ``coordinator_restart_overhead_s``
and ``restart_weights_exact``.

Liveness (``--skip-liveness`` leaves it out), on clusters of their own with the
first section's heartbeat settings and no stage killed, so every ``stage_dead`` in
the coordinator's log is a live stage declared dead:

* ``false_deaths_under_load``: ``--liveness-steps`` mini-batches trained with
  ``recover=True`` and a replica every mini-batch while ``--burners`` busy-loop
  processes (default: twice the cores) take the CPU;
* ``false_deaths_slow_links``: the same run without burners, every stage's outgoing
  data link emulated at ``--slow-link-mbps`` (default 20 Mbit/s) and a replica (bulk
  state to the coordinator) every mini-batch. zpipe's emulation caps the data links
  only; the replicas cross the control socket at loopback speed, so this measures
  heartbeats against bulk traffic, not against a capped uplink;
* ``detection_time_s``: one stage of an idle cluster SIGKILLed; the kill to the
  coordinator's ``stage_dead``. ``detection_over_heartbeat_interval`` is its ratio to
  ``--heartbeat-s``; ``detection_beyond_suspect_deadline_intervals`` the time past
  the victim's adaptive suspect deadline (logged with ``stage_suspect``), in
  intervals (goal: 3 or less); ``detection_adaptive_deadline_s`` its suspect plus
  probe deadlines.

Caveats: four stage processes, the coordinator and this client share two cores;
detection is set by the heartbeat settings (``--heartbeat-s``, suspect after
``--suspect-after`` silent intervals, dead after ``--probe-intervals`` more);
inference needs no weight transfer (every stage builds its units from the model
spec), and training here uses global replication, so every stage restores its
units from the coordinator's replica under any policy: heavy and lightweight
re-planning differ in planning time and in the plan they pick. With chain
replication heavy recovery also gathers every unit at the coordinator and
lightweight moves only the units that change hands; ``bench/recovery_weights.py``
measures that difference on ViT-Base's units over 100 Mbit/s links.

Run: ``.venv/bin/python bench/recovery.py`` (about 9 minutes on two cores, 3 of them
in the last sections) or ``--quick`` (fewer batches and victims, 16 mini-batches in
the last sections: about 4 minutes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench._common import emit, loadavg, summary
from zpipe import ZpipeError
from zpipe.client import RunReport, TrainReport
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.log import configure_logging
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence
from zpipe.planner import even_ranges
from zpipe.recovery import POLICIES, DeadlinePolicy

BENCH = "recovery"
Batch = tuple[torch.Tensor, ...]

# (name, slowdown before scaling): Jetson Xavier NX, TX2 and Nano, roughly.
DEVICES = (("nx-a", 1.0), ("nx-b", 1.0), ("tx2", 1.5), ("nano", 3.0))
BANDWIDTH_MBPS = 200.0
HOST_CORE_SHARE = 0.5  # see bench/inference.py


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=".venv/bin/python bench/recovery.py",
        description="Recovery of an inference stream from a killed stage: lightweight "
        "re-planning against heavy re-planning and ResPipe. Prints JSON lines, then a summary.",
    )
    p.add_argument("--batches", type=int, default=60, help="batches per stream (default: 60)")
    p.add_argument("--batch-size", type=int, default=2, help="samples per batch (default: 2)")
    p.add_argument("--kill-after", type=int, default=15, help="outputs before the kill")
    p.add_argument("--max-in-flight", type=int, default=3, help="micro-batches in flight")
    p.add_argument("--layers", type=int, default=6, help="ViT-Base blocks kept (default: 6)")
    p.add_argument("--hidden", type=int, default=384, help="hidden size (default: 384)")
    p.add_argument("--heartbeat-s", type=float, default=0.3, help="heartbeat interval")
    p.add_argument("--suspect-after", type=int, default=3, help="silent intervals to suspect")
    p.add_argument("--probe-intervals", type=int, default=2, help="intervals a probe waits")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policies")
    p.add_argument("--max-victims", type=int, default=4, help="stages killed per policy")
    p.add_argument("--slowdown-scale", type=float, default=None, help="default: fit the cores")
    p.add_argument("--train-steps", type=int, default=16, help="mini-batches per training run")
    p.add_argument("--train-batch-size", type=int, default=8, help="samples per mini-batch")
    p.add_argument("--train-microbatches", type=int, default=4, help="micro-batches each")
    p.add_argument("--train-kill-after", type=int, default=7, help="mini-batches before the kill")
    p.add_argument("--replicate-every", type=int, default=4, help="mini-batches between replicas")
    p.add_argument("--skip-inference", action="store_true", help="leave the stream section out")
    p.add_argument("--skip-training", action="store_true", help="leave the training section out")
    p.add_argument("--skip-rebalance", action="store_true", help="leave the slow-stage section out")
    p.add_argument("--rebalance", type=float, default=0.2, help="rebalance share (default: 0.2)")
    p.add_argument(
        "--fault-steps", type=int, default=24, help="mini-batches per run of the last sections"
    )
    p.add_argument(
        "--fault-replicate-every", type=int, default=8, help="their replica period (default: 8)"
    )
    p.add_argument(
        "--fault-kill-after", type=int, default=5, help="mini-batches before a stage is killed"
    )
    p.add_argument(
        "--fault-victim", default=None, help="the stage killed (default: the plan's middle one)"
    )
    p.add_argument(
        "--restart-after",
        type=int,
        default=None,
        help="mini-batches before the coordinator is killed (default: the replica period - 1)",
    )
    p.add_argument(
        "--slow-suspect-after",
        type=int,
        default=10,
        help="silent intervals to suspect, on the cluster of the last sections (default: 10)",
    )
    p.add_argument("--repeats", type=int, default=1, help="trials of each kind, last sections")
    p.add_argument("--skip-consistency", action="store_true", help="leave exact/fast out")
    p.add_argument("--skip-detection", action="store_true", help="leave the stall deadline out")
    p.add_argument("--skip-restart", action="store_true", help="leave the coordinator restart out")
    p.add_argument("--skip-liveness", action="store_true", help="leave false deaths out")
    p.add_argument(
        "--burners", type=int, default=None, help="busy processes (default: twice the cores)"
    )
    p.add_argument(
        "--slow-link-mbps", type=float, default=20.0, help="emulated data links (default: 20)"
    )
    p.add_argument("--liveness-steps", type=int, default=12, help="mini-batches per liveness run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="fewer batches and victims")
    return p


@dataclass
class Trial:
    policy: str
    victim: str
    report: RunReport
    outputs: list[Batch]
    arrivals: list[float]  # time.monotonic() of each output
    killed_at: float


def _scale(threads: int, cores: int) -> float:
    demand = sum(threads / s for _, s in DEVICES)
    return max(1.0, math.ceil(4.0 * demand / (HOST_CORE_SHARE * cores)) / 4.0)


def _throughput(arrivals: list[float], samples_per_output: int) -> float | None:
    if len(arrivals) < 2 or arrivals[-1] <= arrivals[0]:
        return None
    return (len(arrivals) - 1) * samples_per_output / (arrivals[-1] - arrivals[0])


def _trial_line(trial: Trial, reference: list[Batch], batch_size: int) -> dict[str, Any]:
    recoveries = trial.report.recoveries
    recovered = recoveries[0] if recoveries else None
    before = [t for t in trial.arrivals if t <= trial.killed_at]
    after: list[float] = []
    if recovered is not None:
        after = [t for t in trial.arrivals if t >= recovered["at"]]
    exact = len(trial.outputs) == len(reference) and all(
        torch.allclose(got[0], want[0], rtol=1e-4, atol=1e-5)
        for got, want in zip(trial.outputs, reference, strict=True)
    )
    return {
        "bench": BENCH,
        "kind": "inference",
        "policy": trial.policy,
        "victim": trial.victim,
        "recovered": recovered is not None,
        "detection_s": recovered["detected_s"] if recovered else None,
        "replan_s": recovered["recovered_s"] if recovered else None,
        "recovery_s": (after[0] - trial.killed_at) if after else None,
        "replayed": recovered["replayed"] if recovered else None,
        "throughput_before": _throughput(before, batch_size),
        "throughput_after": _throughput(after, batch_size),
        "plan_after": trial.report.plan.to_dict()["stages"],
        "outputs_exact": exact,
    }


def _stream(
    cluster: LocalCluster,
    spec: ModelSpec,
    batches: list[Batch],
    args: argparse.Namespace,
    *,
    policy: str = "lightweight",
    victim: str | None = None,
) -> Trial:
    arrivals: list[float] = []
    killed_at = [math.inf]

    def progress(received: int, _sent: int) -> None:
        arrivals.append(time.monotonic())
        if victim is not None and received == args.kill_after:
            killed_at[0] = time.monotonic()
            cluster.kill(victim)

    outputs, report = cluster.infer(
        spec,
        batches,
        planner="pipeedge",
        microbatch_size=args.batch_size,
        max_in_flight=args.max_in_flight,
        recovery=policy,
        progress=progress,
    )
    return Trial(policy, victim or "", report, outputs, arrivals, killed_at[0])


OPTIMIZER = {"name": "sgd", "lr": 0.05, "momentum": 0.9}


@dataclass
class TrainTrial:
    policy: str
    victim: str
    report: TrainReport
    steps: list[tuple[int, float]]  # (mini-batch, time.monotonic()) of each completed one
    killed_at: float


def _train(
    cluster: LocalCluster,
    spec: ModelSpec,
    batches: list[Batch],
    args: argparse.Namespace,
    *,
    policy: str = "lightweight",
    victim: str | None = None,
) -> TrainTrial:
    steps: list[tuple[int, float]] = []
    killed_at = [math.inf]

    def on_step(step: int, _loss: float) -> None:
        steps.append((step, time.monotonic()))
        if victim is not None and step == args.train_kill_after and killed_at[0] == math.inf:
            killed_at[0] = time.monotonic()
            cluster.kill(victim)

    report = cluster.fit(
        spec,
        batches,
        optimizer=OPTIMIZER,
        num_microbatches=args.train_microbatches,
        progress=False,
        on_step=on_step,
        recover=True,
        replicate_every=args.replicate_every,
        recovery=policy,
    )
    return TrainTrial(policy, victim or "", report, steps, killed_at[0])


def _train_single_process(
    spec: ModelSpec, batches: list[Batch], settings: dict[str, Any] = OPTIMIZER
) -> dict[str, torch.Tensor]:
    model = build_full_model(spec).train()
    assert settings["name"] == "sgd"
    optimizer = torch.optim.SGD(
        model.parameters(), lr=settings["lr"], momentum=settings["momentum"]
    )
    for *inputs, labels in batches:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(*inputs)[0], labels).backward()
        optimizer.step()
    return model.state_dict()


def _train_line(
    trial: TrainTrial, reference: dict[str, torch.Tensor], batch_size: int
) -> dict[str, Any]:
    report = trial.report
    recovered = report.recoveries[0] if report.recoveries else None
    before = [t for _, t in trial.steps if t <= trial.killed_at]
    after = [t for _, t in trial.steps if t > trial.killed_at]
    exact = set(report.state_dict) == set(reference) and all(
        torch.allclose(report.state_dict[k].float(), v.float(), rtol=1e-4, atol=1e-5)
        for k, v in reference.items()
    )
    tplan = report.training_plan
    return {
        "bench": BENCH,
        "kind": "training",
        "policy": trial.policy,
        "victim": trial.victim,
        "recovered": recovered is not None,
        "detection_s": recovered["noticed_at"] - trial.killed_at if recovered else None,
        "restart_s": recovered.get("restart_s") if recovered else None,
        "recovery_s": (after[0] - trial.killed_at) if after else None,
        "resumed_from": recovered["resumed_from"] if recovered else None,
        "replayed": recovered["replayed"] if recovered else None,
        "replicas": report.replicas,
        "throughput_before": _throughput(before, batch_size),
        "throughput_after": _throughput(after, batch_size),
        "plan_after": tplan.describe() if tplan is not None else None,
        "weights_exact": exact,
    }


def _recorder(steps: list[tuple[int, float]]) -> Callable[[int, float], None]:
    def on_step(step: int, _loss: float) -> None:
        steps.append((step, time.monotonic()))

    return on_step


def _rebalance_section(
    cluster: LocalCluster, spec: ModelSpec, batches: list[Batch], args: argparse.Namespace
) -> dict[str, Any]:
    """The even partition (the slow nano as heavy as the rest) trained as it is, and
    with ``rebalance``: steady throughput over the second half of the run."""
    names = [name for name, _ in DEVICES]
    partition = [list(r) for r in even_ranges(load_layer_sequence(spec).num_units, len(names))]
    out: dict[str, Any] = {}
    for label, share in (("static", None), ("rebalanced", args.rebalance)):
        steps: list[tuple[int, float]] = []
        report = cluster.fit(
            spec,
            batches,
            optimizer=OPTIMIZER,
            num_microbatches=args.train_microbatches,
            partition=partition,
            stage_names=names,
            recover=True,
            replicate_every=args.replicate_every,
            rebalance=share,
            progress=False,
            on_step=_recorder(steps),
        )
        tail = [t for step, t in steps if step >= len(batches) // 2]
        tplan = report.training_plan
        line = {
            "bench": BENCH,
            "kind": "rebalance",
            "system": label,
            "rebalance": share,
            "throughput_second_half": _throughput(tail, args.train_batch_size),
            "rebalanced_at": [r["at"] for r in report.rebalances],
            "plan_after": tplan.describe() if tplan is not None else None,
        }
        emit(line)
        print(
            f"  even partition, {label}: {line['throughput_second_half']} samples/s in the "
            f"second half, moves at {line['rebalanced_at']}",
            file=sys.stderr,
            flush=True,
        )
        out[label] = line
    return {
        "rebalanced_over_static_throughput": _ratio(
            out["rebalanced"]["throughput_second_half"], out["static"]["throughput_second_half"]
        ),
        "rebalanced_at": out["rebalanced"]["rebalanced_at"],
    }


# --------------------------------------------------------- consistency, stalls, restart

# A deadline that never passes: the client never reports a stall, so only the
# heartbeats (suspect after --slow-suspect-after silent intervals) find a dead stage.
NO_STALL_DEADLINE = DeadlinePolicy(floor_s=1e6, cold_start_s=1e6)
# OPTIMIZER's step size makes these longer runs diverge (losses of 10 to 40), and a
# diverging run amplifies float rounding past any tolerance; this one learns: the
# loss over FAULT_EPOCH_BATCHES distinct mini-batches, seen again each epoch, falls.
FAULT_OPTIMIZER = {"name": "sgd", "lr": 0.005, "momentum": 0.9}
FAULT_EPOCH_BATCHES = 8
FAULT_EVENTS = frozenset(
    {"stage_dead", "stage_suspect", "stall_reported", "coordinator_restored", "replica_kept"}
)


@dataclass
class FaultTrial:
    """One run of the last sections: ``victim`` killed after mini-batch ``kill_after``
    (``"coordinator"``: killed and started again at once)."""

    label: str
    victim: str
    report: TrainReport
    steps: list[tuple[int, float]]  # (mini-batch, time.monotonic()), replays included
    killed_at: float  # time.monotonic() at the kill
    killed_wall: float  # time.time() at the kill, for the coordinator's log timestamps
    wall_s: float  # the whole fit call
    events: list[dict[str, Any]]  # the coordinator's events logged during the run


def _coordinator_events(text: str) -> list[dict[str, Any]]:
    """The coordinator's JSON log lines named in :data:`FAULT_EVENTS`, each with ``t``
    (its timestamp as seconds since the epoch)."""
    found: list[dict[str, Any]] = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or record.get("event") not in FAULT_EVENTS:
            continue
        stamp = record.get("timestamp")
        if isinstance(stamp, str):
            record["t"] = datetime.fromisoformat(stamp).timestamp()
            found.append(record)
    return found


def _fit_killing(
    cluster: LocalCluster,
    spec: ModelSpec,
    batches: list[Batch],
    args: argparse.Namespace,
    *,
    label: str,
    victim: str | None,
    kill_after: int,
    consistency: str = "exact",
    stall_deadline: DeadlinePolicy | None = None,
) -> FaultTrial:
    steps: list[tuple[int, float]] = []
    killed = [math.inf, math.inf]
    log_before = len(cluster.logs("coordinator"))

    def on_step(step: int, _loss: float) -> None:
        steps.append((step, time.monotonic()))
        if victim is not None and step == kill_after and killed[0] == math.inf:
            killed[:] = [time.monotonic(), time.time()]
            cluster.kill(victim)
            if victim == "coordinator":
                cluster.restart_coordinator()

    started = time.monotonic()
    report = cluster.fit(
        spec,
        batches,
        optimizer=FAULT_OPTIMIZER,
        num_microbatches=args.train_microbatches,
        progress=False,
        on_step=on_step,
        recover=True,
        replicate_every=args.fault_replicate_every,
        consistency=consistency,
        stall_deadline=stall_deadline,
    )
    wall_s = time.monotonic() - started
    events = _coordinator_events(cluster.logs("coordinator")[log_before:])
    return FaultTrial(label, victim or "", report, steps, killed[0], killed[1], wall_s, events)


def _weights_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(want) and all(
        torch.allclose(got[k].float(), v.float(), rtol=1e-4, atol=1e-5) for k, v in want.items()
    )


def _weights_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())


def _last_before(trial: FaultTrial) -> int:
    """The newest mini-batch completed before the kill (-1: none)."""
    return max((step for step, t in trial.steps if t <= trial.killed_at), default=-1)


def _after_kill(trial: FaultTrial, event: str, **match: Any) -> dict[str, Any] | None:
    """The coordinator's first ``event`` (with fields ``match``) logged after the kill."""
    for record in trial.events:
        if record["event"] != event or record["t"] < trial.killed_wall:
            continue
        if all(record.get(k) == v for k, v in match.items()):
            return record
    return None


def _fault_line(
    trial: FaultTrial, consistency: str, detection: str, want: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """A stage killed mid-run: when the coordinator declared it dead, what the client
    waited, what was trained twice, and what the run cost in all."""
    report = trial.report
    # the victim's recovery: a live stage wrongly declared dead recovers too, and is
    # listed in ``recoveries`` (each one rolls back and re-trains under exact)
    recovered = next((r for r in report.recoveries if r["dead"] == trial.victim), None)
    after = [(step, t) for step, t in trial.steps if t > trial.killed_at]
    last_before = _last_before(trial)
    seen: set[int] = set()
    retrained = 0
    for step, _ in trial.steps:
        retrained += step in seen
        seen.add(step)
    dead = _after_kill(trial, "stage_dead", stage=trial.victim)
    suspect = _after_kill(trial, "stage_suspect", stage=trial.victim)
    stalls = [
        e for e in trial.events if e["event"] == "stall_reported" and e["t"] >= trial.killed_wall
    ]
    progress = [t for step, t in after if step > last_before]
    return {
        "bench": BENCH,
        "kind": "training_kill",
        "label": trial.label,
        "consistency": consistency,
        "detection": detection,
        "victim": trial.victim,
        "killed_after": last_before,
        "recovered": recovered is not None,
        "recoveries": [r["dead"] for r in report.recoveries],
        # the kill to the coordinator's stage_dead (its log's clock)
        "detection_s": dead["t"] - trial.killed_wall if dead else None,
        "suspected_by": (suspect.get("reason") or "heartbeat") if suspect else None,
        "stalls_reported": len(stalls),
        "noticed_s": recovered["noticed_at"] - trial.killed_at if recovered else None,
        "restart_s": recovered.get("restart_s") if recovered else None,
        # the kill to the first mini-batch completed after it (a replay, under exact)
        "recovery_s": after[0][1] - trial.killed_at if after else None,
        # the kill to the first mini-batch past those completed before it
        "progress_s": progress[0] - trial.killed_at if progress else None,
        "resumed_from": recovered["resumed_from"] if recovered else None,
        "replica": recovered["replica"] if recovered else None,
        "replayed": recovered["replayed"] if recovered else None,
        "retrained_minibatches": retrained,
        "trained_minibatches": len(trial.steps),
        "wall_s": trial.wall_s,
        "elapsed_s": report.elapsed_s,
        "final_loss": report.losses[-1] if report.losses else None,
        "last_epoch_loss": _mean(list(report.losses[-FAULT_EPOCH_BATCHES:])),
        "weights_exact": _weights_close(report.state_dict, want),
    }


def _restart_line(trial: FaultTrial, baseline: FaultTrial) -> dict[str, Any]:
    """The coordinator killed mid-run and started again, against the same run
    uninterrupted: the extra wall time, when the new one was up and kept a replica."""
    restored = _after_kill(trial, "coordinator_restored")
    replica = _after_kill(trial, "replica_kept")
    got, want = trial.report.state_dict, baseline.report.state_dict
    diffs = [(got[k].float() - v.float()).abs().max().item() for k, v in want.items() if k in got]
    return {
        "bench": BENCH,
        "kind": "coordinator_restart",
        "killed_after": _last_before(trial),
        "restored_s": restored["t"] - trial.killed_wall if restored else None,
        "restored_run": restored.get("run") if restored else None,
        "next_replica_s": replica["t"] - trial.killed_wall if replica else None,
        "next_replica_step": replica.get("step") if replica else None,
        "wall_s": trial.wall_s,
        "uninterrupted_wall_s": baseline.wall_s,
        "overhead_s": trial.wall_s - baseline.wall_s,
        "recoveries": len(trial.report.recoveries),
        "replicas": trial.report.replicas,
        "uninterrupted_replicas": baseline.report.replicas,
        "losses_equal": trial.report.losses == baseline.report.losses,
        "weights_exact": _weights_equal(got, want),
        "weights_max_abs_diff": max(diffs, default=None),
    }


def _fault_section(
    devices: dict[str, DeviceSpec],
    spec: ModelSpec,
    batches: list[Batch],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Exact against fast consistency, heartbeats against the stall deadline, and the
    coordinator restarted mid-run, on a cluster of its own (slower heartbeat detection,
    a state directory, info-level coordinator log for the events)."""
    want = _train_single_process(spec, batches, FAULT_OPTIMIZER)
    kill_after, restart_after = args.fault_kill_after, args.restart_after
    kills: list[dict[str, Any]] = []
    restarts: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="zpipe-bench-state-") as state,
        LocalCluster(
            list(devices.values()),
            heartbeat_interval_s=args.heartbeat_s,
            suspect_after=args.slow_suspect_after,
            probe_intervals=args.probe_intervals,
            log_level="info",
            state_dir=Path(state),
        ) as cluster,
    ):

        def revive() -> None:
            """Start again what was killed (or failed), then let newcomers profile."""
            coordinator = cluster.processes["coordinator"]
            if coordinator.poll() is not None:
                cluster.restart_coordinator()
            for name, device in devices.items():
                if cluster.processes[name].poll() is not None:
                    cluster.start_stage(device)
            cluster.wait_for_stages(len(devices), timeout_s=120.0)
            _train(cluster, spec, batches[:2], args)  # the newcomer profiles

        def failed(label: str, exc: ZpipeError, **fields: Any) -> dict[str, Any]:
            """A run that did not survive: recorded (the bench then exits 1), not raised."""
            line = {"bench": BENCH, "label": label, **fields, "recovered": False}
            line["error"] = f"{type(exc).__name__}: {exc}"
            emit(line)
            print(f"  {label}: FAILED {line['error']}", file=sys.stderr, flush=True)
            return line

        warm = _train(cluster, spec, batches[:2], args)  # training profiles
        tplan = warm.report.training_plan
        assert tplan is not None
        # a stage in the middle of the pipeline, with neighbours on both sides
        victim = args.fault_victim or tplan.stages[len(tplan.stages) // 2].devices[0]
        if victim not in devices:
            raise SystemExit(f"--fault-victim: no device {victim!r}; choose from {list(devices)}")
        print(
            f"  fault sections: {len(batches)} mini-batches, replica every "
            f"{args.fault_replicate_every}, kill {victim} after {kill_after}, heartbeats "
            f"suspect after {args.slow_suspect_after} x {args.heartbeat_s} s; plan "
            f"{tplan.describe()}",
            file=sys.stderr,
            flush=True,
        )
        trials: list[tuple[str, str, DeadlinePolicy | None]] = []
        if not (args.skip_consistency and args.skip_detection):
            trials.append(("exact", "stall", None))  # fit's default stall deadline
        if not args.skip_consistency:
            trials.append(("fast", "stall", None))
        if not args.skip_detection:
            trials.append(("exact", "heartbeat", NO_STALL_DEADLINE))
        for repeat in range(args.repeats):
            for consistency, detection, deadline in trials:
                label = f"{consistency}/{detection}"
                try:
                    trial = _fit_killing(
                        cluster,
                        spec,
                        batches,
                        args,
                        label=label,
                        victim=victim,
                        kill_after=kill_after,
                        consistency=consistency,
                        stall_deadline=deadline,
                    )
                except ZpipeError as exc:
                    kind = {"kind": "training_kill", "consistency": consistency}
                    kills.append(
                        failed(
                            label, exc, **kind, detection=detection, victim=victim, repeat=repeat
                        )
                    )
                    revive()
                    continue
                line = {**_fault_line(trial, consistency, detection, want), "repeat": repeat}
                emit(line)
                kills.append(line)
                print(
                    f"  kill {victim}, {consistency}, {detection}: dead after "
                    f"{line['detection_s']} s, recovery {line['recovery_s']} s, retrained "
                    f"{line['retrained_minibatches']}, wall {line['wall_s']:.2f} s",
                    file=sys.stderr,
                    flush=True,
                )
                revive()
            if not args.skip_restart:
                try:
                    baseline = _fit_killing(
                        cluster,
                        spec,
                        batches,
                        args,
                        label="uninterrupted",
                        victim=None,
                        kill_after=-1,
                    )
                    trial = _fit_killing(
                        cluster,
                        spec,
                        batches,
                        args,
                        label="coordinator_restart",
                        victim="coordinator",
                        kill_after=restart_after,
                    )
                except ZpipeError as exc:
                    restarts.append(
                        failed(
                            "coordinator_restart", exc, kind="coordinator_restart", repeat=repeat
                        )
                    )
                    revive()
                    continue
                line = {**_restart_line(trial, baseline), "repeat": repeat}
                line["weights_exact_single_process"] = _weights_close(trial.report.state_dict, want)
                emit(line)
                restarts.append(line)
                print(
                    f"  coordinator killed after {restart_after}: restored after "
                    f"{line['restored_s']} s, next replica after {line['next_replica_s']} s, "
                    f"overhead {line['overhead_s']:.2f} s, weights equal {line['weights_exact']}",
                    file=sys.stderr,
                    flush=True,
                )
    return _fault_summary(kills, restarts, args)


def _fault_summary(
    kills: list[dict[str, Any]], restarts: list[dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    def mean(key: str, consistency: str, detection: str) -> float | None:
        rows = [r for r in kills if (r["consistency"], r["detection"]) == (consistency, detection)]
        return _mean([r.get(key) for r in rows])

    out: dict[str, Any] = {}
    if not args.skip_consistency:
        exact = {k: mean(k, "exact", "stall") for k in ("recovery_s", "progress_s", "wall_s")}
        fast = {k: mean(k, "fast", "stall") for k in ("recovery_s", "progress_s", "wall_s")}
        out.update(
            {
                "fast_over_exact_recovery_time": _ratio(fast["recovery_s"], exact["recovery_s"]),
                "fast_over_exact_progress_time": _ratio(fast["progress_s"], exact["progress_s"]),
                "fast_over_exact_wall_time": _ratio(fast["wall_s"], exact["wall_s"]),
                "exact_retrained_minibatches": mean("retrained_minibatches", "exact", "stall"),
                "fast_retrained_minibatches": mean("retrained_minibatches", "fast", "stall"),
                "exact_recovery_s": exact["recovery_s"],
                "fast_recovery_s": fast["recovery_s"],
                "exact_wall_s": exact["wall_s"],
                "fast_wall_s": fast["wall_s"],
                "exact_final_loss": mean("final_loss", "exact", "stall"),
                "fast_final_loss": mean("final_loss", "fast", "stall"),
                "exact_last_epoch_loss": mean("last_epoch_loss", "exact", "stall"),
                "fast_last_epoch_loss": mean("last_epoch_loss", "fast", "stall"),
            }
        )
    if not args.skip_detection:
        stall = mean("detection_s", "exact", "stall")
        heartbeat = mean("detection_s", "exact", "heartbeat")
        out.update(
            {
                "stall_over_heartbeat_detection_time": _ratio(stall, heartbeat),
                "stall_detection_s": stall,
                "heartbeat_detection_s": heartbeat,
                "stall_over_heartbeat_recovery_time": _ratio(
                    mean("recovery_s", "exact", "stall"), mean("recovery_s", "exact", "heartbeat")
                ),
                "heartbeat_config": {
                    "interval_s": args.heartbeat_s,
                    "suspect_after": args.slow_suspect_after,
                    "probe_intervals": args.probe_intervals,
                },
            }
        )
    if kills:
        out["fault_all_recovered"] = all(r["recovered"] for r in kills)
        # live stages declared dead along the way (each one a recovery of its own)
        out["fault_live_stages_declared_dead"] = sum(
            sum(d != r["victim"] for d in r.get("recoveries", [])) for r in kills
        )
        out["fault_exact_weights_exact"] = all(
            r.get("weights_exact", False) for r in kills if r["consistency"] == "exact"
        )
    if restarts:
        out.update(
            {
                "coordinator_restart_overhead_s": _mean([r.get("overhead_s") for r in restarts]),
                "coordinator_restored_s": _mean([r.get("restored_s") for r in restarts]),
                "coordinator_restart_next_replica_s": _mean(
                    [r.get("next_replica_s") for r in restarts]
                ),
                "coordinator_restart_recoveries": sum(r.get("recoveries", 0) for r in restarts),
                "restart_weights_exact": all(r.get("weights_exact", False) for r in restarts),
            }
        )
    failures = [r for r in kills + restarts if "error" in r]
    if kills or restarts:
        out["fault_failed_runs"] = [f"{r['label']}: {r['error']}" for r in failures]
    return out


# A busy loop that exits once this process's end of its stdin pipe closes, so a
# bench killed without its ``finally`` leaves no burner behind.
_BURNER = """
import os, sys, threading

def exit_when_orphaned() -> None:
    sys.stdin.buffer.read()
    os._exit(0)

threading.Thread(target=exit_when_orphaned, daemon=True).start()
while True:
    pass
"""


def _deaths_in(cluster: LocalCluster, since: int) -> list[dict[str, Any]]:
    """The coordinator's ``stage_dead`` events logged after character ``since``."""
    events = _coordinator_events(cluster.logs("coordinator")[since:])
    return [e for e in events if e["event"] == "stage_dead"]


def _liveness_run(
    devices: list[DeviceSpec],
    spec: ModelSpec,
    batches: list[Batch],
    args: argparse.Namespace,
    *,
    label: str,
    burners: int = 0,
) -> dict[str, Any]:
    """Train with a replica every mini-batch and nothing killed: every stage declared
    dead is a false death (with ``burners`` busy processes taking the CPU from the
    moment the stages have registered: the load is on the run, not on start-up)."""
    busy: list[subprocess.Popen[bytes]] = []
    line: dict[str, Any] = {"bench": BENCH, "kind": "liveness", "label": label}
    line["burners"] = burners
    try:
        with LocalCluster(
            devices,
            heartbeat_interval_s=args.heartbeat_s,
            suspect_after=args.suspect_after,
            probe_intervals=args.probe_intervals,
            log_level="info",
            start_timeout_s=180.0,
        ) as cluster:
            busy += [
                subprocess.Popen([sys.executable, "-c", _BURNER], stdin=subprocess.PIPE)
                for _ in range(burners)
            ]
            started = time.monotonic()
            try:
                report = cluster.fit(
                    spec,
                    batches,
                    optimizer=OPTIMIZER,
                    num_microbatches=args.train_microbatches,
                    progress=False,
                    recover=True,
                    replicate_every=1,
                )
                line["recoveries"] = [r["dead"] for r in report.recoveries]
                line["replicas"] = report.replicas
            except ZpipeError as exc:
                line["error"] = f"{type(exc).__name__}: {exc}"
            line["wall_s"] = time.monotonic() - started
            events = _coordinator_events(cluster.logs("coordinator"))
            deaths = [e for e in events if e["event"] == "stage_dead"]
            line["false_deaths"] = len(deaths)
            line["deaths"] = [f"{e.get('stage')}: {e.get('reason')}" for e in deaths]
            line["suspicions"] = sum(e["event"] == "stage_suspect" for e in events)
    except ZpipeError as exc:  # the cluster did not start under this load
        line["error"] = f"cluster start: {type(exc).__name__}: {exc}"
        line["false_deaths"] = None
    finally:
        for process in busy:
            process.kill()
        for process in busy:
            process.wait(timeout=10)
    line["loadavg"] = loadavg()
    return line


def _detection_trial(
    devices: list[DeviceSpec], args: argparse.Namespace, *, warm_s: float = 10.0
) -> dict[str, Any]:
    """SIGKILL one stage of an idle cluster once its deadlines have samples: the kill
    to the coordinator's ``stage_dead``, against its adaptive deadlines."""
    line: dict[str, Any] = {"bench": BENCH, "kind": "detection", "interval_s": args.heartbeat_s}
    with LocalCluster(
        devices,
        heartbeat_interval_s=args.heartbeat_s,
        suspect_after=args.suspect_after,
        probe_intervals=args.probe_intervals,
        log_level="info",
    ) as cluster:
        victim = devices[-1].name
        time.sleep(warm_s)  # heartbeats fill the victim's window of gaps
        since = len(cluster.logs("coordinator"))
        killed_wall = time.time()
        cluster.kill(victim)
        deadline = time.monotonic() + 120.0
        while time.monotonic() < deadline and not _deaths_in(cluster, since):
            time.sleep(0.05)
        events = _coordinator_events(cluster.logs("coordinator")[since:])
        dead = next((e for e in events if e["event"] == "stage_dead"), None)
        suspect = next(
            (e for e in events if e["event"] == "stage_suspect" and e.get("stage") == victim),
            None,
        )
        line["victim"] = victim
        line["other_deaths"] = sum(
            e["event"] == "stage_dead" and e.get("stage") != victim for e in events
        )
        if dead is None or suspect is None:
            line["error"] = "no stage_dead (or stage_suspect) for the victim within 120 s"
            return line
        detection = dead["t"] - killed_wall
        suspect_s = float(suspect.get("deadline_s") or 0.0)
        probe_s = float(suspect.get("probe_deadline_s") or 0.0)
        line.update(
            {
                "detection_time_s": detection,
                "suspect_deadline_s": suspect_s,
                "probe_deadline_s": probe_s,
                "detection_over_heartbeat_interval": detection / args.heartbeat_s,
                "detection_beyond_suspect_deadline_intervals": (detection - suspect_s)
                / args.heartbeat_s,
                "reason": dead.get("reason"),
            }
        )
    return line


def _liveness_section(
    devices: dict[str, DeviceSpec],
    spec: ModelSpec,
    batches: list[Batch],
    args: argparse.Namespace,
) -> dict[str, Any]:
    cores = os.cpu_count() or 1
    burners = 2 * cores if args.burners is None else args.burners
    plain = list(devices.values())
    slow = [replace(d, bandwidth_mbps=args.slow_link_mbps) for d in plain]
    loaded = _liveness_run(plain, spec, batches, args, label="under_load", burners=burners)
    emit(loaded)
    print(f"  liveness under load: {loaded}", file=sys.stderr, flush=True)
    links = _liveness_run(slow, spec, batches, args, label="slow_links")
    emit(links)
    print(f"  liveness over slow links: {links}", file=sys.stderr, flush=True)
    detection = _detection_trial(plain, args)
    emit(detection)
    print(f"  detection: {detection}", file=sys.stderr, flush=True)
    return {
        "false_deaths_under_load": loaded.get("false_deaths"),
        "false_deaths_under_load_burners": burners,
        "false_deaths_under_load_run_ok": "error" not in loaded,
        "false_deaths_slow_links": links.get("false_deaths"),
        "false_deaths_slow_links_mbps": args.slow_link_mbps,
        "false_deaths_slow_links_run_ok": "error" not in links,
        "detection_time_s": detection.get("detection_time_s"),
        "detection_over_heartbeat_interval": detection.get("detection_over_heartbeat_interval"),
        "detection_beyond_suspect_deadline_intervals": detection.get(
            "detection_beyond_suspect_deadline_intervals"
        ),
        "detection_adaptive_deadline_s": (
            detection["suspect_deadline_s"] + detection["probe_deadline_s"]
            if "suspect_deadline_s" in detection
            else None
        ),
    }


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        args.batches, args.kill_after, args.max_victims, args.layers = 30, 8, 2, 4
        args.train_steps, args.train_kill_after = 10, 5
        args.fault_steps = 16
    if args.restart_after is None:
        args.restart_after = args.fault_replicate_every - 1
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    if not 0 < args.kill_after < args.batches:
        raise SystemExit("--kill-after must lie between 0 and --batches")
    if not 0 < args.train_kill_after < args.train_steps - 1:
        raise SystemExit("--train-kill-after must lie between 0 and --train-steps - 1")
    if not 0 < args.fault_kill_after < args.fault_steps - 1:
        raise SystemExit("--fault-kill-after must lie between 0 and --fault-steps - 1")
    if not 0 <= args.restart_after < args.fault_steps - 1:
        raise SystemExit("--restart-after must lie between 0 and --fault-steps - 1")
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    cores = os.cpu_count() or 1
    threads = max(1, cores // len(DEVICES))
    scale = args.slowdown_scale or _scale(threads, cores)
    devices = {
        name: DeviceSpec(name, slowdown=s * scale, bandwidth_mbps=BANDWIDTH_MBPS, threads=threads)
        for name, s in DEVICES
    }
    spec = ModelSpec.preset(
        "vit-base",
        seed=args.seed,
        num_layers=args.layers,
        hidden=args.hidden,
        heads=6,
        mlp=4 * args.hidden,
        image_size=64,
        patch=16,
        num_classes=10,
    )
    sequence = load_layer_sequence(spec)
    batches = [
        sequence.example_input(args.batch_size, seed=args.seed + i) for i in range(args.batches)
    ]
    model = build_full_model(spec)
    with torch.inference_mode():
        reference = [tuple(model(*b)) for b in batches]
    described = ", ".join(f"{d.name} {d.slowdown:g}x" for d in devices.values())
    print(
        f"recovery bench: devices {described}, {sequence.num_units} units, {args.batches} batches",
        file=sys.stderr,
        flush=True,
    )
    lines: list[dict[str, Any]] = []
    train_lines: list[dict[str, Any]] = []
    generator = torch.Generator().manual_seed(args.seed)
    train_batches: list[Batch] = [
        (
            *sequence.example_input(args.train_batch_size, seed=args.seed + 1000 + i),
            torch.randint(0, 10, (args.train_batch_size,), generator=generator),
        )
        for i in range(args.train_steps)
    ]
    with LocalCluster(
        list(devices.values()),
        heartbeat_interval_s=args.heartbeat_s,
        suspect_after=args.suspect_after,
        probe_intervals=args.probe_intervals,
        log_level="warning",
    ) as cluster:

        def revive(victim: str) -> None:
            cluster.start_stage(devices[victim])
            cluster.wait_for_stages(len(devices), timeout_s=120.0)

        if not args.skip_inference:
            warm = _stream(cluster, spec, batches[:6], args)  # profiles, links, shard builds
            victims = [s.device for s in warm.report.plan.stages][: args.max_victims]
            print(f"  plan {warm.report.plan.to_dict()['stages']}", file=sys.stderr, flush=True)
            for policy in policies:
                for victim in victims:
                    trial = _stream(cluster, spec, batches, args, policy=policy, victim=victim)
                    line = _trial_line(trial, reference, args.batch_size)
                    emit(line)
                    lines.append(line)
                    print(
                        f"  stream, {policy}, kill {victim}: recovery {line['recovery_s']}, "
                        f"after {line['throughput_after']} samples/s, plan {line['plan_after']}",
                        file=sys.stderr,
                        flush=True,
                    )
                    revive(victim)
                    _stream(cluster, spec, batches[:4], args)  # the newcomer profiles, builds
        if not args.skip_training:
            want = _train_single_process(spec, train_batches)
            warm_train = _train(cluster, spec, train_batches[:2], args)  # training profiles
            tplan = warm_train.report.training_plan
            assert tplan is not None
            print(f"  training plan {tplan.describe()}", file=sys.stderr, flush=True)
            train_victims = list(tplan.devices)[: args.max_victims]
            for policy in policies:
                for victim in train_victims:
                    ttrial = _train(
                        cluster, spec, train_batches, args, policy=policy, victim=victim
                    )
                    line = _train_line(ttrial, want, args.train_batch_size)
                    emit(line)
                    train_lines.append(line)
                    print(
                        f"  training, {policy}, kill {victim}: recovery {line['recovery_s']}, "
                        f"after {line['throughput_after']} samples/s, exact "
                        f"{line['weights_exact']}",
                        file=sys.stderr,
                        flush=True,
                    )
                    revive(victim)
                    _train(cluster, spec, train_batches[:2], args)  # the newcomer profiles
        slow = (
            None if args.skip_rebalance else _rebalance_section(cluster, spec, train_batches, args)
        )
    faults = None
    if not (args.skip_consistency and args.skip_detection and args.skip_restart):
        epoch = [
            (
                *sequence.example_input(args.train_batch_size, seed=args.seed + 2000 + i),
                torch.randint(0, 10, (args.train_batch_size,), generator=generator),
            )
            for i in range(FAULT_EPOCH_BATCHES)
        ]
        fault_batches = [epoch[i % len(epoch)] for i in range(args.fault_steps)]
        faults = _fault_section(devices, spec, fault_batches, args)
    liveness = None
    if not args.skip_liveness:
        liveness = _liveness_section(devices, spec, train_batches[: args.liveness_steps], args)
    result: dict[str, Any] = {}
    for prefix, rows_all in (("inference_", lines), ("", train_lines)):
        if not rows_all:
            continue
        by_policy: dict[str, dict[str, float | None]] = {}
        for policy in policies:
            rows = [line for line in rows_all if line["policy"] == policy]
            by_policy[policy] = {
                key: _mean([r.get(key) for r in rows])
                for key in (
                    "recovery_s",
                    "detection_s",
                    "replan_s",
                    "restart_s",
                    "throughput_after",
                    "throughput_before",
                )
            }
        light, heavy = by_policy.get("lightweight", {}), by_policy.get("heavy", {})
        respipe = by_policy.get("respipe", {})
        result.update(
            {
                f"{prefix}heavy_over_light_recovery_time": _ratio(
                    heavy.get("recovery_s"), light.get("recovery_s")
                ),
                f"{prefix}light_over_heavy_throughput_after": _ratio(
                    light.get("throughput_after"), heavy.get("throughput_after")
                ),
                f"{prefix}light_over_respipe_throughput_after": _ratio(
                    light.get("throughput_after"), respipe.get("throughput_after")
                ),
                f"{prefix}by_policy": by_policy,
            }
        )
    result["all_recovered"] = all(line["recovered"] for line in lines + train_lines)
    result["all_outputs_exact"] = all(line["outputs_exact"] for line in lines)
    result["all_weights_exact"] = all(line["weights_exact"] for line in train_lines)
    if slow is not None:
        result.update(slow)
    if faults is not None:
        result.update(faults)
    if liveness is not None:
        result.update(liveness)
    result["slowdown_scale"] = scale
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(level="warning")
    result = run(args)
    summary(BENCH, **result)
    ok = result["all_recovered"] and result["all_outputs_exact"] and result["all_weights_exact"]
    # the last sections: every kill recovered, exact ended exact, and the restarted
    # coordinator neither rolled back nor changed a bit of the weights
    failed = [
        key
        for key, want in (
            ("fault_all_recovered", True),
            ("fault_failed_runs", []),
            ("fault_exact_weights_exact", True),
            ("restart_weights_exact", True),
            ("coordinator_restart_recoveries", 0),
            ("false_deaths_under_load", 0),
            ("false_deaths_slow_links", 0),
        )
        if key in result and result[key] != want
    ]
    if failed:
        print(f"recovery bench: failed checks {failed}", file=sys.stderr, flush=True)
    return 0 if ok and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
