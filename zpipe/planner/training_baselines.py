"""The baselines the training planners are compared with: data parallelism (one stage
over every device, Algorithm 1's shares) and GPipe's even partition."""

from __future__ import annotations

from collections.abc import Sequence

from zpipe._errors import InfeasiblePlanError
from zpipe.planner.cluster import ClusterDevice
from zpipe.planner.cost import fmt_bytes
from zpipe.planner.plan import even_ranges
from zpipe.planner.training_common import build_plan, raise_infeasible, stage_warmup
from zpipe.planner.training_cost import TrainingCosts, evaluate_group, group_cost
from zpipe.planner.training_plan import TrainingPlan, TrainStage


def plan_data_parallel(
    costs: TrainingCosts,
    devices: Sequence[ClusterDevice],
    *,
    num_microbatches: int,
    schedule: str,
    block: int,
) -> TrainingPlan:
    """One stage over every device that holds the whole model and one sample's activations;
    Algorithm 1's shares; devices left with no sample are dropped (they would only slow
    the all-reduce)."""
    num_units = costs.num_units
    warmup = stage_warmup(schedule, 1, num_microbatches)
    fits = [d for d in devices if costs.max_share(d, 0, num_units, warmup) >= 1]
    group = evaluate_group(costs, fits, 0, num_units, warmup, block=block) if fits else None
    if group is None:
        raise_infeasible(costs, devices, schedule, num_microbatches, "data-parallel")
    busy = [d for d, y in zip(fits, group.shares, strict=True) if y > 0]
    if len(busy) < len(fits):
        shares = [y for y in group.shares if y > 0]
        group = group_cost(costs, busy, 0, num_units, shares, warmup)
    stage = TrainStage(group.devices, 0, num_units, group.shares, warmup)
    return build_plan(
        costs,
        algo="data-parallel",
        schedule=schedule,
        num_microbatches=num_microbatches,
        stages=[stage],
    )


def plan_even(
    costs: TrainingCosts,
    devices: Sequence[ClusterDevice],
    *,
    num_microbatches: int,
    schedule: str,
) -> TrainingPlan:
    """GPipe's partition over ``devices`` in order; raises if a stage overflows its device."""
    used = list(devices[: costs.num_units])
    ranges = even_ranges(costs.num_units, len(used))
    b = costs.microbatch_size
    stages = []
    for s, (d, (i, j)) in enumerate(zip(used, ranges, strict=True)):
        warmup = stage_warmup(schedule, len(used) - s, num_microbatches)
        need = costs.memory_bytes(i, j, b, warmup)
        if d.memory_bytes is not None and need > d.memory_bytes:
            raise InfeasiblePlanError(
                f"the even plan puts units [{i}, {j}) on stage {s}, device {d.name}, which "
                f"needs {fmt_bytes(need)} (weights, gradients, optimizer state and {warmup} "
                f"micro-batches' activations) but holds {fmt_bytes(d.memory_bytes)}; "
                f"{fmt_bytes(need - d.memory_bytes)} short: use the hpp planner, add memory "
                "or use a smaller micro-batch"
            )
        stages.append(TrainStage((d.name,), i, j, (b,), warmup))
    return build_plan(
        costs, algo="even", schedule=schedule, num_microbatches=num_microbatches, stages=stages
    )
