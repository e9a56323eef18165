"""When a pipeline client re-schedules its home: Eco-FL's adaptive re-scheduling, pure.

Eco-FL (ICPP '22, section 4.4, Fig. 13): every worker reports its forward and
backward time; when the portal sees a large deviation between a device's current
and historical time, it re-schedules the whole pipeline (the device order and the
partition points; here also the micro-batch count, which :func:`plan_home`
searches with them), the devices migrate their layers, and training restarts.

A :class:`~zpipe.federated.pipeline_trainer.PipelineTrainer` does that between
its local tasks (each task is a fresh pipeline run, so the restart is free):

1. :func:`seconds_per_work` turns a task's stage counters into each device's
   time per unit of reference work (its measured time per micro-batch over its
   units' profiled time), so a device is comparable across plans that give it
   different layers.
2. :func:`decide` compares that with the device's history on the current plan
   (the median of the earlier tasks; :func:`zpipe.planner.capacity.find_deviations`).
   When some device departs by more than the threshold (slower or faster), its
   speed as planned is scaled by its history over its current time (the others
   keep theirs: their swings are noise by the same test), and :func:`plan_home`
   plans the home again at those speeds: device order, eq. 1 cuts, micro-batch
   count. The new plan is
   taken when its predicted round beats the current plan's at the same speeds by
   ``gain``; either way the departed devices' speeds become the planned ones.
   The caller starts the history again: every device's after a new plan (a
   device's time per work on other layers is not quite comparable: per-layer
   overheads), only the departed devices' when the plan stays (their current
   time is their new normal; a change that a task caught half-way, having begun
   during it, is then caught in full by the next task).

Speeds are rescaled, not replaced: the planned speeds (device classes, or what
an earlier re-schedule found) carry the home's relative speeds, and a measurement
only says how much one device changed since its history. That keeps the
comparison free of the gap between the analytic profile and this machine's real
cost per layer, which is the same before and after a change.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from zpipe._errors import ConfigError
from zpipe.federated.home_plan import mlp_profile, plan_home
from zpipe.federated.model import MLPShape
from zpipe.planner.capacity import find_deviations
from zpipe.planner.cluster import ClusterDevice, ClusterSpec
from zpipe.planner.profile import ModelProfile
from zpipe.planner.training_plan import TrainingPlan
from zpipe.recovery import unit_work_from_profile
from zpipe.recovery.stage_costs import CostModel, predict

# Eco-FL gives no figure for "a large deviation"; a device 1.5x slower (or 2x faster)
# than its history. Measurements on a loaded host swing by tens of percent.
DEFAULT_THRESHOLD = 0.5
# a new plan must be predicted this much shorter than the current one at the
# measured speeds (a re-plan for a few percent is within the measurement's noise)
DEFAULT_GAIN = 0.1


@dataclass(frozen=True)
class Reschedule:
    """What one look found: the plan to switch to (None: keep), and why.

    ``devices`` are the home's devices at the speeds now believed: the planned
    ones when nothing departed, else rescaled by the measurement (the trainer
    plans on them from now on). ``deviations`` is each device's current time over
    its history (2.0: twice as slow).
    """

    plan: TrainingPlan | None
    reason: str
    triggered: bool
    devices: tuple[ClusterDevice, ...]
    deviations: Mapping[str, float] = field(default_factory=dict)
    fields: Mapping[str, Any] = field(default_factory=dict)
    departed: tuple[str, ...] = ()


def seconds_per_work(
    plan: TrainingPlan, counters: Mapping[str, Any], profile: ModelProfile
) -> dict[str, float]:
    """Each computing device's measured time per micro-batch over its units' profiled
    time (forward + backward at the plan's micro-batch size): seconds per second of
    reference work. Devices that ran nothing (no counters, share 0) are left out."""
    work = unit_work_from_profile(profile, plan.microbatch_size, training=True)
    out: dict[str, float] = {}
    for stage in plan.stages:
        for device, share in zip(stage.devices, stage.shares, strict=True):
            c = counters.get(device) or {}
            forwards, backwards = int(c.get("microbatches") or 0), int(c.get("backwards") or 0)
            if share == 0 or forwards == 0 or backwards == 0:
                continue
            seconds = float(c.get("forward_s") or 0.0) / forwards
            seconds += float(c.get("backward_s") or 0.0) / backwards
            units = math.fsum(work[stage.start : stage.end]) * share / stage.microbatch_size
            if seconds > 0 and units > 0:
                out[device] = seconds / units
    return out


def decide(
    plan: TrainingPlan,
    devices: Sequence[ClusterDevice],
    history: Mapping[str, Sequence[float]],
    current: Mapping[str, float],
    *,
    shape: MLPShape,
    threshold: float = DEFAULT_THRESHOLD,
    gain: float = DEFAULT_GAIN,
    profile: ModelProfile | None = None,
    microbatch_sizes: Sequence[int] | None = None,
) -> Reschedule:
    """Whether the home re-schedules after a task (see the module notes).

    ``plan`` was planned over ``devices`` (their speeds as planned); ``history``
    holds each device's :func:`seconds_per_work` on earlier tasks of this plan,
    ``current`` the last task's. ``profile`` and ``microbatch_sizes`` are what the
    plan was planned with (:func:`plan_home`'s).
    """
    if not threshold > 0:
        raise ConfigError(f"the re-scheduling threshold must be > 0, got {threshold}")
    if not 0 <= gain < 1:
        raise ConfigError(f"the re-scheduling gain must lie in [0, 1), got {gain}")
    devices = tuple(devices)
    missing = [d for d in plan.devices if not history.get(d) or d not in current]
    if missing:
        return Reschedule(None, f"no history yet for {', '.join(missing)}", False, devices)
    deviations = {d: current[d] / statistics.median(history[d]) for d in plan.devices}
    # Eco-FL's check, as the planner keeps it: |current / median(history) - 1| > threshold
    found = find_deviations(
        {d: current[d] for d in plan.devices}, history, threshold=threshold, min_history=1
    )
    departed = sorted(d.device for d in found)
    rounded = {d: round(v, 3) for d, v in deviations.items()}
    if not departed:
        return Reschedule(None, "every device within the threshold", False, devices, rounded)
    rescaled = tuple(
        replace(d, speed=d.speed / deviations[d.name]) if d.name in departed else d for d in devices
    )
    batch = plan.minibatch_size
    candidate = plan_home(
        shape, rescaled, batch, profile=profile, microbatch_sizes=microbatch_sizes
    )
    model_profile = profile if profile is not None else _profile_for(shape, plan)
    now = float(predict(plan, CostModel(model_profile, ClusterSpec(rescaled)))["round_s"])
    then = float(candidate.predicted["round_s"])
    fields = {"departed": departed, "round_s": round(now, 9), "replanned_round_s": round(then, 9)}
    if _same(candidate, plan):
        reason = f"{', '.join(departed)} departed; the best plan is the current one"
        return Reschedule(None, reason, True, rescaled, rounded, fields, tuple(departed))
    if then > now * (1.0 - gain):
        reason = (
            f"{', '.join(departed)} departed; a new plan would gain "
            f"{1.0 - then / now:.1%} < {gain:.0%}"
        )
        return Reschedule(None, reason, True, rescaled, rounded, fields, tuple(departed))
    reason = f"{', '.join(departed)} departed; re-planned, round {now:.3g} -> {then:.3g} s"
    return Reschedule(candidate, reason, True, rescaled, rounded, fields, tuple(departed))


def _profile_for(shape: MLPShape, plan: TrainingPlan) -> ModelProfile:
    return mlp_profile(shape, [plan.microbatch_size])


def _same(a: TrainingPlan, b: TrainingPlan) -> bool:
    return (a.microbatch_size, [s.to_dict() for s in a.stages]) == (
        b.microbatch_size,
        [s.to_dict() for s in b.stages],
    )


def reorders(old: TrainingPlan, new: TrainingPlan) -> bool:
    """Whether ``new`` puts the devices in another order than ``old``."""
    return old.devices != new.devices
