"""``bench/recovery.py``'s consistency, stall and restart section: training runs
with a stage killed, their weights against an undisturbed run (split out of that
script to keep it small; behaviour unchanged).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from bench._common import emit
from bench._recovery_rebalance import (
    _train,
    _train_single_process,
)
from bench._recovery_stream import (
    BENCH,
    Batch,
    _mean,
    _ratio,
)
from zpipe import ZpipeError
from zpipe.client import TrainReport
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.log import read_events
from zpipe.models import ModelSpec
from zpipe.recovery import DeadlinePolicy

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
    for record in read_events(text, *FAULT_EVENTS):
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
