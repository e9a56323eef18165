"""The flags of ``python -m zpipe train`` and their parsers (the command: zpipe.cli.train)."""

from __future__ import annotations

import argparse
from pathlib import Path

from zpipe.cli.common import (
    existing_dir,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    seconds,
    unit_interval,
)
from zpipe.cli.demo import DEMO_DEVICES
from zpipe.client import CONSISTENCIES
from zpipe.config import Timeouts
from zpipe.models import available_presets
from zpipe.planner.async_schedule import ASYNC_SCHEDULE
from zpipe.planner.schedules import SCHEDULES
from zpipe.planner.training_plan import TRAINING_ALGOS
from zpipe.recovery import POLICIES as RECOVERY_POLICIES
from zpipe.recovery import REPLICATIONS
from zpipe.training.lr_schedules import LR_SCHEDULES
from zpipe.training.objectives import LOSSES, OPTIMIZERS, is_factory_name
from zpipe.training.warmup import WARMUP_POLICIES

PROG = "python -m zpipe train"
# fit's planners: the training planners, and a straight pipeline from forward times
PLANNERS = (*TRAINING_ALGOS, "pipeedge")
# --check: float32 training of the same mini-batches in another order of reductions
# differs by rounding only, far below this
DEFAULT_CHECK_TOLERANCE = 1e-4


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
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
        help="stage processes to start here (with a coordinator), each an emulated device, "
        f"1-{len(DEMO_DEVICES)} (default: 3)",
    )
    where.add_argument(
        "--coordinator",
        default=None,
        metavar="tcp://HOST:PORT",
        help="train on the stages of a running coordinator instead",
    )
    parser.add_argument(
        "--keys",
        type=existing_dir,
        default=None,
        metavar="DIR",
        help="CurveZMQ key pairs (python -m zpipe keys): with --coordinator, the client pair "
        "and the coordinator's public key; with --local, pairs for the coordinator, the "
        "client and every local stage",
    )
    parser.add_argument(
        "--connect-timeout",
        type=seconds,
        default=Timeouts().connect_s,
        metavar="S",
        help="with --coordinator: give up when the coordinator has not answered within S "
        f"seconds (default: {Timeouts().connect_s:g})",
    )
    parser.add_argument(
        "--model",
        default="mlp-small",
        choices=available_presets(),
        help="built-in model preset (default: mlp-small)",
    )
    parser.add_argument(
        "--layers", type=positive_int, default=2, help="transformer blocks to keep (default: 2)"
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=20,
        help="mini-batches, i.e. optimizer steps (default: 20)",
    )
    parser.add_argument(
        "--batch-size", type=positive_int, default=32, help="samples per mini-batch (default: 32)"
    )
    parser.add_argument(
        "--microbatches",
        type=positive_int,
        default=None,
        metavar="N",
        help="the number of micro-batches each mini-batch is split into (default: 4; "
        "async-1f1b: 1, the only choice)",
    )
    parser.add_argument(
        "--planner",
        choices=PLANNERS,
        default=None,
        help="how the coordinator plans the pipeline (default: hpp, Asteroid's hybrid plan)",
    )
    parser.add_argument(
        "--schedule",
        choices=(*SCHEDULES, ASYNC_SCHEDULE),
        default="1f1b",
        help="(default: 1f1b); async-1f1b: asynchronous 1F1B (PipeDream, FTPipeHD) with "
        "weight stashing, an update after every backward",
    )
    parser.add_argument(
        "--no-vertical-sync",
        dest="vertical_sync",
        action="store_false",
        help="async-1f1b: each stage forwards with its newest weights, not the version the "
        "first stage used",
    )
    parser.add_argument(
        "--aggregate",
        action="store_true",
        help="async-1f1b: FTPipeHD's weight aggregation (stage i of n averages its newest "
        "n - i weight versions every n - i backwards)",
    )
    parser.add_argument(
        "--aggregate-multiple",
        type=positive_int,
        default=1,
        metavar="K",
        help="with --aggregate: aggregate every K * (n - i) backwards (default: 1)",
    )
    parser.add_argument(
        "--live-copies",
        action="store_true",
        help="async-1f1b: FTPipeHD's replication without draining: each stage copies its "
        "units to the next stage every --chain-every (default 50) mini-batches and to the "
        "coordinator every --global-every (default 100) while the pipeline trains",
    )
    parser.add_argument(
        "--repartition",
        action="store_true",
        help="FTPipeHD's live re-partitioning (async-1f1b, or a synchronous run without "
        "--recover): the stages' measured speeds move units between them, weights handed "
        "stage to stage (the flags below imply it)",
    )
    parser.add_argument(
        "--repartition-first",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --repartition: the first look after N mini-batches (default: 10)",
    )
    parser.add_argument(
        "--repartition-every",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --repartition: then a look every N mini-batches (default: 100)",
    )
    parser.add_argument(
        "--repartition-gain",
        type=_gain,
        default=None,
        metavar="SHARE",
        help="with --repartition: move when the predicted period shrinks by at least this "
        "share, in [0, 1) (default: 0.1)",
    )
    parser.add_argument(
        "--repartition-leave-out",
        action="store_true",
        help="with --repartition (async-1f1b): eq. 5 may leave a middle device out (no "
        "units) when that shortens the period by --repartition-gain over keeping it; the "
        "device stays registered and idle",
    )
    parser.add_argument(
        "--warmup",
        choices=WARMUP_POLICIES,
        default="auto",
        help="1F1B warm-up counts: asteroid (2(P-p)-1), torch (P-p, as Schedule1F1B) or auto "
        "(default: Asteroid's, chosen by measurement; see zpipe/training/warmup.py)",
    )
    parser.add_argument(
        "--optimizer",
        type=_optimizer_name,
        default="adam",
        metavar="|".join(OPTIMIZERS) + "|MODULE:FN",
        help="the optimizer (default: adam); MODULE:FN is user code, called as "
        "FN(params, lr=...) in every stage: it needs --allow-factory",
    )
    parser.add_argument(
        "--loss",
        type=_loss_name,
        default="cross_entropy",
        metavar="cross_entropy|MODULE:FN",
        help="the loss (default: cross_entropy); MODULE:FN is user code, called as "
        "FN(logits, labels) -> mean loss in the last stage: it needs --allow-factory",
    )
    parser.add_argument(
        "--allow-factory",
        action="append",
        default=[],
        metavar="MODULE:FN",
        help="allow user code that --loss or --optimizer names (MODULE:* for every "
        "function of MODULE); it is imported and RUN in this process and, with --local, "
        "in every stage (remote stages need their own --allow-factory); repeatable",
    )
    parser.add_argument("--lr", type=positive_float, default=1e-3, help="(default: 0.001)")
    parser.add_argument(
        "--weight-decay",
        type=non_negative_float,
        default=None,
        metavar="X",
        help="weight decay of sgd, adam or adamw (default: the optimizer's own)",
    )
    parser.add_argument(
        "--lr-schedule",
        choices=LR_SCHEDULES,
        default=None,
        help="scale the learning rate per mini-batch: constant, or linear/cosine decay to 0 "
        "at --total-steps (default: no schedule)",
    )
    parser.add_argument(
        "--warmup-steps",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="with --lr-schedule: mini-batches of linear warm-up (default: 0)",
    )
    parser.add_argument(
        "--total-steps",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --lr-schedule linear or cosine: where the rate reaches 0 (default: the "
        "mini-batches trained before a --resume plus --steps)",
    )
    parser.add_argument(
        "--momentum",
        type=unit_interval,
        default=0.9,
        help="SGD momentum, >= 0 and below 1 (default: 0.9)",
    )
    parser.add_argument("--seed", type=non_negative_int, default=0, help="weights and data seed")
    start = parser.add_mutually_exclusive_group()
    start.add_argument(
        "--weights",
        default=None,
        metavar="FILE",
        help="start from these weights instead of the seed's (.safetensors or .pt: zpipe's "
        "layout, an nn.Sequential of the model's units, or python -m zpipe import's output)",
    )
    start.add_argument(
        "--resume",
        default=None,
        metavar="CKPT",
        help="go on from a checkpoint written with -o CKPT --optimizer-state: its weights, "
        "optimizer state and mini-batch count (the data and the learning-rate schedule "
        "continue from there); use the same --model, --seed and optimizer flags",
    )
    parser.add_argument(
        "-o",
        "--output",
        default=None,
        metavar="FILE",
        help="save the trained weights "
        "(.safetensors or .pt); load them later with ModelSpec(..., weights=FILE)",
    )
    parser.add_argument(
        "--optimizer-state",
        action="store_true",
        help="with --output: also save the optimizer's state and the mini-batch count, "
        "a checkpoint that --resume goes on from",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="also train in this process, on its CPU, and compare the weights; exit 1 when "
        "they differ by more than --check-tolerance (stages on a GPU differ from the CPU by "
        "float32 rounding: about 1e-3 after 20 steps of vit-tiny)",
    )
    parser.add_argument(
        "--check-tolerance",
        type=non_negative_float,
        default=DEFAULT_CHECK_TOLERANCE,
        metavar="X",
        help="with --check: the largest difference of any weight that passes "
        f"(default: {DEFAULT_CHECK_TOLERANCE:g})",
    )
    parser.add_argument(
        "--advertise-host",
        default=None,
        metavar="HOST",
        help="with --coordinator: the address the stages send results to (this machine's, "
        "as the last stage reaches it); default: the address that routes to the coordinator",
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
        "--chain-every",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --replication chain or topology: mini-batches between chain replicas "
        "(the same as --replicate-every; default: 50); with --live-copies: between chain "
        "copies",
    )
    parser.add_argument(
        "--global-every",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --replication chain or topology: also a global copy of every unit to "
        "the coordinator every N mini-batches (FTPipeHD runs both); a recovery whose chain "
        "copies of some unit all died goes on from it (default: none); with --live-copies: "
        "between global copies (default: 100)",
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
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        metavar="FILE",
        help="write each micro-batch's receive, forward, backward, all-reduce, step and "
        "send per stage to FILE: Chrome trace-event JSON for https://ui.perfetto.dev or "
        "chrome://tracing",
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="no progress lines or bars on stderr (they show only on a terminal anyway)",
    )
    return parser


def _gain(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"a gain lies in [0, 1), got {value}")
    return value


def repartition_of(args: argparse.Namespace) -> dict[str, float | bool] | None:
    """The ``repartition`` settings the flags ask for (None: none of them given)."""
    given: dict[str, float | bool] = {
        key: value
        for key, value in (
            ("first", args.repartition_first),
            ("every", args.repartition_every),
            ("gain", args.repartition_gain),
        )
        if value is not None
    }
    if getattr(args, "repartition_leave_out", False):
        given["leave_out"] = True
    return given if args.repartition or given else None


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must lie between 0 and 1")
    return value


def _optimizer_name(text: str) -> str:
    if text in OPTIMIZERS or is_factory_name(text):
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r}: choose {', '.join(OPTIMIZERS)} or a MODULE:FN callable"
    )


def _loss_name(text: str) -> str:
    if text == "cross_entropy" or is_factory_name(text):
        return text
    others = [loss for loss in LOSSES if loss != "cross_entropy"]
    raise argparse.ArgumentTypeError(
        f"{text!r}: the generated data has class labels: use cross_entropy or a MODULE:FN "
        f"callable ({', '.join(others)} does not fit class labels)"
    )
