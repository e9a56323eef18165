"""Heavy against lightweight recovery of a ViT-Base training pipeline: weights moved
and recovery time over emulated 100 Mbit/s links; ResPipe's throughput after.

What is real here and what is a model (the cheapest honest way on two shared cores,
where six processes training ViT-Base would measure CPU contention, not links):

* real: ViT-Base's 50 units and each one's parameter bytes (``vit-base`` preset,
  counted without building it) and the optimizer state that travels with them
  (``--optimizer``, SGD with momentum: one copy); zpipe's own decisions, the very
  functions a recovering run calls: the replanning policies
  (:func:`zpipe.recovery.plan_recovery`: lightweight, ResPipe, heavy = the HPP
  planner from scratch over the survivors), the weights each one moves
  (:func:`zpipe.recovery.plan_restore` from chain replicas: each unit from its
  nearest holder; :func:`zpipe.recovery.heavy_restore`: every unit gathered at the
  coordinator, then every device's units sent out), and each planner's wall time,
  measured here (``uptime`` is printed with it);
* a model: the links. Every node (device or coordinator) has one full-duplex
  ``--mbps`` link; a phase's transfers run at once, and the phase lasts as long as
  the busiest node's bytes in or out take (the optimum of preemptive open-shop
  scheduling, reached by fair sharing). Latency, detection and building the new
  units are left out: the same for both policies;
* a model: the compute. A per-unit forward time from the unit's FLOPs (2 x
  parameters x tokens, plus attention's 4 x tokens^2 x hidden), scaled so the whole
  forward of a micro-batch of 8 takes 1.5 s at speed 1 (DESIGN.md's measurement on
  this machine), backward twice that; ``throughput_after`` is zpipe's training cost
  model (:func:`zpipe.planner.training_cost.predict_training`) on the plan each
  policy leaves: samples over the slowest stage's time per micro-batch (compute or
  its links), the rate of a pipeline that never drains (FTPipeHD's asynchronous
  1F1B, whose 6.9x this compares with); ``sync_throughput_after`` is synchronous
  1F1B's with ``--microbatches`` per mini-batch (the schedule simulator), whose
  fill and drain dilute the slowest stage.

Each trial also runs with global replication alone (every unit at the coordinator,
nothing at the stages), where every policy fetches every unit from the coordinator:
the ``global_replication_`` ratios show how little heavy and lightweight differ there.

Cluster: ``--stages`` devices (default 6) with speeds from ``--speeds`` (the first
is the fastest), the straight plan the planner makes over them, chain replication
(each stage's state at the next stage, the last stage's at the coordinator). Each
stage is killed in turn.

Heavy recovery time = gather (every unit not already at the coordinator, from its
nearest live holder) + the planner's time + scatter (every device's units from the
coordinator). Lightweight = its planner's time + the transfers of the units that
change hands. Per trial one JSON line; the summary holds the means and the
issue's ratios ``heavy_over_light_recovery_time`` (goal >= 10; Asteroid reports
14x), ``bytes_moved_light_over_heavy`` and ``light_over_respipe_throughput_after``
(goal >= 1.5; FTPipeHD reports 6.9x faster epochs after a failure).

Run: ``.venv/bin/python bench/recovery_weights.py`` (seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from zpipe.models import ModelSpec, load_layer_sequence
from zpipe.models.size import parameter_bytes
from zpipe.planner.cluster import ClusterDevice, ClusterSpec
from zpipe.planner.hpp import plan_training
from zpipe.planner.profile import ModelProfile, synthetic_profile
from zpipe.planner.training_cost import TrainingCosts, optimizer_state_copies, predict_training
from zpipe.planner.training_plan import TrainingPlan
from zpipe.recovery import (
    COORDINATOR,
    Replica,
    ReplicaPoint,
    Transfer,
    heavy_restore,
    plan_recovery,
    plan_restore,
    stage_spans,
)

# DESIGN.md: a ViT-Base forward of a batch of 8 (197 tokens) takes about 1.5 s here
VIT_FORWARD_S = 1.5
VIT_BATCH = 8
TOKENS = 197
HIDDEN = 768


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", type=int, default=6, help="devices, one stage each")
    p.add_argument(
        "--speeds",
        default="1,0.9,0.8,0.7,0.6,0.5,0.5,0.4",
        help="device speeds (1: the reference machine), the first --stages of them",
    )
    p.add_argument("--mbps", type=float, default=100.0, help="every node's link (Mbit/s)")
    p.add_argument("--optimizer", default="sgd-momentum", help="its state travels too")
    p.add_argument("--microbatch", type=int, default=8, help="samples per micro-batch")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per mini-batch")
    p.add_argument("--memory-gb", type=float, default=8.0, help="each device's memory")
    return p


def vit_base_profile(microbatch: int) -> tuple[ModelProfile, list[int]]:
    """A training profile of ViT-Base's units from their FLOPs, and their parameter bytes."""
    sequence = load_layer_sequence(ModelSpec.preset("vit-base"))
    n = sequence.num_units
    params = [int(parameter_bytes(sequence, u, u + 1) or 0) for u in range(n)]
    flops = []
    for u, nbytes in enumerate(params):
        elements = nbytes // 4
        tokens = 1 if u == n - 1 else TOKENS  # the head reads the class token
        f = 2.0 * elements * tokens
        if u % 4 == 2:  # the attention sub-layer: scores and their weighted sum
            f += 4.0 * TOKENS * TOKENS * HIDDEN
        flops.append(f)
    total = sum(flops)
    forward = [VIT_FORWARD_S * f / total * microbatch / VIT_BATCH for f in flops]
    activation = microbatch * TOKENS * HIDDEN * 4
    outputs = [activation * (3 if u % 4 == 1 else 4 if u % 4 == 3 else 1) for u in range(n)]
    outputs[-1] = microbatch * 1000 * 4
    profile = synthetic_profile(
        forward,
        outputs,
        param_bytes=params,
        memory_bytes=params,
        backward_times_s=[2.0 * t for t in forward],
        activation_bytes=[2 * b for b in outputs],
        input_bytes=microbatch * 3 * 224 * 224 * 4,
        batch_size=microbatch,
    )
    return profile, params


