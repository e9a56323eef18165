"""What every training planner shares: device order, warm-ups, memory checks, and the
plan with its predictions from the one cost model (so plans of every kind compare fairly)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NoReturn

from zpipe._errors import ConfigError, InfeasiblePlanError
from zpipe.planner.cluster import ClusterDevice, ClusterSpec
from zpipe.planner.cost import fmt_bytes
from zpipe.planner.schedules import asteroid_warmup
from zpipe.planner.training_cost import TrainingCosts, predict_training
from zpipe.planner.training_plan import (
    TRAINING_ALGOS,
    TRAINING_SCHEDULES,
    TrainingPlan,
    TrainStage,
)


def memory_order(devices: Sequence[ClusterDevice]) -> list[ClusterDevice]:
    """Asteroid's device order: most memory first, unlimited first of all; ties keep order."""
    return sorted(devices, key=lambda d: -math.inf if d.memory_bytes is None else -d.memory_bytes)


def stage_warmup(schedule: str, stages_from_end: int, num_microbatches: int) -> int:
    """K of a stage followed by ``stages_from_end - 1`` more: Asteroid's for 1F1B, M for GPipe."""
    if schedule == "gpipe":
        return num_microbatches
    return asteroid_warmup(stages_from_end, 0, num_microbatches)


def in_flight_capacity(costs: TrainingCosts, device: ClusterDevice, start: int, end: int) -> int:
    """Q_s: how many micro-batches' activations ``device`` holds beside the stage's weights."""
    if device.memory_bytes is None:
        return 1 << 30
    b = costs.microbatch_size
    saved = costs.saved_bytes(start, end, b)
    # beside the weights, their state and the one forward that runs (the memory model)
    running = max(
        float(costs.running_bytes(start, end, b)),
        costs.step_copies * costs.weight_bytes(start, end),
    )
    room = device.memory_bytes - costs.static_bytes(start, end) - running
    if saved <= 0:
        return 1 << 30 if room >= 0 else 0
    return max(0, int(room // saved))


def build_plan(
    costs: TrainingCosts,
    *,
    algo: str,
    schedule: str,
    num_microbatches: int,
    stages: Sequence[TrainStage],
    extra: dict[str, float] | None = None,
) -> TrainingPlan:
    plan = TrainingPlan(
        algo=algo,
        schedule=schedule,
        num_units=costs.num_units,
        microbatch_size=costs.microbatch_size,
        num_microbatches=num_microbatches,
        stages=tuple(stages),
    )
    predicted = predict_training(plan, costs)
    predicted.update(extra or {})
    return TrainingPlan(
        algo=algo,
        schedule=schedule,
        num_units=plan.num_units,
        microbatch_size=plan.microbatch_size,
        num_microbatches=num_microbatches,
        stages=plan.stages,
        predicted=predicted,
    )


def raise_infeasible(
    costs: TrainingCosts,
    devices: Sequence[ClusterDevice],
    schedule: str,
    num_microbatches: int,
    algo: str,
    *,
    order_fixed: bool = False,
) -> NoReturn:
    """Raise :class:`InfeasiblePlanError` saying how far the memory falls short.

    The least any plan needs: every unit's weights, gradients and optimizer
    state once, plus one micro-batch's activations (GPipe: M of them).
    """
    num_units, b = costs.num_units, costs.microbatch_size
    least_k = num_microbatches if schedule == "gpipe" else 1
    need = costs.memory_bytes(0, num_units, b, least_k)
    saved = least_k * costs.saved_bytes(0, num_units, b)
    held = sum(d.memory_bytes or 0 for d in devices)
    what = (
        f"training needs at least {fmt_bytes(need)} (weights, gradients and {costs.optimizer} "
        f"state: {fmt_bytes(costs.static_bytes(0, num_units))}; activations of "
        f"{least_k} micro-batch(es) of {b}: {fmt_bytes(saved)})"
    )
    limited = all(d.memory_bytes is not None for d in devices)
    if limited and need > held:
        raise InfeasiblePlanError(
            f"{what} but the {len(devices)} devices hold {fmt_bytes(held)} together; "
            f"{fmt_bytes(need - held)} short: add devices or memory, use a smaller micro-batch "
            "or an optimizer with less state"
        )
    largest = max(d.memory_bytes or 0 for d in devices)
    for k in range(num_units):
        unit_need = costs.static_bytes(k, k + 1)
        if limited and unit_need > largest:
            raise InfeasiblePlanError(
                f"unit {k} ({costs.profile.units[k].name}) alone needs {fmt_bytes(unit_need)} "
                f"for its weights, gradients and {costs.optimizer} state, but the largest "
                f"device holds {fmt_bytes(largest)}; {fmt_bytes(unit_need - largest)} short"
            )
    hints = ["another device order"] if order_fixed else []
    hints += ["a smaller micro-batch"] + (["the hpp planner"] if algo != "hpp" else [])
    raise InfeasiblePlanError(
        f"{what} and the {len(devices)} devices hold {fmt_bytes(held)} together, but no "
        f"{algo} plan fits every device's memory (the stages do not pack into the devices' "
        f"sizes); try {', '.join(hints)} or more memory"
    )


def select_devices(cluster: ClusterSpec, names: Sequence[str] | None) -> list[ClusterDevice]:
    if names is None:
        return list(cluster.devices)
    if not names:
        raise ConfigError("give at least one device to plan over")
    if len(set(names)) != len(names):
        raise ConfigError(f"a device is named twice in {list(names)}")
    return [cluster.device(n) for n in names]


def check_choices(algo: str, schedule: str, num_microbatches: int) -> None:
    if algo not in TRAINING_ALGOS:
        raise ConfigError(f"unknown training planner {algo!r}; known: {', '.join(TRAINING_ALGOS)}")
    if schedule not in TRAINING_SCHEDULES:
        raise ConfigError(
            f"unknown schedule {schedule!r}; use one of {', '.join(TRAINING_SCHEDULES)}"
        )
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int):
        raise ConfigError(f"num_microbatches must be an integer, got {num_microbatches!r}")
    if num_microbatches < 1:
        raise ConfigError(f"num_microbatches must be >= 1, got {num_microbatches}")
