"""Planners: pure functions from profiles and a cluster to a :class:`Plan`."""

from __future__ import annotations

from zpipe.planner.baselines import PLANNERS, plan_even, plan_pipedream, plan_with
from zpipe.planner.cluster import (
    CLIENT,
    CLUSTER_FORMAT,
    ClusterDevice,
    ClusterLink,
    ClusterSpec,
    load_cluster,
)
from zpipe.planner.cost import InfeasiblePlanError, device_unit_times, predict_plan
from zpipe.planner.generation import plan_generation, plan_generation_in_order
from zpipe.planner.generation_cost import (
    GenerationUnit,
    GenerationWorkload,
    check_generation_memory,
    kv_budget_tokens,
    kv_capacity_sequences,
    predict_generation,
)
from zpipe.planner.pipeedge import device_categories, plan_pipeedge, solve_pipeedge
from zpipe.planner.plan import (
    Plan,
    StagePlan,
    even_ranges,
    plan_even_partition,
    plan_from_partition,
    validate_stages,
)

__all__ = [
    "CLIENT",
    "CLUSTER_FORMAT",
    "PLANNERS",
    "ClusterDevice",
    "ClusterLink",
    "ClusterSpec",
    "GenerationUnit",
    "GenerationWorkload",
    "InfeasiblePlanError",
    "Plan",
    "StagePlan",
    "check_generation_memory",
    "device_categories",
    "device_unit_times",
    "even_ranges",
    "kv_budget_tokens",
    "kv_capacity_sequences",
    "load_cluster",
    "plan_even",
    "plan_even_partition",
    "plan_from_partition",
    "plan_generation",
    "plan_generation_in_order",
    "plan_pipedream",
    "plan_pipeedge",
    "plan_with",
    "predict_generation",
    "predict_plan",
    "solve_pipeedge",
    "validate_stages",
]
