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
and after, both plans (``plan_before``, ``plan_after``), the planners' prediction
for the plan after (``predicted_after_samples_s``) and ``weights_exact`` (the
trained weights equal single-process training on the same mini-batches). Every
trial starts from the warm run's plan (``fit(plan=...)``), so each policy kills the
same stage of the same plan: planned afresh per run, the coordinator's HPP plan
followed the profiles, which drift with the load and with a revived stage's new
profile, and the policies were compared on different plans and victims' positions.
The trials go victim by victim, each policy in turn, so a drift of the load moves
both policies alike. ``stages_measured``: each stage's compute per micro-batch and
utilisation over the run, the measured bottleneck.

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
``light_over_respipe_throughput_after`` (with ``light_over_respipe_predicted_after``,
the same ratio of the planners' predictions, and ``light_over_respipe_after_over_before``,
of each trial's rate after over its rate before) for training, and the same with an
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
import itertools
import os
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench._common import emit, summary
from bench._recovery_faults import (
    FAULT_EPOCH_BATCHES,
    _fault_section,
)
from bench._recovery_liveness import (
    _liveness_section,
)
from bench._recovery_rebalance import (
    _rebalance_section,
    _train,
    _train_line,
    _train_single_process,
)
from bench._recovery_stream import (
    BANDWIDTH_MBPS,
    BENCH,
    DEVICES,
    Batch,
    _mean,
    _ratio,
    _scale,
    _stream,
    _trial_line,
)
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.log import configure_logging
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence
from zpipe.recovery import POLICIES


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
            # victim by victim, each policy in turn: the load drifts over the section,
            # and with each policy's trials in a block of their own it moved one
            # policy's figures against the other's (0.66-1.05 after/before for one,
            # 0.46-1.01 for the other in one run)
            for victim, policy in itertools.product(train_victims, policies):
                # every policy starts from the warm run's plan: the same stages die
                ttrial = _train(
                    cluster, spec, train_batches, args, policy=policy, victim=victim,
                    plan=tplan,
                )  # fmt: skip
                line = _train_line(ttrial, want, args.train_batch_size)
                emit(line)
                train_lines.append(line)
                print(
                    f"  training, {policy}, kill {victim}: recovery {line['recovery_s']}, "
                    f"after {line['throughput_after']} samples/s (predicted "
                    f"{line['predicted_after_samples_s']}), plan {line['plan_after']}, "
                    f"exact {line['weights_exact']}",
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
                    "predicted_after_samples_s",
                    "after_over_before",
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
        if not prefix:
            # what the planners' cost model expected of the same two plans, and the
            # ratio with each run's rate after taken over its own rate before
            result["light_over_respipe_predicted_after"] = _ratio(
                light.get("predicted_after_samples_s"), respipe.get("predicted_after_samples_s")
            )
            result["light_over_respipe_after_over_before"] = _ratio(
                light.get("after_over_before"), respipe.get("after_over_before")
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
