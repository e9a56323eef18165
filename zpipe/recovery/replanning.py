"""Re-planning after a failure or a slowdown: lightweight, heavy and ResPipe's policy.

All three return the plan type the run already uses (an inference
:class:`~zpipe.planner.plan.Plan` or a
:class:`~zpipe.planner.training_plan.TrainingPlan`), so the coordinator
applies any of them the same way: compute the :mod:`weight redistribution
<zpipe.recovery.redistribution>` from the old plan to the new one, move the
weights, commit, bump the epoch.

- Lightweight (Asteroid, MobiCom '24, section 3.4, "layer-wise lightweight
  pipeline re-planning"): keep the surviving stages, their order and their
  devices, and only shift the partition points so that each stage's work
  (FLOPs, or profiled time) is in proportion to its capacity, the sum of its
  surviving devices' speeds. Every unit stays on its stage or moves to an
  adjacent surviving stage, so migrations run concurrently between neighbours.
  Exactly: among partitions whose new stage ``j`` draws units only from old
  stages ``j - 1``, ``j`` and ``j + 1`` (and the dead stages between them),
  it finds the least bottleneck ``max_j work_j / capacity_j``, and among
  those the one that moves the fewest weights. A dynamic program over
  boundary positions, each boundary confined to the two stages it separates:
  milliseconds. Given the profile and the cluster, a stage's cost is the
  planners' own (:mod:`zpipe.recovery.stage_costs`): its compute and the send
  of its cut's activation over the link to the next stage, within memory; so a
  cut after a large activation does not land on a slow sender, and the plan's
  ``predicted`` is the planners' prediction. Without them, work over capacity.
  The same call with no failure and re-estimated speeds is Eco-FL's workload
  migration (section 4.4).
- Heavy (Asteroid's "heavy rescheduling", FTPipeHD's re-partition): run the
  full planner again over the survivors: PipeEdge for inference, HPP (or any
  training algorithm) for training. Best plan, but needs profiles and links
  and may move most of the model.
- ResPipe (the baseline FTPipeHD compares with): the next stage takes over all
  of a failed stage's units, the last stage's go to the one before. No
  planning, the fewest moved weights, and an unbalanced pipeline afterwards.

A training stage whose group loses only some devices survives under all three
lightweight-style policies: the lost devices' samples of every micro-batch go
to the surviving members in proportion to their speeds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from typing import TypeVar, cast

from zpipe._errors import ConfigError
from zpipe.planner.baselines import plan_with
from zpipe.planner.capacity import speeds_from_cluster
from zpipe.planner.cluster import ClusterSpec
from zpipe.planner.hpp import plan_training, stage_warmup
from zpipe.planner.plan import Plan, StagePlan
from zpipe.planner.profile import ModelProfile
from zpipe.planner.training_plan import TrainingPlan, TrainStage
from zpipe.recovery.errors import RecoveryError
from zpipe.recovery.spans import stage_spans
from zpipe.recovery.stage_costs import (
    CostModel,
    StageCost,
    TrainShape,
    inference_batch_size,
    inference_stage_cost,
    predict,
    training_costs,
    training_stage_cost,
    with_speeds,
)

# Bound, not constrained, so that a caller holding either kind (``Plan | TrainingPlan``)
# gets the same union back.
PlanT = TypeVar("PlanT", bound=Plan | TrainingPlan)

# Bottlenecks within this relative distance are equal when choosing the plan that
# moves the fewest weights: prefix-sum differences are not bit-exact.
_TIE_RTOL = 1e-9


# -- work and capacity ------------------------------------------------------------------


def unit_work_from_profile(
    profile: ModelProfile, batch_size: int, *, training: bool = False
) -> list[float]:
    """Each unit's work as profiled time: forward, plus backward when ``training``.

    Asteroid weighs units by FLOPs; the profiled time on one reference device is
    the same kind of weight and already counts what FLOPs miss (memory-bound
    layers). Pass FLOPs to :func:`lightweight_replan` directly if you have them.
    """
    forward = profile.times(batch_size)
    if not training:
        return list(forward)
    backward = profile.backward_times(batch_size)
    return [f + b for f, b in zip(forward, backward, strict=True)]


def _speed(speeds: Mapping[str, float] | None, device: str) -> float:
    v = 1.0 if speeds is None else float(speeds.get(device, 1.0))
    if not (math.isfinite(v) and v > 0):
        raise ConfigError(f"device {device!r}: speed must be a positive number, got {v!r}")
    return v


# -- the lightweight partition ----------------------------------------------------------


def rebalance_boundaries(
    old_ranges: Sequence[tuple[int, int]],
    alive: Sequence[bool],
    capacities: Sequence[float],
    unit_work: Sequence[float],
    unit_bytes: Sequence[float] | None = None,
) -> list[tuple[int, int]]:
    """New ranges for the surviving stages: least bottleneck, adjacent moves, fewest bytes moved.

    ``old_ranges``: every old stage's ``[start, end)``; ``alive``: whether each
    survives; ``capacities``: one per surviving stage, in order. A stage costs its
    work over its capacity (links are not known here: :func:`balance_cuts` with a
    cost from :mod:`zpipe.recovery.stage_costs` when they are). ``unit_bytes``
    weighs the tie-break (default: every unit counts 1). Returns one range per
    surviving stage.
    """
    m = sum(1 for a in alive if a)
    if len(alive) == len(old_ranges) and m and len(capacities) != m:
        raise ConfigError(f"give one capacity per surviving stage ({m}), got {len(capacities)}")
    if any(not (math.isfinite(c) and c > 0) for c in capacities):
        raise ConfigError(f"capacities must be positive numbers, got {list(capacities)}")
    if any(not (math.isfinite(w) and w >= 0) for w in unit_work):
        raise ConfigError("unit work must be numbers >= 0")
    work_prefix = [0.0]
    for w in unit_work:
        work_prefix.append(work_prefix[-1] + w)

    def ratio(j: int, a: int, b: int) -> float:
        return (work_prefix[b] - work_prefix[a]) / capacities[j]

    return balance_cuts(old_ranges, alive, len(unit_work), ratio, unit_bytes)


def balance_cuts(
    old_ranges: Sequence[tuple[int, int]],
    alive: Sequence[bool],
    num_units: int,
    stage_cost: StageCost,
    unit_bytes: Sequence[float] | None = None,
) -> list[tuple[int, int]]:
    """Asteroid's lightweight cut placement under any per-stage cost.

    ``stage_cost(j, a, b)``: what new stage ``j`` (the ``j``-th survivor) costs
    on units ``[a, b)``, its send to the next stage included when links matter
    (``inf``: it cannot run them). Finds the least bottleneck ``max_j stage_cost``
    among partitions whose cuts each stay within the two surviving stages they
    separate (so every unit stays or moves to an adjacent stage), and among those
    the one that moves the fewest ``unit_bytes``. :class:`RecoveryError` when
    every such partition has a stage that cannot run.
    """
    if len(alive) != len(old_ranges):
        raise ConfigError("give one alive flag per old stage")
    kept = [r for r, a in zip(old_ranges, alive, strict=True) if a]
    m = len(kept)
    if m == 0:
        raise RecoveryError("no stage survives: there is nothing to re-plan over")
    if not old_ranges or old_ranges[-1][1] != num_units:
        raise ConfigError(
            f"the stages cover {old_ranges[-1][1] if old_ranges else 0} units but the model "
            f"has {num_units}"
        )
    weights = [1.0] * num_units if unit_bytes is None else [float(b) for b in unit_bytes]
    if len(weights) != num_units:
        raise ConfigError("unit_bytes needs one entry per unit")
    byte_prefix = [0.0]
    for b in weights:
        byte_prefix.append(byte_prefix[-1] + b)

    # Boundary j (between new stages j-1 and j) may lie anywhere in the old ranges of
    # surviving stages j-1 and j (and the dead ones between): then every unit moves at
    # most to an adjacent stage. Boundary 0 is 0 and boundary m is num_units.
    windows = [[0]]
    for j in range(1, m):
        windows.append(list(range(max(kept[j - 1][0], 1), min(kept[j][1], num_units - 1) + 1)))
    windows.append([num_units])

    # Both passes read every candidate stage; a cost may be a few table reads or more.
    memo: dict[tuple[int, int, int], float] = {}

    def cost(j: int, a: int, b: int) -> float:
        key = (j, a, b)
        value = memo.get(key)
        if value is None:
            value = memo[key] = stage_cost(j, a, b)
        return value

    def moved(j: int, a: int, b: int) -> float:
        lo, hi = max(a, kept[j][0]), min(b, kept[j][1])
        stay = byte_prefix[hi] - byte_prefix[lo] if hi > lo else 0.0
        return byte_prefix[b] - byte_prefix[a] - stay

    # Pass 1: the least bottleneck.
    best: dict[int, float] = {0: 0.0}
    for j in range(m):
        nxt: dict[int, float] = {}
        for b in windows[j + 1]:
            cands = [max(v, cost(j, a, b)) for a, v in best.items() if a < b]
            if cands:
                nxt[b] = min(cands)
        best = nxt
    bottleneck = best.get(num_units, math.inf)
    if not math.isfinite(bottleneck):
        raise RecoveryError(
            "no placement of the cuts between neighbouring survivors lets every stage run its "
            "units (memory): use heavy re-planning"
        )
    limit = bottleneck * (1 + _TIE_RTOL)

    # Pass 2: the fewest moved bytes among partitions within that bottleneck.
    spent: dict[int, tuple[float, int]] = {0: (0.0, -1)}
    parents: list[dict[int, int]] = []
    for j in range(m):
        step: dict[int, tuple[float, int]] = {}
        for b in windows[j + 1]:
            for a, (c, _) in spent.items():
                if a < b and cost(j, a, b) <= limit:
                    total = c + moved(j, a, b)
                    if b not in step or total < step[b][0]:
                        step[b] = (total, a)
        parents.append({b: a for b, (_, a) in step.items()})
        spent = step
    bounds = [num_units]
    for j in range(m - 1, -1, -1):
        bounds.append(parents[j][bounds[-1]])
    bounds.reverse()
    return [(bounds[j], bounds[j + 1]) for j in range(m)]


# -- building plans ---------------------------------------------------------------------


def _survivors(plan: Plan | TrainingPlan, failed: Collection[str]) -> list[tuple[str, ...]]:
    dead = set(failed)
    return [tuple(d for d in s.devices if d not in dead) for s in stage_spans(plan)]


def _resplit_shares(
    stage: TrainStage, members: tuple[str, ...], speeds: Mapping[str, float] | None
) -> tuple[int, ...]:
    """Survivors keep their samples; the lost devices' go to them by speed (largest remainder)."""
    share = dict(zip(stage.devices, stage.shares, strict=True))
    lost = stage.microbatch_size - sum(share[d] for d in members)
    # Devices that held weights but computed nothing (share 0) were kept idle for a
    # reason (memory): give them new samples only when no computing member is left.
    takers = [d for d in members if share[d] > 0] or list(members)
    total = sum(_speed(speeds, d) for d in takers)
    exact = {d: lost * _speed(speeds, d) / total for d in takers}
    extra = {d: math.floor(exact[d]) for d in takers}
    rest = lost - sum(extra.values())
    for d in sorted(takers, key=lambda d: (-(exact[d] - extra[d]), takers.index(d)))[:rest]:
        extra[d] += 1
    return tuple(share[d] + extra.get(d, 0) for d in members)


