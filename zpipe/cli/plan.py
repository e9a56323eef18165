"""``python -m zpipe plan``: choose devices, order and unit ranges from profiles and a cluster.

With ``--train`` it plans synchronous pipeline training instead (stages of
data-parallel device groups, micro-batch shares and warm-ups: see
:mod:`zpipe.planner.hpp`); the profile must then hold training measurements
(``python -m zpipe profile --train``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

from zpipe._errors import ConfigError, ZpipeError
from zpipe.cli.common import DeprecatedAlias, positive_int
from zpipe.planner import PLANNERS, ClusterSpec, Plan, load_cluster, plan_with, predict_plan
from zpipe.planner.bucketing import parse_bucketing
from zpipe.planner.cluster import read_profile_file
from zpipe.planner.hpp import plan_training, search_microbatch_and_order
from zpipe.planner.plan import plan_json
from zpipe.planner.profile import ModelProfile
from zpipe.planner.training_cost import OPTIMIZER_STATE_COPIES
from zpipe.planner.training_plan import TRAINING_ALGOS, TRAINING_SCHEDULES, TrainingPlan
from zpipe.progress import TerminalProgress

_INFERENCE_DEFAULT = "pipeedge"
_TRAINING_DEFAULT = "hpp"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m zpipe plan",
        description="Plan a pipeline: which devices take part, in what order, and which units "
        "each runs, minimising the slowest stage's max(compute, communication) under every "
        "device's memory budget. With --train, plan pipeline training: stages of data-parallel "
        "device groups minimising the round (mini-batch) latency under every device's training "
        "memory. Prints a table and, with --json, the plan as JSON.",
    )
    parser.add_argument(
        "--profile",
        "--profiles",
        action=DeprecatedAlias,
        deprecated=("--profiles",),
        dest="profile",
        type=Path,
        required=True,
        metavar="FILE",
        help="model profile written by 'python -m zpipe profile' (devices "
        "without a profile of their own scale its times by their speed)",
    )
    parser.add_argument(
        "--cluster",
        type=Path,
        required=True,
        metavar="FILE",
        help="cluster file: devices, memory, speed, links (format in docs/guide/planning.md)",
    )
    parser.add_argument(
        "--planner",
        "--algo",
        action=DeprecatedAlias,
        deprecated=("--algo",),
        dest="planner",
        choices=sorted(set(PLANNERS) | set(TRAINING_ALGOS)),
        default=None,
        metavar="PLANNER",
        help=f"inference: pipeedge (optimal, heterogeneity-aware), even (GPipe) or pipedream "
        f"(homogeneous), default {_INFERENCE_DEFAULT}; with --train: hpp (Asteroid: pipeline "
        "of data-parallel groups), straight (Eco-FL: one device per stage), data-parallel or "
        f"even (GPipe), default {_TRAINING_DEFAULT}",
    )
    parser.add_argument(
        "--microbatch-size",
        "--batch-size",
        action=DeprecatedAlias,
        deprecated=("--batch-size",),
        dest="microbatch_size",
        type=positive_int,
        default=None,
        metavar="N",
        help="samples per micro-batch to plan for (default: the profile's first batch size; "
        "with --train, its largest)",
    )
    parser.add_argument(
        "--bucketing",
        type=_bucketing_arg,
        default="auto",
        metavar="MODE",
        help="pipeedge: how measured speeds and bandwidths are grouped into categories: "
        "'auto' (default: exact while the devices form few categories, else snapped to 5%% "
        "buckets), 'exact', or a tolerance such as 0.1 or 10%%; a bucketed plan prints its "
        "certified bound (real bottleneck over a proven lower bound of the optimum)",
    )
    parser.add_argument(
        "--compare", action="store_true", help="also show every other planner's plan and prediction"
    )
    training = parser.add_argument_group("training (--train)")
    training.add_argument(
        "--train", action="store_true", help="plan pipeline training instead of inference"
    )
    training.add_argument(
        "--microbatches",
        type=positive_int,
        default=8,
        help="micro-batches per mini-batch, i.e. per optimizer step (default: 8)",
    )
    training.add_argument(
        "--schedule",
        choices=TRAINING_SCHEDULES,
        default="1f1b",
        help="1f1b (per-stage warm-up, less activation memory) or gpipe; default: 1f1b",
    )
    training.add_argument(
        "--optimizer",
        choices=tuple(OPTIMIZER_STATE_COPIES),
        default="sgd",
        help="decides the optimizer state in the memory model (default: sgd)",
    )
    training.add_argument(
        "--search",
        action="store_true",
        help="with --planner straight: also choose the micro-batch size (among the profile's, or "
        "at most --microbatch-size) and the device order, as Eco-FL does",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the chosen plan as JSON ('-' for standard output: the JSON alone, "
        "the tables then go to standard error)",
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="no progress lines on stderr (they show only on a terminal anyway)",
    )
    return parser


def _bucketing_arg(text: str) -> str | float:
    try:
        return parse_bucketing(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _table(plan: Plan, profile: ModelProfile) -> str:
    names = [u.name for u in profile.units]
    pred = plan.predicted
    rows = [
        f"{plan.algo}: {len(plan.stages)} stages, predicted "
        f"{pred.get('throughput_samples_per_s', 0.0):.3f} samples/s "
        f"(bottleneck {pred.get('bottleneck_s', 0.0) * 1e3:.1f} ms per micro-batch)"
    ]
    rows.append(
        f"  {'stage':>5}  {'device':<14} {'units':>11}  {'compute ms':>10}  "
        f"{'comm ms':>8}  {'memory MB':>9}  first .. last"
    )
    for i, s in enumerate(plan.stages):
        rows.append(
            f"  {i:>5}  {s.device:<14} {f'[{s.start}, {s.end})':>11}  "
            f"{pred.get(f'stage{i}_compute_s', 0.0) * 1e3:>10.1f}  "
            f"{pred.get(f'stage{i}_comm_s', 0.0) * 1e3:>8.1f}  "
            f"{pred.get(f'stage{i}_memory_bytes', 0.0) / 2**20:>9.1f}  "
            f"{names[s.start]} .. {names[s.end - 1]}"
        )
    if "bucketing_certified_ratio" in pred:
        rows.append(
            f"  bucketed to {pred['bucketing_tolerance']:.0%}: within "
            f"{pred['bucketing_certified_ratio']:.3f}x of the exact optimum (certified; "
            f"lower bound {pred['bucketing_lower_bound_s'] * 1e3:.1f} ms)"
        )
    return "\n".join(rows)


def _check_planner(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill in the default planner and refuse one of the other mode's."""
    if args.train:
        args.planner = args.planner or _TRAINING_DEFAULT
        if args.planner not in TRAINING_ALGOS:
            parser.error(
                f"--planner {args.planner} plans inference; with --train use one of "
                f"{', '.join(TRAINING_ALGOS)}"
            )
        if args.search and args.planner != "straight":
            parser.error(
                "--search chooses a straight pipeline's order; use it with --planner straight"
            )
        return
    args.planner = args.planner or _INFERENCE_DEFAULT
    if args.planner not in PLANNERS:
        parser.error(
            f"--planner {args.planner} plans training; add --train, or use one of "
            f"{', '.join(sorted(PLANNERS))}"
        )
    if args.search:
        parser.error("--search plans training; add --train")


