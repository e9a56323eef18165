"""``python -m zpipe train``: train a built-in model across a cluster.

With ``--local N`` it starts a coordinator and N emulated devices on this
machine (the demo's devices); with ``--coordinator`` it uses running ones.
Everything that can be checked before training is: the endpoint, the output
file's directory, the key pairs ``--keys`` must hold, and (within
``--connect-timeout``) that the coordinator answers.
The data is generated: inputs of the model's shape, labelled by a "teacher"
(the same architecture with another seed), so the loss has something to learn
and nothing is downloaded. Mini-batch ``s`` is the same whatever run trains it,
so ``--resume`` goes on with the data an uninterrupted run would have seen.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import zmq

from zpipe._errors import TransportTimeout, ZpipeError
from zpipe.cli.demo import DEMO_DEVICES

# re-exported: tests and callers use train_cli.build_parser
from zpipe.cli.train_args import (  # noqa: F401
    DEFAULT_CHECK_TOLERANCE,
    PLANNERS,
    PROG,
    build_parser,
    repartition_of,
)
from zpipe.client import PipelineClient, TrainReport
from zpipe.cluster import LocalCluster
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence
from zpipe.models.trust import FactoryAllowList
from zpipe.models.weights import (
    SAFETENSORS_SUFFIXES,
    STEPS_KEY,
    TORCH_SUFFIXES,
    read_matching,
)
from zpipe.planner.async_schedule import ASYNC_SCHEDULE, AsyncSettings
from zpipe.planner.training_plan import TrainingPlan
from zpipe.training.async_recovery import async_recovery_refusal, cuts_of_run
from zpipe.training.async_reference import train_async_reference
from zpipe.training.objectives import ASYNC_RESUME_LIVE_COPIES, is_factory_name
from zpipe.transport import security
from zpipe.transport.sockets import check_resolvable, validate_endpoint


def teacher_batches(
    spec: ModelSpec, *, steps: int, batch_size: int, seed: int, first_step: int = 0
) -> list[tuple[torch.Tensor, ...]]:
    """Inputs of the model's shape labelled with a same-shaped teacher's argmax:
    mini-batches ``first_step`` .. ``first_step + steps - 1`` of the seed's stream."""
    sequence = load_layer_sequence(spec)
    teacher = build_full_model(ModelSpec(spec.family, dict(spec.config), seed=seed + 10_000))
    batches = []
    with torch.no_grad():  # not inference_mode: the batches are trained on later
        for step in range(first_step, first_step + steps):
            inputs = sequence.example_input(batch_size, seed=seed * 100_003 + step)
            logits = teacher(*inputs)[0]
            if logits.dim() != 2:
                raise ZpipeError(
                    f"{spec.family} outputs {tuple(logits.shape)}; training here needs "
                    "(batch, classes) logits"
                )
            batches.append((*inputs, logits.argmax(dim=1)))
    return batches


def _optimizer(args: argparse.Namespace) -> dict[str, Any]:
    optimizer: dict[str, Any] = {"name": args.optimizer, "lr": args.lr}
    if args.optimizer == "sgd":
        optimizer["momentum"] = args.momentum
    if args.weight_decay is not None:
        optimizer["weight_decay"] = args.weight_decay
    return optimizer


def _lr_schedule(args: argparse.Namespace, start_step: int) -> dict[str, Any] | None:
    if args.lr_schedule is None:
        return None
    schedule: dict[str, Any] = {"name": args.lr_schedule, "warmup_steps": args.warmup_steps}
    if args.lr_schedule != "constant":
        schedule["total_steps"] = args.total_steps or start_step + args.steps
    return schedule