def _train_shapes(
    plan: TrainingPlan,
    groups: Sequence[tuple[str, ...]],
    old_index: Sequence[int],
    speeds: Mapping[str, float] | None,
) -> list[TrainShape]:
    """Each surviving stage's devices, shares and K_p: what its cuts do not change."""
    p = len(groups)
    same_depth = p == plan.num_stages
    shapes = []
    for k, (g, i) in enumerate(zip(groups, old_index, strict=True)):
        old = plan.stages[i]
        # K_p depends only on the stages after this one: unchanged when none was removed.
        warmup = (
            old.warmup if same_depth else stage_warmup(plan.schedule, p - k, plan.num_microbatches)
        )
        shapes.append(TrainShape(g, _resplit_shares(old, g, speeds), warmup))
    return shapes


def _rebuild(
    plan: PlanT,
    algo: str,
    groups: Sequence[tuple[str, ...]],
    ranges: Sequence[tuple[int, int]],
    shapes: Sequence[TrainShape],
    model: CostModel | None,
) -> PlanT:
    """The same kind of plan with the surviving ``groups`` on ``ranges``, and (given the
    cost ``model``) its prediction, as the planners make theirs."""
    rebuilt: Plan | TrainingPlan
    if isinstance(plan, Plan):
        stages = tuple(StagePlan(g[0], a, b) for g, (a, b) in zip(groups, ranges, strict=True))
        rebuilt = Plan(algo=algo, num_units=plan.num_units, stages=stages)
    else:
        rebuilt = TrainingPlan(
            algo=algo,
            schedule=plan.schedule,
            num_units=plan.num_units,
            microbatch_size=plan.microbatch_size,
            num_microbatches=plan.num_microbatches,
            stages=tuple(
                TrainStage(s.devices, a, b, s.shares, s.warmup)
                for s, (a, b) in zip(shapes, ranges, strict=True)
            ),
        )
    if model is not None:
        rebuilt = dataclasses.replace(rebuilt, predicted=predict(rebuilt, model))
    return cast(PlanT, rebuilt)