def phase_s(transfers: Sequence[Transfer], unit_bytes: Sequence[int], mbps: float) -> float:
    """How long ``transfers`` take at once when each node has one full-duplex link."""
    sent: dict[str, int] = defaultdict(int)
    received: dict[str, int] = defaultdict(int)
    for t in transfers:
        nbytes = sum(unit_bytes[t.start : t.end])
        sent[t.source] += nbytes
        received[t.dest] += nbytes
    busiest = max([*sent.values(), *received.values()], default=0)
    return busiest * 8 / (mbps * 1e6)


def bottleneck_s(predicted: dict[str, float], microbatches: int) -> float:
    """The slowest stage's time per micro-batch (compute, or its link both ways; a
    group's all-reduce spread over the round's micro-batches): what a pipeline
    that never drains, as FTPipeHD's asynchronous 1F1B, runs at."""
    worst = 0.0
    for i in range(int(predicted["num_stages"])):
        compute = predicted[f"stage{i}_forward_s"] + predicted[f"stage{i}_backward_s"]
        compute += predicted[f"stage{i}_allreduce_s"] / microbatches
        link = predicted[f"stage{i}_send_forward_s"] + predicted[f"stage{i}_send_backward_s"]
        worst = max(worst, compute, link)
    return worst


def chain_point(plan: TrainingPlan, version: int) -> ReplicaPoint:
    """Chain replication's copies: own snapshots, each stage's backup at the next
    stage, the last stage's at the coordinator."""
    spans = stage_spans(plan)
    copies = []
    for i, span in enumerate(spans):
        holder = spans[i + 1].devices[0] if i + 1 < len(spans) else COORDINATOR
        copies.append(Replica(holder, span.start, span.end, version))
    return ReplicaPoint(version, plan, tuple(copies), own_snapshots=True)


def global_point(plan: TrainingPlan, version: int) -> ReplicaPoint:
    """Global replication alone: every unit at the coordinator, nothing kept at the
    stages (how a run with the default replication recovers)."""
    return ReplicaPoint(
        version, plan, (Replica(COORDINATOR, 0, plan.num_units, version),), own_snapshots=False
    )


