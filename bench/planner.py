"""The planners on paper-sized problems: PipeEdge's solve time and predicted speedups.

Two measurements, both on the shared cost model (:mod:`zpipe.planner.cost`),
so nothing runs a model; this takes seconds on two cores.

1. Solve time of :func:`zpipe.planner.plan_pipeedge` (median of ``--runs``):
   48 units over 9 devices in 3 categories of 3 (PipeEdge Table II: 0.01 s
   for its "category dynamic programming") and 96 units over 16 devices in 4
   categories of 4.

2. PipeEdge Table IV's six heterogeneous clusters for ViT-Large, ViT-Huge and
   BERT-Large: the predicted throughput of PipeEdge's plan against GPipe's
   even partition and PipeDream's partition over all devices, each averaged
   over ``--orders`` seeded random device orders (PipeEdge section V-B averages
   10 random orders too), and the paper's measured numbers beside them. The
   baselines partition whole transformer blocks (GPipe's unit is a layer; the
   four units per block are PipeEdge's refinement, section III-C); PipeEdge
   partitions the four units per block. For reference each line also gives
   the even partition over the four units per block
   (``even_sublayer_units_items_per_s``): its cuts after a block's first or
   third unit send the residual too, up to 5x a block's output, which hurts on
   slow links.

3. Solve time of Asteroid's HPP planner (:func:`zpipe.planner.hpp.plan_training`,
   median of ``--hpp-runs``) on Asteroid Table 7's case: EfficientNet-B1's 213 layers
   (a synthetic training profile from the network's layer shapes at a 240x240 input,
   see :func:`efficientnet_b1_training_profile`) over 6 Jetson-like devices (2 NX,
   2 TX2, 2 Nano; 100 Mbit/s links), micro-batches of 8, 4 per round. Asteroid took
   480 s on a Jetson NX. Summary key ``hpp_solve_s_213x6``.

Models are synthetic profiles from FLOP counts, four units per transformer
block as in PipeEdge section III-C (attention scores and values; output
projection; first MLP layer; second MLP layer), plus an embedding unit and a
head unit. Times: FLOPs at one rate, chosen so that ViT-Large takes 4.36 s per
image on a full-speed RCC-VE: PipeEdge section V-A gives 2.43 images/s on 16
RCC-VEs as a 10.59x speedup over one, i.e. 0.229 images/s alone. The same rate
puts ViT-Huge at 11.7 s (the paper's numbers give 1.01 / 11.88 -> 11.8 s) and
BERT-Large at 11.7 s per 512-token sequence (1.05 / 12.78 -> 12.2 s).
Activations are float32; a stage boundary after the first or third unit of a
block carries the residual too (as PipeEdge's shards send it). Memory is the
weights plus the unit's input, output and scratch activations.

Devices: RCC-VE = speed 1.0 times its CPU share (Table IV's "CPU" column).
MinnowBoard = 0.6: section V-A's 2-stage (ViT-Large, BERT-Large) and 4-stage
(ViT-Huge) MinnowBoard throughputs against the single RCC-VE ones give 0.57,
0.71 and 0.58. Memory and bandwidth are Table IV's. Latency: 0.1 ms per
access link at 1 Gbit/s (cases 1-2), and the paper's fixed 20 ms per link
when it shapes bandwidth (cases 3-6: 10 ms per access link, links add both
ends). The client (data source and sink) has a 1 Gbit/s link; a device's own
access link still limits its hop from and to the client.

4. Planning at scale (issue 18), ViT-Large's 96 units: clusters as a coordinator
   measures them (:func:`measured_cluster`: four kinds of device, every speed within
   2 % of its kind's and every link, each direction and to the client, within 96-100 %
   of its cap, so no two numbers are equal). ``solve_s_measured_16`` and
   ``solve_s_measured_64``: wall time of ``plan_pipeedge`` (default ``bucketing="auto"``,
   which buckets these), with its CPU time beside it (``cpu_s``: the machine is shared,
   so wall time carries the load). ``bucketed_over_exact_bottleneck_{max,mean}``: on
   ``--bound-instances`` random measured instances small enough for the exact DP (up to
   8 units, 6 devices), the bucketed plan's real bottleneck over the exact optimum, and
   the largest certified ratio the plans reported. ``group_s_1000_identical``: grouping
   a cluster file entry with ``count: 1000`` (``device_categories`` on the exact and on
   the bucketed cluster); ``plan_s_1000_identical`` plans it.

Output: JSON lines (one per solve-time case, one per case and model), then one
summary object with ``solve_s_48x9``, ``solve_s_96x16``, ``hpp_solve_s_213x6`` and, for ViT-Large,
``speedup_vs_even_case{1..6}`` and ``speedup_vs_pipedream_case{1..6}``, and the keys of
section 4.

Helpers: ``bench/_planner_models.py`` (the transformer profiles, Table IV's clusters
and the paper's numbers), ``bench/_planner_hpp.py`` (section 3) and
``bench/_planner_scale.py`` (section 4).

Run: ``.venv/bin/python bench/planner.py`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emit, summary
from bench._planner_hpp import hpp_solve_time
from bench._planner_models import (
    GIB,
    MINNOW_SPEED,
    MODELS,
    PAPER,
    PAPER_STATED,
    TABLE_IV,
    VIT_LARGE,
    profile_of,
    table_iv_cluster,
)
from bench._planner_scale import planning_at_scale
from zpipe.planner import (
    ClusterDevice,
    ClusterSpec,
    InfeasiblePlanError,
    Plan,
    device_categories,
    plan_even,
    plan_pipedream,
    plan_pipeedge,
)
from zpipe.planner.profile import ModelProfile


def solve_time(profile: ModelProfile, cluster: ClusterSpec, runs: int) -> tuple[float, Plan]:
    times, plan = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        plan = plan_pipeedge(profile, cluster, batch_size=1)
        times.append(time.perf_counter() - t0)
    assert plan is not None
    return statistics.median(times), plan


def solve_cluster(rows: Sequence[tuple[int, float, int, float]]) -> ClusterSpec:
    devices = [
        ClusterDevice(f"c{c}_{k}", mem * GIB, speed, mbps, 10.0)
        for c, (count, speed, mem, mbps) in enumerate(rows)
        for k in range(count)
    ]
    return ClusterSpec(tuple(devices))


def baseline_mean(
    planner: Callable[..., Plan],
    profile: ModelProfile,
    cluster: ClusterSpec,
    orders: int,
    seed: int,
) -> dict[str, Any]:
    """Mean predicted throughput over ``orders`` seeded random device orders."""
    rng = random.Random(seed)
    values, infeasible = [], 0
    for _ in range(orders):
        shuffled = list(cluster.devices)
        rng.shuffle(shuffled)
        try:
            plan = planner(
                profile, dataclasses.replace(cluster, devices=tuple(shuffled)), batch_size=1
            )
        except InfeasiblePlanError:
            infeasible += 1  # counts as 0 items/s: that order cannot run
            values.append(0.0)
            continue
        values.append(plan.predicted["throughput_samples_per_s"])
    table_order = planner(profile, cluster, batch_size=1).predicted["throughput_samples_per_s"]
    return {
        "mean": statistics.fmean(values),
        "min": min(values),
        "max": max(values),
        "table_order": table_order,
        "infeasible_orders": infeasible,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="PipeEdge planner: solve time (Table II) and predicted speedups on the six "
        "heterogeneous clusters of PipeEdge Table IV. Prints JSON lines and one summary.",
    )
    parser.add_argument("--runs", type=int, default=15, help="solves per timing (median)")
    parser.add_argument(
        "--orders", type=int, default=10, help="random device orders for GPipe/PipeDream"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random orders")
    parser.add_argument(
        "--hpp-runs", type=int, default=3, help="HPP solves of the 213x6 case (median)"
    )
    parser.add_argument(
        "--measured-runs", type=int, default=3, help="solves per measured-cluster timing"
    )
    parser.add_argument(
        "--bound-instances",
        type=int,
        default=200,
        help="random small instances solved exactly and bucketed (section 4)",
    )
    args = parser.parse_args(argv)

    result: dict[str, Any] = {}
    plan_pipeedge(profile_of(VIT_LARGE), table_iv_cluster(1), batch_size=1)  # warm numpy
    timing_cases = {
        "48x9": (
            profile_of(VIT_LARGE, merge=2, fold_ends=True),
            solve_cluster([(3, 1.0, 8, 1000), (3, 0.5, 4, 100), (3, MINNOW_SPEED, 2, 50)]),
        ),
        "96x16": (
            profile_of(VIT_LARGE, merge=1, fold_ends=True),
            solve_cluster(
                [(4, 1.0, 8, 30), (4, 1.0, 8, 20), (4, MINNOW_SPEED, 2, 10),
                 (4, MINNOW_SPEED, 2, 5)]
            ),
        ),
    }  # fmt: skip
    for label, (profile, cluster) in timing_cases.items():
        median, plan = solve_time(profile, cluster, args.runs)
        emit(
            {
                "bench": "planner",
                "kind": "solve_time",
                "case": label,
                "units": profile.num_units,
                "devices": len(cluster.devices),
                "categories": len(device_categories(cluster)),
                "solve_s_median": median,
                "runs": args.runs,
                "plan_devices": len(plan.stages),
                "paper_solve_s": 0.01 if label == "48x9" else None,
            }
        )
        result[f"solve_s_{label}"] = median

    result.update(planning_at_scale(args.measured_runs, args.bound_instances, args.seed))

    hpp = hpp_solve_time(args.hpp_runs)
    emit(hpp)
    result["hpp_solve_s_213x6"] = hpp["solve_s_median"]

    for case in TABLE_IV:
        cluster = table_iv_cluster(case)
        for model in MODELS:
            profile = profile_of(model)
            edge = plan_pipeedge(profile, cluster, batch_size=1)
            edge_thr = edge.predicted["throughput_samples_per_s"]
            # GPipe and PipeDream partition whole blocks (PipeEdge section III-C: GPipe's
            # smallest unit is a layer; the four-way block split is PipeEdge's own).
            blocks = profile_of(model, merge=4, fold_ends=True)
            even = baseline_mean(plan_even, blocks, cluster, args.orders, args.seed)
            dream = baseline_mean(plan_pipedream, blocks, cluster, args.orders, args.seed)
            even_sub = baseline_mean(plan_even, profile, cluster, args.orders, args.seed)
            paper_edge, paper_base = PAPER[case][model.name]
            line = {
                "bench": "planner",
                "kind": "table_iv",
                "case": case,
                "model": model.name,
                "units": profile.num_units,
                "devices": len(cluster.devices),
                "pipeedge_items_per_s": edge_thr,
                "pipeedge_devices": len(edge.stages),
                "pipeedge_plan": [[s.device, s.start, s.end] for s in edge.stages],
                "even_items_per_s": even,
                "pipedream_items_per_s": dream,
                "even_sublayer_units_items_per_s": even_sub,
                "speedup_vs_even": edge_thr / even["mean"],
                "speedup_vs_pipedream": edge_thr / dream["mean"],
                "paper_pipeedge_items_per_s": paper_edge,
                "paper_baseline_items_per_s": paper_base,
                "paper_speedup": paper_edge / paper_base,
                "paper_stated_speedup_vs_pipedream": PAPER_STATED.get((case, model.name)),
            }
            emit(line)
            if model is VIT_LARGE:
                result[f"speedup_vs_even_case{case}"] = line["speedup_vs_even"]
                result[f"speedup_vs_pipedream_case{case}"] = line["speedup_vs_pipedream"]
                result[f"paper_speedup_case{case}"] = line["paper_speedup"]
    result["speedup_model"] = VIT_LARGE.name
    summary("planner", **result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