def _link_aware_cost(
    plan: Plan | TrainingPlan,
    model: CostModel,
    kept: Sequence[tuple[str, ...]],
    shapes: Sequence[TrainShape],
    *,
    memory: bool,
) -> StageCost:
    if isinstance(plan, TrainingPlan):
        costs = training_costs(model, plan)
        return training_stage_cost(costs, shapes, plan.num_microbatches, memory=memory)
    devices = [g[0] for g in kept]
    batch = inference_batch_size(model)
    return inference_stage_cost(model.profile, model.cluster, devices, batch, memory=memory)


def lightweight_replan(
    plan: PlanT,
    *,
    failed: Collection[str],
    unit_work: Sequence[float] | None = None,
    speeds: Mapping[str, float] | None = None,
    unit_bytes: Sequence[float] | None = None,
    model: CostModel | None = None,
) -> PlanT:
    """Asteroid's lightweight re-planning of ``plan`` without the ``failed`` devices.

    With a cost ``model`` (profile and cluster) the cuts are placed by the
    planners' own cost model (:mod:`zpipe.recovery.stage_costs`): each stage's
    compute on its devices and the send of its cut's activation over the link to
    the next stage, within memory where any placement allows it; ``speeds``, if
    given, replace the cluster's compute speeds (measured ones), and the plan's
    ``predicted`` is filled as a planner fills it.

    Without one: ``unit_work`` is each unit's FLOPs or profiled time
    (:func:`unit_work_from_profile`); ``speeds`` each device's relative speed
    ``v_d`` (default 1.0; FTPipeHD's re-estimated capacities give them, see
    :func:`zpipe.planner.capacity.speeds_from_capacities`); a stage's capacity
    is the sum over its surviving devices; links are not looked at.

    ``unit_bytes`` (weights per unit; default the profile's weights with a model)
    makes the tie-break count bytes rather than units. With no failure it
    rebalances for new speeds (Eco-FL's workload migration).
    """
    groups = _survivors(plan, failed)
    alive = [bool(g) for g in groups]
    kept = [g for g in groups if g]
    index = [i for i, a in enumerate(alive) if a]
    old_ranges = [(s.start, s.end) for s in stage_spans(plan)]
    if model is not None:
        model = dataclasses.replace(model, cluster=with_speeds(model.cluster, speeds))
        if model.profile.num_units != plan.num_units:
            raise ConfigError(
                f"the profile has {model.profile.num_units} units, the plan {plan.num_units}"
            )
        if speeds is None and isinstance(plan, TrainingPlan):
            speeds = speeds_from_cluster(model.profile, model.cluster, plan.microbatch_size)
    shapes = _train_shapes(plan, kept, index, speeds) if isinstance(plan, TrainingPlan) else []
    if model is None:
        if unit_work is None:
            raise ConfigError("lightweight re-planning needs unit_work or a cost model")
        if len(unit_work) != plan.num_units:
            raise ConfigError(
                f"unit_work has {len(unit_work)} entries, the plan {plan.num_units} units"
            )
        capacities = [sum(_speed(speeds, d) for d in g) for g in kept]
        ranges = rebalance_boundaries(old_ranges, alive, capacities, unit_work, unit_bytes)
    else:
        weights = unit_bytes
        if weights is None and any(model.profile.param_bytes()):
            weights = [float(b) for b in model.profile.param_bytes()]
        try:
            cost = _link_aware_cost(plan, model, kept, shapes, memory=True)
            ranges = balance_cuts(old_ranges, alive, plan.num_units, cost, weights)
        except RecoveryError:
            if not kept:
                raise
            # No placement fits memory: the least bottleneck regardless, as lightweight
            # re-planning always did; the prediction counts the memory violations.
            cost = _link_aware_cost(plan, model, kept, shapes, memory=False)
            ranges = balance_cuts(old_ranges, alive, plan.num_units, cost, weights)
    return _rebuild(plan, "lightweight", kept, ranges, shapes, model)


