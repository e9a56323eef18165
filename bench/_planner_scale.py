"""Planning at scale of ``bench/planner.py`` (section 4, issue 18): measured clusters
of 16 and 64 devices, the bucketing bound against the exact DP, 1000 identical
devices (split out of that script to keep it small; behaviour unchanged).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from bench._common import emit
from bench._planner_models import MINNOW_SPEED, VIT_LARGE, profile_of
from zpipe.planner import (
    CLIENT,
    ClusterDevice,
    ClusterSpec,
    InfeasiblePlanError,
    device_categories,
    plan_pipeedge,
)
from zpipe.planner.bucketing import bucket_cluster
from zpipe.planner.cluster import ClusterLink
from zpipe.planner.profile import ModelProfile, synthetic_profile
from zpipe.planner.synthetic_cluster import measured_cluster as synthetic_measured_cluster

# PipeEdge Table IV case 2's RCC-VE shares and a MinnowBoard: (speed, memory GiB, Mbit/s)
MEASURED_KINDS = [(1.0, 8, 1000.0), (0.75, 4, 100.0), (0.25, 4, 50.0), (MINNOW_SPEED, 2, 200.0)]


def measured_cluster(n: int, seed: int) -> ClusterSpec:
    """``n`` devices of :data:`MEASURED_KINDS`, every speed and link measured."""
    return synthetic_measured_cluster(n, seed, MEASURED_KINDS)


def _small_measured_instance(rng: random.Random) -> tuple[ModelProfile, ClusterSpec]:
    units = rng.randint(3, 8)
    profile = synthetic_profile(
        [rng.uniform(0.5, 3.0) for _ in range(units)],
        [rng.randint(0, 2_000_000) for _ in range(units)],
        param_bytes=[rng.randint(1, 10) for _ in range(units)],
        input_bytes=rng.randint(0, 1_000_000),
    )
    devices = tuple(
        ClusterDevice(f"d{i}", rng.choice([None, 25, 40]), rng.uniform(0.3, 1.5))
        for i in range(rng.randint(2, 6))
    )
    ends = [d.name for d in devices] + [CLIENT]
    links = {
        (a, b): ClusterLink(bandwidth_mbps=rng.uniform(2.0, 40.0))
        for a in ends
        for b in ends
        if a != b
    }
    return profile, ClusterSpec(devices, links)


def planning_at_scale(runs: int, bound_instances: int, seed: int) -> dict[str, Any]:
    """Section 4: measured clusters of 16 and 64, the bucketing bound, identical devices."""
    result: dict[str, Any] = {}
    profile = profile_of(VIT_LARGE, merge=1, fold_ends=True)
    for n in (16, 64):
        cluster = measured_cluster(n, seed)
        walls, cpus, plan = [], [], None
        for _ in range(runs):
            t0, c0 = time.perf_counter(), time.process_time()
            plan = plan_pipeedge(profile, cluster, batch_size=1)
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        assert plan is not None
        pred = plan.predicted
        emit(
            {
                "bench": "planner",
                "kind": "solve_time_measured",
                "devices": n,
                "units": profile.num_units,
                "exact_categories": len(device_categories(cluster)),
                "bucketed_categories": pred["num_categories"],
                "bucketing_tolerance": pred.get("bucketing_tolerance"),
                "certified_ratio": pred.get("bucketing_certified_ratio"),
                "dp_live_states": pred.get("dp_live_states"),
                "plan_devices": len(plan.stages),
                "bottleneck_s": pred["bottleneck_s"],
                "solve_s_median": statistics.median(walls),
                "cpu_s_median": statistics.median(cpus),
            }
        )
        result[f"solve_s_measured_{n}"] = statistics.median(walls)
        result[f"solve_cpu_s_measured_{n}"] = statistics.median(cpus)

    rng = random.Random(seed)
    ratios: list[float] = []
    certified: list[float] = []
    while len(ratios) < bound_instances:
        small, cluster = _small_measured_instance(rng)
        try:
            exact = plan_pipeedge(small, cluster, batch_size=1, bucketing="exact")
        except InfeasiblePlanError:
            continue
        bucketed = plan_pipeedge(small, cluster, batch_size=1, bucketing=0.05)
        ratios.append(bucketed.predicted["bottleneck_s"] / exact.predicted["bottleneck_s"])
        certified.append(bucketed.predicted["bucketing_certified_ratio"])
    line = {
        "bench": "planner",
        "kind": "bucketing_bound",
        "instances": len(ratios),
        "tolerance": 0.05,
        "bucketed_over_exact_bottleneck_max": max(ratios),
        "bucketed_over_exact_bottleneck_mean": statistics.fmean(ratios),
        "exactly_optimal_share": sum(r <= 1 + 1e-9 for r in ratios) / len(ratios),
        "certified_ratio_max": max(certified),
        "certified_ratio_mean": statistics.fmean(certified),
    }
    emit(line)
    result["bucketed_over_exact_bottleneck"] = line["bucketed_over_exact_bottleneck_max"]
    result["bucketed_over_exact_bottleneck_mean"] = line["bucketed_over_exact_bottleneck_mean"]
    result["certified_ratio_max"] = line["certified_ratio_max"]

    spec = {
        "format": "zpipe-cluster/1",
        "devices": [{"name": "d", "count": 1000, "memory_mb": 4096, "bandwidth_mbps": 100}],
    }
    identical = ClusterSpec.from_dict(spec)
    groups, plans = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        device_categories(identical)
        device_categories(bucket_cluster(identical, 0.05, batch_size=1).cluster)
        groups.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        plan_pipeedge(profile, identical, batch_size=1)
        plans.append(time.perf_counter() - t0)
    emit(
        {
            "bench": "planner",
            "kind": "identical_devices",
            "devices": 1000,
            "group_s_median": statistics.median(groups),
            "plan_s_median": statistics.median(plans),
        }
    )
    result["group_s_1000_identical"] = statistics.median(groups)
    result["plan_s_1000_identical"] = statistics.median(plans)
    return result
