"""``python -m zpipe train``: train a built-in model across a cluster.

With ``--local N`` it starts a coordinator and N emulated devices on this
machine (the demo's devices); with ``--coordinator`` it uses running ones.
The data is generated: inputs of the model's shape, labelled by a "teacher"
(the same architecture with another seed), so the loss has something to learn
and nothing is downloaded.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import torch

from zpipe._errors import ZpipeError
from zpipe.cli_common import positive_float, positive_int
from zpipe.client import PipelineClient
from zpipe.cluster import LocalCluster
from zpipe.demo import DEMO_DEVICES
from zpipe.fit import CONSISTENCIES, TrainReport
from zpipe.models import ModelSpec, available_presets, build_full_model, load_layer_sequence
from zpipe.recovery import POLICIES as RECOVERY_POLICIES
from zpipe.recovery import REPLICATIONS
from zpipe.training.schedules import SCHEDULES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m zpipe train",
        description="Train a built-in model with synchronous pipeline parallelism (GPipe or "
        "1F1B-Sync) on generated, teacher-labelled data, and optionally save the weights.",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--local",
        type=int,
        default=3,
        choices=range(1, len(DEMO_DEVICES) + 1),
        metavar="N",
        help=f"start a coordinator and N emulated devices here, 1-{len(DEMO_DEVICES)} (default: 3)",
    )
    where.add_argument(
        "--coordinator",
        default=None,
        metavar="tcp://HOST:PORT",
        help="train on the stages of a running coordinator instead",
    )
    parser.add_argument("--keys", default=None, metavar="DIR", help="CurveZMQ keys (client pair)")
    parser.add_argument(
        "--model",
        default="mlp-small",
        choices=available_presets(),
        help="built-in model preset (default: mlp-small)",
    )
    parser.add_argument(
        "--layers", type=positive_int, default=2, help="transformer blocks to keep (default: 2)"
    )
    parser.add_argument("--steps", type=positive_int, default=20, help="mini-batches (default: 20)")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="(default: 32)")
    parser.add_argument(
        "--microbatches", type=positive_int, default=4, help="per mini-batch (default: 4)"
    )
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="(default: 1f1b)")
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="adam")
    parser.add_argument("--lr", type=positive_float, default=1e-3, help="(default: 0.001)")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default: 0.9)")
    parser.add_argument("--seed", type=int, default=0, help="weights and data seed")
    parser.add_argument(
        "-o",
        "--output",
        default=None,
        metavar="FILE",
        help="save the trained weights "
        "(.safetensors or .pt); load them later with ModelSpec(..., weights=FILE)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="also train in this process and compare the weights",
    )
    parser.add_argument(
        "--recover",
        action="store_true",
        help="survive stages that die: resume from the coordinator's replica on the survivors",
    )
    parser.add_argument(
        "--replicate-every",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --recover: mini-batches between replicas (default: 50)",
    )
    parser.add_argument(
        "--recovery",
        choices=RECOVERY_POLICIES,
        default="lightweight",
        help="with --recover: how the survivors are planned (default: lightweight)",
    )
    parser.add_argument(
        "--replication",
        choices=REPLICATIONS,
        default=None,
        help="with --recover: 'global' sends every replica to the coordinator; 'chain' "
        "(FTPipeHD) and 'topology' (Asteroid) keep snapshots at the stages, backed up to "
        "the next stage (default: global)",
    )
    parser.add_argument(
        "--consistency",
        choices=CONSISTENCIES,
        default=None,
        help="with --recover: 'exact' rolls every stage back to the replica and trains "
        "again from there (the model equals an uninterrupted run's); 'fast' keeps the "
        "survivors' newest weights and goes on (default: exact)",
    )
    parser.add_argument(
        "--rebalance",
        type=_share,
        default=None,
        metavar="SHARE",
        help="with --recover: move units off a slow stage at a replica when that shortens "
        "the slowest stage by this share (e.g. 0.2)",
    )
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=("debug", "info", "warning", "error"),
        help="level of the local stage and coordinator logs (default: warning)",
    )
    return parser


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must lie between 0 and 1")
    return value


def teacher_batches(
    spec: ModelSpec, *, steps: int, batch_size: int, seed: int
) -> list[tuple[torch.Tensor, ...]]:
    """Inputs of the model's shape labelled with a same-shaped teacher's argmax."""
    sequence = load_layer_sequence(spec)
    teacher = build_full_model(ModelSpec(spec.family, dict(spec.config), seed=seed + 10_000))
    batches = []
    with torch.no_grad():  # not inference_mode: the batches are trained on later
        for step in range(steps):
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
    if args.optimizer == "sgd":
        return {"name": "sgd", "lr": args.lr, "momentum": args.momentum}
    return {"name": "adam", "lr": args.lr}


def _train_here(
    spec: ModelSpec, batches: list[tuple[torch.Tensor, ...]], optimizer: dict[str, Any]
) -> dict[str, torch.Tensor]:
    from zpipe.training.objectives import make_optimizer

    model = build_full_model(spec).train()
    opt = make_optimizer(optimizer, model.parameters())
    for *inputs, labels in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(*inputs)[0], labels).backward()
        opt.step()
    return model.state_dict()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides: dict[str, Any] = {}
    if args.model.startswith(("vit", "bert")):
        overrides["num_layers"] = args.layers
    spec = ModelSpec.preset(args.model, seed=args.seed, **overrides)
    try:
        batches = teacher_batches(
            spec, steps=args.steps, batch_size=args.batch_size, seed=args.seed
        )
    except ZpipeError as exc:
        print(f"python -m zpipe train: {exc}", file=sys.stderr)
        return 2
    optimizer = _optimizer(args)
    settings = {
        "optimizer": optimizer,
        "num_microbatches": args.microbatches,
        "schedule": args.schedule,
        "progress": None,  # a bar when stderr is a terminal
    }
    if args.recover:
        settings.update(
            recover=True,
            replicate_every=args.replicate_every,
            recovery=args.recovery,
            rebalance=args.rebalance,
            consistency=args.consistency or "exact",
            replication=args.replication or "global",
        )
    elif (args.replicate_every, args.rebalance, args.consistency, args.replication) != (
        None,
        None,
        None,
        None,
    ):
        print("python -m zpipe train: --replicate-every, --rebalance, --consistency and "
              "--replication need --recover", file=sys.stderr)  # fmt: skip
        return 2
    try:
        if args.coordinator is not None:

            async def remote() -> TrainReport:
                keys = Path(args.keys) if args.keys else None
                async with PipelineClient(args.coordinator, keys_dir=keys) as client:
                    return await client.fit(spec, batches, **settings)

            report = asyncio.run(remote())
        else:
            devices = list(DEMO_DEVICES[: args.local])
            print(f"starting a coordinator and {len(devices)} emulated devices ...", flush=True)
            with LocalCluster(devices, log_level=args.log_level) as cluster:
                report = cluster.fit(spec, batches, **settings)
    except ZpipeError as exc:
        print(f"python -m zpipe train: {exc}", file=sys.stderr)
        return 1
    print(f"\nplan ({report.plan.algo}), schedule {report.schedule}:")
    print(report.plan.describe(load_layer_sequence(spec).unit_names()))
    print(
        f"\nloss {report.losses[0]:.4f} -> {report.losses[-1]:.4f} over {report.steps} "
        f"mini-batches; {report.samples_per_s:.1f} samples/s"
    )
    for name in report.plan.devices:
        stage = report.stages.get(name, {})
        held_mib = stage.get("peak_activation_bytes", 0) / 2**20
        print(
            f"  {name:<10} busy {stage.get('busy_s', 0):6.2f} s  peak activations "
            f"{stage.get('peak_live_activations', 0)} ({held_mib:.1f} MiB)"
        )
    if args.output:
        report.save(args.output)
        print(f"weights saved to {args.output}")
    if args.check:
        expected = _train_here(spec, batches, optimizer)
        worst = max(float((report.state_dict[k] - v).abs().max()) for k, v in expected.items())
        print(f"single-process training: weights differ by at most {worst:.2e}")
    return 0