def respipe_replan(
    plan: PlanT,
    *,
    failed: Collection[str],
    speeds: Mapping[str, float] | None = None,
    model: CostModel | None = None,
) -> PlanT:
    """ResPipe's policy: the next surviving stage takes all of a failed stage's units.

    A failed last stage's units go to the surviving stage before it. ``speeds``
    only splits a group's samples when it loses some of its devices. The policy
    does not look at costs (it is the baseline that moves the fewest weights);
    with a cost ``model`` the plan's ``predicted`` says what its cuts cost.
    """
    groups = _survivors(plan, failed)
    index = [i for i, g in enumerate(groups) if g]
    if not index:
        raise RecoveryError("no stage survives: there is nothing to re-plan over")
    # Survivor k runs up to its old end, and from where the survivor before it ends: so
    # dead stages between two survivors go to the later one (their next stage), and dead
    # stages after the last survivor go back to it.
    spans = stage_spans(plan)
    ends: list[int] = [spans[i].end for i in index]
    ends[-1] = plan.num_units
    ranges = list(zip([0, *ends[:-1]], ends, strict=True))
    kept = [groups[i] for i in index]
    if model is not None:
        model = dataclasses.replace(model, cluster=with_speeds(model.cluster, speeds))
    shapes = _train_shapes(plan, kept, index, speeds) if isinstance(plan, TrainingPlan) else []
    return _rebuild(plan, "respipe", kept, ranges, shapes, model)