def _timed(fn: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


def trial(
    old: TrainingPlan,
    victim: str,
    policy: str,
    profile: ModelProfile,
    cluster: ClusterSpec,
    unit_bytes: list[int],
    args: argparse.Namespace,
    replication: str = "chain",
) -> dict[str, Any]:
    failed = {victim}
    recovered, plan_s = _timed(
        lambda: plan_recovery(
            old,
            failed=failed,
            policy=policy,
            profile=profile,
            cluster=cluster,
            optimizer=args.optimizer,
        )
    )
    new = recovered.plan
    point = chain_point(old, 1) if replication == "chain" else global_point(old, 1)
    if policy == "heavy":
        moves = heavy_restore(new, failed=failed, point=point)
        gather_s = phase_s(moves.gather, unit_bytes, args.mbps)
        scatter_s = phase_s(moves.scatter, unit_bytes, args.mbps)
        transfer_s = gather_s + scatter_s
        moved = moves.bytes_moved(unit_bytes)
        transfers = len(moves.transfers)
    else:
        restore = plan_restore(new, failed=failed, points=[point])
        transfer_s = phase_s(restore.moves.transfers, unit_bytes, args.mbps)
        moved = restore.moves.bytes_moved(unit_bytes)
        transfers = len(restore.moves.transfers)
    costs = TrainingCosts(
        profile, cluster, microbatch_size=args.microbatch, optimizer=args.optimizer
    )
    predicted = predict_training(new, costs)
    samples = args.microbatch * args.microbatches
    return {
        "victim": victim,
        "policy": policy,
        "replication": replication,
        "plan_s": round(plan_s, 6),
        "transfer_s": round(transfer_s, 3),
        "recovery_s": round(plan_s + transfer_s, 3),
        "bytes_moved": moved,
        "transfers": transfers,
        "throughput_after": round(args.microbatch / bottleneck_s(predicted, args.microbatches), 4),
        "sync_throughput_after": round(samples / predicted["round_s"], 4),
        "plan": [(list(s.devices), s.start, s.end) for s in new.stages],
    }


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def run(args: argparse.Namespace) -> dict[str, Any]:
    profile, params = vit_base_profile(args.microbatch)
    copies = 1 + optimizer_state_copies(args.optimizer)
    unit_bytes = [p * copies for p in params]  # weights and optimizer state travel
    speeds = [float(s) for s in args.speeds.split(",")][: args.stages]
    if len(speeds) < args.stages:
        raise SystemExit(f"--speeds names {len(speeds)} devices, --stages asks for {args.stages}")
    devices = tuple(
        ClusterDevice(
            f"d{i}",
            memory_bytes=int(args.memory_gb * (1 << 30)),
            speed=speed,
            bandwidth_mbps=args.mbps,
        )
        for i, speed in enumerate(speeds)
    )
    cluster = ClusterSpec(devices)
    old = plan_training(
        profile,
        cluster,
        microbatch_size=args.microbatch,
        num_microbatches=args.microbatches,
        algo="straight",
        optimizer=args.optimizer,
    )
    costs = TrainingCosts(
        profile, cluster, microbatch_size=args.microbatch, optimizer=args.optimizer
    )
    before = args.microbatch / bottleneck_s(predict_training(old, costs), args.microbatches)
    print(
        json.dumps(
            {
                "plan": [(list(s.devices), s.start, s.end) for s in old.stages],
                "model_state_bytes": sum(unit_bytes),
                "throughput_before": round(before, 4),
            }
        ),
        flush=True,
    )
    # the first call of a planner pays for imports and caches: not part of a recovery
    for policy in ("lightweight", "respipe", "heavy"):
        trial(old, old.devices[0], policy, profile, cluster, unit_bytes, args)
    rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for replication in ("chain", "global"):
        for victim in old.devices:
            for policy in ("lightweight", "respipe", "heavy"):
                line = trial(old, victim, policy, profile, cluster, unit_bytes, args, replication)
                rows[policy if replication == "chain" else f"{policy}@global"].append(line)
                print(json.dumps(line), flush=True)
    means = {
        policy: {
            key: _mean([float(r[key]) for r in lines])
            for key in (
                "plan_s",
                "transfer_s",
                "recovery_s",
                "bytes_moved",
                "throughput_after",
                "sync_throughput_after",
            )
        }
        for policy, lines in rows.items()
    }
    light, heavy, respipe = means["lightweight"], means["heavy"], means["respipe"]
    light_g, heavy_g = means["lightweight@global"], means["heavy@global"]
    return {
        "summary": True,
        "stages": args.stages,
        "mbps": args.mbps,
        "optimizer": args.optimizer,
        "model_state_bytes": sum(unit_bytes),
        "means": means,
        "heavy_over_light_recovery_time": round(heavy["recovery_s"] / light["recovery_s"], 3),
        "bytes_moved_light_over_heavy": round(light["bytes_moved"] / heavy["bytes_moved"], 4),
        "light_over_respipe_throughput_after": round(
            light["throughput_after"] / respipe["throughput_after"], 3
        ),
        "light_over_respipe_sync_throughput_after": round(
            light["sync_throughput_after"] / respipe["sync_throughput_after"], 3
        ),
        "light_over_heavy_throughput_after": round(
            light["throughput_after"] / heavy["throughput_after"], 3
        ),
        # the same recoveries when only the coordinator holds copies
        "global_replication_heavy_over_light_recovery_time": round(
            heavy_g["recovery_s"] / light_g["recovery_s"], 3
        ),
        "global_replication_bytes_moved_light_over_heavy": round(
            light_g["bytes_moved"] / heavy_g["bytes_moved"], 4
        ),
        "load_average": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> int:
    summary = run(build_parser().parse_args(argv))
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