# Measured on an H200 against this process's CPU (single-process runs of the same
# training): vit-tiny's weights differ by 3.7e-4 after one step and 1.1e-3 after 20,
# mlp-small's by 1e-5; fp32 kernels sum in a different order on each device.
CROSS_DEVICE_NOTE = (
    "note: the local stages computed on this machine's GPU (--device auto) and the check "
    "trains on its CPU; float32 kernels round differently on the two, and the difference "
    "grows with the steps (vit-tiny: about 1e-3 after 20 steps on an H200, where the CPU "
    "and GPU single-process runs differ as much). A difference of that size is not a "
    "pipeline error: pass --check-tolerance 5e-3, or run the stages with --device cpu "
    "(python -m zpipe stage) to compare exactly."
)


def checkpoint_steps(path: str) -> int:
    """The mini-batches a checkpoint was trained for (what ``--resume`` goes on from)."""
    found = read_matching(path, lambda key: key == STEPS_KEY)
    if STEPS_KEY not in found:
        raise ZpipeError(
            f"{path} is not a checkpoint to resume from (no optimizer state and step "
            "count): write one with -o FILE --optimizer-state, or start from its weights "
            "with --weights"
        )
    return int(found[STEPS_KEY])


def _train_here(
    spec: ModelSpec, batches: list[tuple[torch.Tensor, ...]], settings: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """The same training in this process: one stage of every unit, one micro-batch per
    mini-batch (the shard a stage runs, so losses, schedules and resuming agree)."""
    from zpipe.stage.executors.training_shard import TrainShard

    shard = TrainShard.build(
        spec,
        0,
        load_layer_sequence(spec).num_units,
        first=True,
        last=True,
        loss=settings.get("loss", "cross_entropy"),
        optimizer=settings["optimizer"],
        lr_schedule=settings.get("lr_schedule"),
        start_step=settings.get("start_step", 0),
        resume_optimizer=settings.get("resume_optimizer", False),
    )
    for step, (*inputs, labels) in enumerate(batches):
        shard.forward(step, inputs, labels, int(labels.shape[0]))
        shard.backward(step)
        shard.step()
    return shard.state_dict()


def _train_async_here(
    spec: ModelSpec,
    batches: list[tuple[torch.Tensor, ...]],
    report: TrainReport,
    args: argparse.Namespace,
) -> dict[str, torch.Tensor]:
    """The single-process reference of the asynchronous run, on the plans it ran."""
    settings = AsyncSettings(
        vertical_sync=args.vertical_sync,
        aggregate=args.aggregate,
        aggregate_multiple=args.aggregate_multiple,
        # a recovered run kept the staleness of the pipeline it started with
        depth=int(report.recoveries[0]["depth"]) if report.recoveries else None,
    )
    # the plan it started on, the live re-partitions it made and the survivors of its
    # recoveries, each from where it took over
    first = report.first_training_plan or report.training_plan
    stages = first.stages if first is not None else report.plan.stages
    bounds = [s.start for s in stages] + [stages[-1].end]
    moves = cuts_of_run(report.repartitions, report.recoveries)
    # a resumed run goes on from its checkpoint's versions and optimizer state
    start_state = read_matching(args.resume, lambda key: key != STEPS_KEY) if args.resume else None
    result = train_async_reference(
        spec,
        batches,
        bounds=bounds,
        optimizer=_optimizer(args),
        loss=args.loss,
        settings=settings,
        repartitions=moves,
        lr_schedule=_lr_schedule(args, report.start_step),
        start_state=start_state,
    )
    return result.state_dict


def _check_output(parser: argparse.ArgumentParser, output: str | None) -> None:
    """Refuse, before any training, a weights file that could not be written after it."""
    if output is None:
        return
    path = Path(output)
    if path.suffix not in (*SAFETENSORS_SUFFIXES, *TORCH_SUFFIXES):
        parser.error(
            f"--output {output}: the suffix must be one of "
            f"{', '.join((*SAFETENSORS_SUFFIXES, *TORCH_SUFFIXES))}"
        )
    _check_writable(parser, "--output", path)


def _check_writable(parser: argparse.ArgumentParser, flag: str, path: Path) -> None:
    folder = path.parent
    if not folder.is_dir():
        parser.error(f"{flag} {path}: the directory {folder} does not exist; create it first")
    if path.is_dir():
        parser.error(f"{flag} {path} is a directory; name a file in it")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        parser.error(f"{flag} {path}: this user cannot write there")


def _check_keys(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a --keys directory without the keys this command's processes will load."""
    if args.keys is None:
        return
    client, coordinator = security.CLIENT_KEY_NAME, security.COORDINATOR_KEY_NAME
    if args.coordinator is not None:
        pairs, public = [client], [coordinator]
        needs = "the client's key pair and the coordinator's public key"
    else:  # every process --local starts here runs with its own pair
        pairs = [coordinator, client, *(d.name for d in DEMO_DEVICES[: args.local])]
        public = []
        needs = f"key pairs for {', '.join(pairs)} (--local {args.local})"
    missing_pairs = []
    for name in pairs:
        try:
            security.load_keypair(args.keys, name)
        except ZpipeError:
            missing_pairs.append(name)
    missing_public = []
    for name in public:
        try:
            security.load_keypair_public(args.keys, name)
        except ZpipeError:
            missing_public.append(name)
    if not (missing_pairs or missing_public):
        return
    fixes = []
    if missing_pairs:
        fixes.append(f"python -m zpipe keys --dir {args.keys} {' '.join(missing_pairs)}")
    fixes += [f"copy {name}.key from the coordinator's key directory" for name in missing_public]
    parser.error(
        f"--keys {args.keys} needs {needs}; missing or unreadable: "
        f"{', '.join(missing_pairs + missing_public)}; fix: {'; '.join(fixes)}"
    )


async def reach_coordinator(client: PipelineClient, *, timeout_s: float) -> None:
    """Return once the coordinator answers a request; TransportTimeout after ``timeout_s``.

    ZeroMQ connects lazily and retries for ever, so an endpoint where nothing
    listens (or a coordinator that refuses our keys) shows only as silence.
    """
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            await asyncio.wait_for(client.cluster_state(), timeout=left)
            return
        except (asyncio.TimeoutError, TimeoutError):  # TransportTimeout is one too
            # a coordinator still starting answers a later request; a refusal that came
            # at once (a connection gone) must not make this loop spin
            await asyncio.sleep(min(0.1, max(deadline - time.monotonic(), 0.0)))
    raise TransportTimeout("coordinator", "an answer", timeout_s)


def _settings(args: argparse.Namespace, start_step: int) -> dict[str, Any]:
    """fit's keywords for the loss, optimizer, schedule and checkpoint flags."""
    settings: dict[str, Any] = {
        "optimizer": _optimizer(args),
        "loss": args.loss,
        "lr_schedule": _lr_schedule(args, start_step),
        "start_step": start_step,
        "resume_optimizer": args.resume is not None,
        "optimizer_state": bool(args.output and args.optimizer_state),
    }
    return settings


def run_kind_settings(args: argparse.Namespace) -> dict[str, Any]:
    """fit's keywords for the schedule's own flags, the planner and recovery (checked
    in ``main``: only the combinations a run takes reach here)."""
    settings: dict[str, Any] = {}
    if args.schedule == ASYNC_SCHEDULE:
        settings.update(
            vertical_sync=args.vertical_sync,
            aggregate=args.aggregate,
            aggregate_multiple=args.aggregate_multiple,
        )
    if args.live_copies:  # checked in main: async-1f1b
        settings.update(
            live_copies=True, chain_every=args.chain_every, global_every=args.global_every
        )
    if repartition_of(args) is not None:  # checked in main: async, or synchronous without --recover
        settings["repartition"] = repartition_of(args)
    if args.planner is not None:
        settings["planner"] = args.planner
    if args.recover:
        settings.update(
            recover=True,
            replicate_every=args.replicate_every,
            recovery=args.recovery,
            rebalance=args.rebalance,
            consistency=args.consistency or "exact",
            replication=args.replication or "global",
            chain_every=args.chain_every,
            global_every=args.global_every,
        )
    return settings


def _train(
    args: argparse.Namespace, spec: ModelSpec, batches: list[Any], start_step: int
) -> TrainReport:
    unit_names = load_layer_sequence(spec).unit_names()
    settings: dict[str, Any] = {
        **_settings(args, start_step),
        "num_microbatches": args.microbatches,
        "schedule": args.schedule,
        "warmup": args.warmup,
        "progress": False if args.quiet else None,  # a bar when stderr is a terminal
        # the plan is shown before the first mini-batch, not after the last
        "on_plan": lambda plan: _print_plan(plan, unit_names),
        "trace": args.trace,
    }
    settings.update(run_kind_settings(args))
    if args.coordinator is not None:

        async def remote() -> TrainReport:
            async with PipelineClient(
                args.coordinator, keys_dir=args.keys, advertise_host=args.advertise_host
            ) as client:
                try:
                    await reach_coordinator(client, timeout_s=args.connect_timeout)
                except TransportTimeout:
                    raise TransportTimeout(
                        f"the coordinator at {args.coordinator} (is it running, with the "
                        "same --keys?)",
                        "an answer (--connect-timeout)",
                        args.connect_timeout,
                    ) from None
                return await client.fit(spec, batches, **settings)

        return asyncio.run(remote())
    devices = list(DEMO_DEVICES[: args.local])
    print(f"starting a coordinator and {len(devices)} emulated devices ...", flush=True)
    shown = False if args.quiet else None
    with LocalCluster(
        devices,
        keys_dir=args.keys,
        log_level=args.log_level,
        allow_factories=args.allow_factory,
        progress=shown,
    ) as cluster:
        return cluster.fit(spec, batches, **settings)


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Everything about the flags that can fail, checked before anything starts."""
    asynchronous = args.schedule == ASYNC_SCHEDULE
    if args.live_copies and not asynchronous:
        parser.error(f"--live-copies needs --schedule {ASYNC_SCHEDULE}")
    if args.live_copies and args.resume is not None:
        parser.error(ASYNC_RESUME_LIVE_COPIES)
    if args.live_copies and args.replication not in (None, "global"):
        parser.error(
            "--live-copies are the chain and global copies themselves: leave --replication "
            "at global (a recovering run's flush replicas)"
        )
    # with --live-copies, --chain-every and --global-every are the copies' periods
    periods = () if args.live_copies else (args.chain_every, args.global_every)
    recover_only = (
        args.replicate_every,
        args.rebalance,
        args.consistency,
        args.replication,
        *periods,
    )
    if args.microbatches is None:
        args.microbatches = 1 if asynchronous else 4
    if asynchronous and args.microbatches != 1:
        parser.error(f"--schedule {ASYNC_SCHEDULE} trains every mini-batch whole: --microbatches 1")
    refusal = (
        async_recovery_refusal(
            vertical_sync=args.vertical_sync,
            consistency=args.consistency or "exact",
            rebalance=args.rebalance,
            live_copies=bool(args.live_copies),
        )
        if asynchronous and args.recover
        else None
    )
    if refusal is not None:
        parser.error(refusal)
    if not asynchronous and (args.aggregate or not args.vertical_sync):
        parser.error(f"--aggregate and --no-vertical-sync need --schedule {ASYNC_SCHEDULE}")
    if repartition_of(args) is not None and (
        (args.recover and not asynchronous) or not args.vertical_sync
    ):
        parser.error(
            "--repartition and its flags need vertical sync, and no --recover "
            f"unless --schedule {ASYNC_SCHEDULE}"
        )
    if args.advertise_host is not None and args.coordinator is None:
        parser.error("--advertise-host needs --coordinator (--local runs on this machine)")
    if not args.recover and any(v is not None for v in recover_only):
        parser.error(
            "--replicate-every, --rebalance, --consistency, --replication, --chain-every "
            "and --global-every need --recover"
        )
    if any(p is not None for p in periods) and args.replication in (None, "global"):
        parser.error("--chain-every and --global-every need --replication chain or topology")
    if args.microbatches > args.batch_size:
        parser.error(
            f"--microbatches {args.microbatches} cannot split a --batch-size of "
            f"{args.batch_size} samples; use at most {args.batch_size}"
        )
    if args.coordinator is not None:
        try:
            validate_endpoint(args.coordinator, flag="--coordinator")
            check_resolvable(args.coordinator, flag="--coordinator")
        except ZpipeError as exc:
            parser.error(str(exc))
    _check_keys(parser, args)
    _check_output(parser, args.output)
    if args.trace is not None:
        _check_writable(parser, "--trace", args.trace)
    _check_checkpoint_flags(parser, args)


def _check_checkpoint_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The user-code, schedule and checkpoint flags, before anything starts."""
    allowed = FactoryAllowList.of(*args.allow_factory)
    for flag, name in (("--loss", args.loss), ("--optimizer", args.optimizer)):
        if is_factory_name(name) and not allowed.allows(name):
            parser.error(
                f"{flag} {name} names user code, which runs in every stage: allow it "
                f"explicitly with --allow-factory {name}"
            )
    if args.optimizer_state and args.output is None:
        parser.error("--optimizer-state needs --output (the checkpoint file)")
    if args.lr_schedule is None and (args.warmup_steps or args.total_steps is not None):
        parser.error("--warmup-steps and --total-steps need --lr-schedule")
    for flag, path in (("--weights", args.weights), ("--resume", args.resume)):
        if path is not None and not Path(path).is_file():
            parser.error(f"{flag} {path}: no such file")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    overrides: dict[str, Any] = {}
    if args.model.startswith(("vit", "bert")):
        overrides["num_layers"] = args.layers
    weights = args.resume or args.weights
    spec = ModelSpec.preset(args.model, seed=args.seed, weights=weights, **overrides)
    try:
        start_step = checkpoint_steps(args.resume) if args.resume else 0
        batches = teacher_batches(
            spec,
            steps=args.steps,
            batch_size=args.batch_size,
            seed=args.seed,
            first_step=start_step,
        )
    except ZpipeError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if start_step:
        print(f"resuming after mini-batch {start_step} of {args.resume}", flush=True)
    try:
        report = _train(args, spec, batches, start_step)
    except ZpipeError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except zmq.ZMQError as exc:  # an endpoint libzmq refuses, or an address in use
        print(f"{PROG}: cannot reach {args.coordinator or 'the local cluster'}: {exc}",
              file=sys.stderr)  # fmt: skip
        return 1
    _print_report(report, spec)
    if args.output:
        try:
            report.save(args.output)
        except (OSError, ZpipeError) as exc:
            print(f"{PROG}: cannot save the weights to {args.output}: {exc}", file=sys.stderr)
            return 1
        print(f"weights saved to {args.output}")
    if args.check:
        expected = (
            _train_async_here(spec, batches, report, args)
            if args.schedule == ASYNC_SCHEDULE
            else _train_here(spec, batches, _settings(args, start_step))
        )
        worst = weights_difference(report.state_dict, expected)
        print(
            f"single-process training: weights differ by at most {worst:.2e} "
            f"(tolerance {args.check_tolerance:.2e})"
        )
        if not worst <= args.check_tolerance:  # NaN fails too
            print(
                f"{PROG}: --check failed: the weights differ by {worst:.2e}, more than the "
                f"tolerance {args.check_tolerance:.2e} (--check-tolerance)",
                file=sys.stderr,
            )
            if args.local is not None and torch.cuda.is_available():
                print(CROSS_DEVICE_NOTE, file=sys.stderr)
            return 1
    return 0


def weights_difference(
    trained: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]
) -> float:
    """The largest absolute difference of any weight; infinite when a tensor is missing,
    has another shape or holds a NaN where the other does not agree."""
    worst = 0.0
    for name, want in expected.items():
        got = trained.get(name)
        if got is None or got.shape != want.shape:
            return math.inf
        if want.numel():
            gap = float((got.float() - want.float()).abs().max())
            if math.isnan(gap):  # max() would pass over a NaN
                return math.inf
            worst = max(worst, gap)
    return worst


def _print_plan(plan: TrainingPlan, unit_names: list[str]) -> None:
    print(f"\nplan ({plan.algo}), schedule {plan.schedule}:")
    print(describe_training_plan(plan, unit_names), flush=True)


def _print_report(report: TrainReport, spec: ModelSpec) -> None:
    if report.recoveries or report.rebalances:  # the plan printed first changed since
        print(f"\nthe last plan ({report.plan.algo}), schedule {report.schedule}:")
        print(describe_stages(report, load_layer_sequence(spec).unit_names()))
    print(
        f"\nloss {report.losses[0]:.4f} -> {report.losses[-1]:.4f} over {report.steps} "
        f"mini-batches; {report.samples_per_s:.1f} samples/s"
    )
    devices = report.training_plan.devices if report.training_plan else report.plan.devices
    for name in devices:
        stage = report.stages.get(name, {})
        held_mib = stage.get("peak_activation_bytes", 0) / 2**20
        print(
            f"  {name:<10} busy {stage.get('busy_s', 0):6.2f} s  peak activations "
            f"{stage.get('peak_live_activations', 0)} ({held_mib:.1f} MiB)"
        )
    for line in describe_changes(report):
        print(line)


def describe_stages(report: TrainReport, unit_names: list[str]) -> str:
    """One row per stage; a data-parallel stage lists every device of its group with
    the samples of each micro-batch it runs."""
    tplan = report.training_plan
    if tplan is None:
        return report.plan.describe(unit_names)
    return describe_training_plan(tplan, unit_names)


def describe_training_plan(tplan: TrainingPlan, unit_names: list[str]) -> str:
    """One row per stage of ``tplan`` (see :func:`describe_stages`)."""
    rows = [f"{'stage':>5}  {'devices (samples each)':<32} {'units':>11}  first .. last"]
    for i, st in enumerate(tplan.stages):
        if len(st.devices) == 1:
            who = st.devices[0]
        else:
            who = ", ".join(f"{d} ({s})" for d, s in zip(st.devices, st.shares, strict=True))
        span = f"{unit_names[st.start]} .. {unit_names[st.end - 1]}"
        rows.append(f"{i:>5}  {who:<32} {f'[{st.start}, {st.end})':>11}  {span}")
    return "\n".join(rows)


def describe_changes(report: TrainReport) -> list[str]:
    """The recoveries (a stage lost, where the run resumed) and rebalances of the run."""
    lines = []
    if report.recoveries:
        lines.append(f"\nrecoveries: {len(report.recoveries)}")
    for r in report.recoveries:
        if "progress_lost" in r:  # an asynchronous run's fast recovery (FTPipeHD)
            lines.append(
                f"  stage {r.get('dead')!r} lost ({r.get('reason', 'no reason given')}); "
                f"resumed at mini-batch {r.get('resumed_at')}, {r.get('progress_lost')} "
                f"mini-batches of progress lost; units from {r.get('copies_used')}"
            )
            continue
        lines.append(
            f"  stage {r.get('dead')!r} lost ({r.get('reason', 'no reason given')}); resumed "
            f"from the replica after mini-batch {r.get('replica')}, {r.get('replayed', 0)} "
            f"replayed ({r.get('policy')} re-plan, {r.get('consistency')} consistency)"
        )
    if report.rebalances:
        lines.append(f"\nrebalances: {len(report.rebalances)}")
    for r in report.rebalances:
        stages = (r.get("plan") or {}).get("stages") or []
        ranges = ", ".join(
            f"{'+'.join(st.get('devices', []))} [{st.get('start')}, {st.get('end')})"
            for st in stages
        )
        lines.append(f"  after mini-batch {r.get('at')}: {ranges}")
    return lines