def surviving_cluster(cluster: ClusterSpec, failed: Collection[str]) -> ClusterSpec:
    """``cluster`` without the ``failed`` devices and their links."""
    dead = set(failed)
    devices = tuple(d for d in cluster.devices if d.name not in dead)
    if not devices:
        raise RecoveryError("every device failed: there is nothing to re-plan over")
    links = {
        (a, b): link for (a, b), link in cluster.links.items() if a not in dead and b not in dead
    }
    return ClusterSpec(devices=devices, links=links, client=cluster.client)


def heavy_replan_inference(
    profile: ModelProfile,
    cluster: ClusterSpec,
    *,
    failed: Collection[str],
    batch_size: int,
    algo: str = "pipeedge",
) -> Plan:
    """Run the full inference planner (PipeEdge by default) over the survivors."""
    return plan_with(algo, profile, surviving_cluster(cluster, failed), batch_size)


def heavy_replan_training(
    profile: ModelProfile,
    cluster: ClusterSpec,
    *,
    failed: Collection[str],
    microbatch_size: int,
    num_microbatches: int,
    algo: str = "hpp",
    schedule: str = "1f1b",
    optimizer: str = "sgd",
    block: int = 1,
) -> TrainingPlan:
    """Run the full training planner (Asteroid's HPP by default) over the survivors."""
    return plan_training(
        profile,
        surviving_cluster(cluster, failed),
        microbatch_size=microbatch_size,
        num_microbatches=num_microbatches,
        algo=algo,
        schedule=schedule,
        optimizer=optimizer,
        block=block,
    )


def stage_work(
    plan: Plan | TrainingPlan, unit_work: Sequence[float], speeds: Mapping[str, float] | None = None
) -> list[float]:
    """Each stage's work over its capacity: the quantity lightweight re-planning balances."""
    out = []
    for s in stage_spans(plan):
        cap = sum(_speed(speeds, d) for d in s.devices)
        out.append(math.fsum(unit_work[s.start : s.end]) / cap)
    return out
