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
  milliseconds, no profile of links or memory needed. The same call with no
  failure and re-estimated speeds is Eco-FL's workload migration (section 4.4).
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

import math
from collections.abc import Collection, Mapping, Sequence
from typing import TypeVar, cast

from zpipe._errors import ConfigError
from zpipe.planner.baselines import plan_with
from zpipe.planner.cluster import ClusterSpec
from zpipe.planner.hpp import plan_training, stage_warmup
from zpipe.planner.plan import Plan, StagePlan
from zpipe.planner.profile import ModelProfile
from zpipe.planner.training_plan import TrainingPlan, TrainStage
from zpipe.recovery.errors import RecoveryError
from zpipe.recovery.spans import stage_spans

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
    survives; ``capacities``: one per surviving stage, in order. ``unit_bytes``
    weighs the tie-break (default: every unit counts 1). Returns one range per
    surviving stage.
    """
    num_units = len(unit_work)
    if len(alive) != len(old_ranges):
        raise ConfigError("give one alive flag per old stage")
    kept = [r for r, a in zip(old_ranges, alive, strict=True) if a]
    m = len(kept)
    if m == 0:
        raise RecoveryError("no stage survives: there is nothing to re-plan over")
    if len(capacities) != m:
        raise ConfigError(f"give one capacity per surviving stage ({m}), got {len(capacities)}")
    if any(not (math.isfinite(c) and c > 0) for c in capacities):
        raise ConfigError(f"capacities must be positive numbers, got {list(capacities)}")
    if any(not (math.isfinite(w) and w >= 0) for w in unit_work):
        raise ConfigError("unit work must be numbers >= 0")
    if not old_ranges or old_ranges[-1][1] != num_units:
        raise ConfigError(
            f"the stages cover {old_ranges[-1][1] if old_ranges else 0} units but unit_work "
            f"has {num_units}"
        )
    weights = [1.0] * num_units if unit_bytes is None else [float(b) for b in unit_bytes]
    if len(weights) != num_units:
        raise ConfigError("unit_bytes needs one entry per unit")
    work_prefix = [0.0]
    for w in unit_work:
        work_prefix.append(work_prefix[-1] + w)
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

    def ratio(j: int, a: int, b: int) -> float:
        return (work_prefix[b] - work_prefix[a]) / capacities[j]

    def moved(j: int, a: int, b: int) -> float:
        lo, hi = max(a, kept[j][0]), min(b, kept[j][1])
        stay = byte_prefix[hi] - byte_prefix[lo] if hi > lo else 0.0
        return byte_prefix[b] - byte_prefix[a] - stay

    # Pass 1: the least bottleneck.
    best: dict[int, float] = {0: 0.0}
    for j in range(m):
        nxt: dict[int, float] = {}
        for b in windows[j + 1]:
            cands = [max(v, ratio(j, a, b)) for a, v in best.items() if a < b]
            if cands:
                nxt[b] = min(cands)
        best = nxt
    bottleneck = best[num_units]
    limit = bottleneck * (1 + _TIE_RTOL)

    # Pass 2: the fewest moved bytes among partitions within that bottleneck.
    cost: dict[int, tuple[float, int]] = {0: (0.0, -1)}
    parents: list[dict[int, int]] = []
    for j in range(m):
        step: dict[int, tuple[float, int]] = {}
        for b in windows[j + 1]:
            for a, (c, _) in cost.items():
                if a < b and ratio(j, a, b) <= limit:
                    total = c + moved(j, a, b)
                    if b not in step or total < step[b][0]:
                        step[b] = (total, a)
        parents.append({b: a for b, (_, a) in step.items()})
        cost = step
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


def _rebuild(
    plan: PlanT,
    algo: str,
    groups: Sequence[tuple[str, ...]],
    ranges: Sequence[tuple[int, int]],
    old_index: Sequence[int],
    speeds: Mapping[str, float] | None,
) -> PlanT:
    """The same kind of plan with the surviving ``groups`` on ``ranges``."""
    if isinstance(plan, Plan):
        stages = tuple(StagePlan(g[0], a, b) for g, (a, b) in zip(groups, ranges, strict=True))
        return cast(PlanT, Plan(algo=algo, num_units=plan.num_units, stages=stages))
    p = len(groups)
    same_depth = p == plan.num_stages
    train_stages = []
    for k, (g, (a, b), i) in enumerate(zip(groups, ranges, old_index, strict=True)):
        old = plan.stages[i]
        # K_p depends only on the stages after this one: unchanged when none was removed.
        warmup = (
            old.warmup if same_depth else stage_warmup(plan.schedule, p - k, plan.num_microbatches)
        )
        train_stages.append(
            TrainStage(
                devices=g, start=a, end=b, shares=_resplit_shares(old, g, speeds), warmup=warmup
            )
        )
    rebuilt = TrainingPlan(
        algo=algo,
        schedule=plan.schedule,
        num_units=plan.num_units,
        microbatch_size=plan.microbatch_size,
        num_microbatches=plan.num_microbatches,
        stages=tuple(train_stages),
    )
    return cast(PlanT, rebuilt)


def lightweight_replan(
    plan: PlanT,
    *,
    failed: Collection[str],
    unit_work: Sequence[float],
    speeds: Mapping[str, float] | None = None,
    unit_bytes: Sequence[float] | None = None,
) -> PlanT:
    """Asteroid's lightweight re-planning of ``plan`` without the ``failed`` devices.

    ``unit_work``: each unit's FLOPs or profiled time (:func:`unit_work_from_profile`);
    ``speeds``: each device's relative speed ``v_d`` (default 1.0; FTPipeHD's
    re-estimated capacities give them, see
    :func:`zpipe.recovery.capacity.speeds_from_capacities`); a stage's capacity
    is the sum over its surviving devices. ``unit_bytes`` (weights per unit)
    makes the tie-break count bytes rather than units. With no failure it
    rebalances for new speeds (Eco-FL's workload migration).
    """
    groups = _survivors(plan, failed)
    alive = [bool(g) for g in groups]
    if len(unit_work) != plan.num_units:
        raise ConfigError(
            f"unit_work has {len(unit_work)} entries, the plan {plan.num_units} units"
        )
    kept = [g for g in groups if g]
    capacities = [sum(_speed(speeds, d) for d in g) for g in kept]
    old_ranges = [(s.start, s.end) for s in stage_spans(plan)]
    ranges = rebalance_boundaries(old_ranges, alive, capacities, unit_work, unit_bytes)
    index = [i for i, a in enumerate(alive) if a]
    return _rebuild(plan, "lightweight", kept, ranges, index, speeds)


def respipe_replan(
    plan: PlanT, *, failed: Collection[str], speeds: Mapping[str, float] | None = None
) -> PlanT:
    """ResPipe's policy: the next surviving stage takes all of a failed stage's units.

    A failed last stage's units go to the surviving stage before it. ``speeds``
    only splits a group's samples when it loses some of its devices.
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
    return _rebuild(plan, "respipe", [groups[i] for i in index], ranges, index, speeds)


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