def _train_plan(
    args: argparse.Namespace, profile: ModelProfile, cluster: ClusterSpec, algo: str
) -> TrainingPlan:
    size = args.microbatch_size or profile.batch_sizes[-1]
    if args.search and algo == "straight":
        return search_microbatch_and_order(
            profile,
            cluster,
            num_microbatches=args.microbatches,
            microbatch_sizes=[b for b in profile.batch_sizes if b <= size] or [size],
            schedule=args.schedule,
            optimizer=args.optimizer,
        )
    return plan_training(
        profile,
        cluster,
        microbatch_size=size,
        num_microbatches=args.microbatches,
        algo=algo,
        schedule=args.schedule,
        optimizer=args.optimizer,
    )


def _main_train(
    args: argparse.Namespace, profile: ModelProfile, cluster: ClusterSpec, out: TextIO
) -> TrainingPlan:
    plan = _train_plan(args, profile, cluster, args.planner)
    names = [u.name for u in profile.units]
    print(plan.describe(names), file=out)
    if args.compare:
        for other in TRAINING_ALGOS:
            if other == args.planner:
                continue
            try:
                alternative = _train_plan(args, profile, cluster, other)
            except ZpipeError as exc:
                print(f"\n{other}: no plan ({exc})", file=out)
                continue
            print(file=out)
            print(alternative.describe(names), file=out)
            mine = plan.predicted.get("samples_per_s", 0.0)
            theirs = alternative.predicted.get("samples_per_s", 0.0)
            if theirs > 0:
                print(
                    f"  {args.planner} / {other}: {mine / theirs:.2f}x predicted samples/s",
                    file=out,
                )
    return plan


def _main_inference(
    args: argparse.Namespace, profile: ModelProfile, cluster: ClusterSpec, out: TextIO
) -> Plan:
    size = args.microbatch_size if args.microbatch_size is not None else profile.batch_sizes[0]
    plan = plan_with(args.planner, profile, cluster, size, bucketing=args.bucketing)
    print(_table(plan, profile), file=out)
    if args.compare:
        for other in sorted(PLANNERS):
            if other == args.planner:
                continue
            try:
                alternative = plan_with(other, profile, cluster, size, bucketing=args.bucketing)
            except ZpipeError as exc:
                print(f"\n{other}: no plan ({exc})", file=out)
                continue
            print(file=out)
            print(_table(alternative, profile), file=out)
            mine = plan.predicted.get("throughput_samples_per_s", 0.0)
            theirs = predict_plan(alternative, profile, cluster, size)["throughput_samples_per_s"]
            if theirs > 0:
                print(
                    f"  {args.planner} / {other}: {mine / theirs:.2f}x predicted throughput",
                    file=out,
                )
    return plan


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_planner(parser, args)
    try:
        cluster = load_cluster(args.cluster)
    except ZpipeError as exc:  # the file a flag names is unusable: a usage error
        print(f"python -m zpipe plan: --cluster: {exc}", file=sys.stderr)
        return 2
    try:
        profile = read_profile_file(args.profile)
        # with --json -, stdout is the JSON alone: the tables go to stderr
        out = sys.stderr if str(args.json) == "-" else sys.stdout
        progress = TerminalProgress(False if args.quiet else None)
        what = "a training plan" if args.train else "a plan"
        with progress.phase(f"planning {what} over {len(cluster.devices)} devices"):
            plan: Plan | TrainingPlan = (
                _main_train(args, profile, cluster, out)
                if args.train
                else _main_inference(args, profile, cluster, out)
            )
        if args.json is not None:
            text = plan_json(plan.to_dict())
            if str(args.json) == "-":
                print(text)
            else:
                args.json.write_text(text + "\n")
    except ZpipeError as exc:
        print(f"python -m zpipe plan: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"python -m zpipe plan: {exc}", file=sys.stderr)
        return 1
    return 0
