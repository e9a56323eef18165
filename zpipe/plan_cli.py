"""``python -m zpipe plan``: choose devices, order and unit ranges from profiles and a cluster."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from zpipe._errors import ZpipeError
from zpipe.cli_common import positive_int
from zpipe.planner import PLANNERS, ClusterSpec, Plan, load_cluster, plan_with, predict_plan
from zpipe.planner.profile import ModelProfile


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m zpipe plan",
        description="Plan a pipeline: which devices take part, in what order, and which units "
        "each runs, minimising the slowest stage's max(compute, communication) under every "
        "device's memory budget. Prints a table and, with --json, the plan as JSON.",
    )
    parser.add_argument(
        "--profiles",
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
        help="cluster file: devices, memory, speed, links (format in README)",
    )
    parser.add_argument(
        "--algo",
        choices=sorted(PLANNERS),
        default="pipeedge",
        help="pipeedge (optimal, heterogeneity-aware), even (GPipe) or pipedream "
        "(homogeneous); default: pipeedge",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        help="micro-batch size to plan for (default: the profile's first)",
    )
    parser.add_argument(
        "--compare", action="store_true", help="also show every other planner's plan and prediction"
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the chosen plan as JSON ('-' for standard output)",
    )
    return parser


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
    return "\n".join(rows)


def plan_from_files(
    profile_path: Path, cluster_path: Path, algo: str, batch_size: int | None
) -> tuple[Plan, ModelProfile, ClusterSpec, int]:
    profile = ModelProfile.load(profile_path)
    cluster = load_cluster(cluster_path)
    size = batch_size if batch_size is not None else profile.batch_sizes[0]
    return plan_with(algo, profile, cluster, size), profile, cluster, size


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        plan, profile, cluster, size = plan_from_files(
            args.profiles, args.cluster, args.algo, args.batch_size
        )
        print(_table(plan, profile))
        if args.compare:
            for other in sorted(PLANNERS):
                if other == args.algo:
                    continue
                try:
                    alternative = plan_with(other, profile, cluster, size)
                except ZpipeError as exc:
                    print(f"\n{other}: no plan ({exc})")
                    continue
                print()
                print(_table(alternative, profile))
                mine = plan.predicted.get("throughput_samples_per_s", 0.0)
                theirs = predict_plan(alternative, profile, cluster, size)[
                    "throughput_samples_per_s"
                ]
                if theirs > 0:
                    print(f"  {args.algo} / {other}: {mine / theirs:.2f}x predicted throughput")
        if args.json is not None:
            text = json.dumps(plan.to_dict(), indent=1)
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
