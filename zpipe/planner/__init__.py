"""Planners: pure functions from profiles and a cluster to a :class:`Plan`."""

from __future__ import annotations

from zpipe.planner.plan import (
    Plan,
    StagePlan,
    even_ranges,
    plan_even_partition,
    plan_from_partition,
    validate_stages,
)

PLANNERS = ("even",)

__all__ = [
    "PLANNERS",
    "Plan",
    "StagePlan",
    "even_ranges",
    "plan_even_partition",
    "plan_from_partition",
    "validate_stages",
]
