"""The coordinator's decisions that both run kinds share, as pure functions.

Who takes part in a run, how a plan is repaired without its dead, where a
recovering stage gets its units' weights: each decided here from plain data
(members, plans, replicas), by calling :mod:`zpipe.recovery` and
:mod:`zpipe.planner`, never re-implementing them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from zpipe._errors import ConfigError, InfeasiblePlanError, UnitsLostError
from zpipe.coordinator.current_run import KeptReplica
from zpipe.coordinator.membership import Member, Membership, MemberState
from zpipe.coordinator.planning import cluster_from_members
from zpipe.planner import ClusterLink, Plan
from zpipe.planner.memory import DEFAULT_MEMORY_MARGIN
from zpipe.planner.profile import ModelProfile
from zpipe.planner.training_plan import TrainingPlan
from zpipe.protocol.stage_control import Weights
from zpipe.recovery import (
    COORDINATOR,
    ReplicaPoint,
    StageSpan,
    WeightsLostError,
    plan_recovery,
    plan_restore,
)
from zpipe.recovery import Replica as HeldUnits
from zpipe.recovery.replanning import RecoveryError

if TYPE_CHECKING:
    import torch


PlanT = TypeVar("PlanT", Plan, TrainingPlan)


def live_members(membership: Membership) -> list[Member]:
    """Members that take work now (alive and not suspect), in the order they joined."""
    return [m for m in membership.alive() if m.state is MemberState.ALIVE]


def pick_stages(
    membership: Membership, names: Sequence[str] | None, count: int | None
) -> list[Member] | str:
    """The stages a run asks for (by name, or ``count`` of them, or all), or what is missing.

    By name order, so that the same cluster gives the same plan whatever the join order.
    """
    alive = sorted(live_members(membership), key=lambda m: m.name)
    if names is not None:
        by_name = {m.name: m for m in alive}
        if all(n in by_name for n in names):
            return [by_name[n] for n in names]
        missing = [n for n in names if n not in by_name]
        return f"stages {missing} are not registered"
    # Without a count, every stage registered now takes part.
    need = count or 1
    if len(alive) >= need:
        return alive[:need] if count is not None else alive
    return f"{len(alive)} stages registered, {need} needed"


def replan_in_place(
    plan: PlanT,
    failed: Collection[str],
    policy: str,
    survivors: Sequence[Member],
    profiles: Mapping[str, ModelProfile | None],
    *,
    batch_size: int,
    train: bool,
    optimizer: str = "sgd",
    links: Mapping[tuple[str, str], ClusterLink] | None = None,
    margin: float = DEFAULT_MEMORY_MARGIN,
) -> PlanT:
    """The surviving stages keep their order (:func:`zpipe.recovery.plan_recovery`):
    "lightweight" moves unit boundaries so each stage's work matches its speed,
    "respipe" hands a dead stage's units to the next one. When every survivor has a
    cached profile, the cuts are costed as the planners cost them (each device's own
    times, the measured ``links`` where there are, else the links the stages declared,
    memory) and the plan carries the planners' prediction; else every unit and device
    counts alike."""
    unit_work: list[float] = [1.0] * plan.num_units
    profile: ModelProfile | None = None
    cluster = None
    known = {m.name: p for m in survivors if (p := profiles.get(m.name)) is not None}
    if survivors and len(known) == len(survivors):
        profile = known[survivors[0].name]
        cluster = cluster_from_members(survivors, known, links=links, margin=margin, training=train)
    try:
        recovered = plan_recovery(
            plan,
            failed=failed,
            policy=policy,
            unit_work=None if cluster is not None else unit_work,
            profile=profile,
            cluster=cluster,
            batch_size=batch_size,
            optimizer=optimizer,
        )
    except RecoveryError as exc:
        raise InfeasiblePlanError(str(exc)) from exc
    new = recovered.plan
    assert isinstance(new, type(plan))
    return new


def held_at_coordinator(state: Mapping[str, torch.Tensor]) -> set[int]:
    """The units a replica's state holds here."""
    from zpipe.models.weights import split_unit_key  # needs torch: at the first run

    return {u[0] for key in state if (u := split_unit_key(key)) is not None}


def units_state(state: Mapping[str, torch.Tensor], start: int, end: int) -> dict[str, torch.Tensor]:
    """The entries of a replica that belong to units ``[start, end)``."""
    from zpipe.models.weights import split_unit_key  # needs torch: at the first run

    out = {}
    for key, tensor in state.items():
        parsed = split_unit_key(key)
        if parsed is not None and start <= parsed[0] < end:
            out[key] = tensor
    return out


@dataclass(frozen=True)
class RestoreChoice:
    """How a resumed run gets its weights: from ``replica`` (the one resumed from, or
    its older global ``fallback``), each device's ``fetches`` (snapshots kept at the
    stages: its own, a peer's, a backup) and the ranges ``from_coordinator`` (sent
    with the assignment)."""

    replica: KeptReplica
    fetches: dict[str, list[dict[str, Any]]]
    from_coordinator: dict[str, list[tuple[int, int]]]
    # the replica resumed from lost some unit: its older global fallback serves
    fell_back: bool = False


def replica_points(
    replica: KeptReplica, *, fallback: bool = True
) -> list[tuple[KeptReplica, ReplicaPoint]]:
    """The copies a recovery may restore from, newest first: ``replica`` (each device's
    own snapshot and the backups its holder keeps, when kept at the stages; what the
    coordinator holds) and, with ``fallback``, the older global replica behind it."""
    here = held_at_coordinator(replica.state)
    copies: list[HeldUnits] = []
    for stage in replica.plan.stages:
        holder = replica.holders.get(stage.devices[0], "")
        if holder and holder != COORDINATOR:
            for unit in range(stage.start, stage.end):
                # `fast`: a backup is older than the survivors' newest state held here
                if not (replica.fast and unit in here):
                    copies.append(HeldUnits(holder, unit, unit + 1, replica.step))
    for unit in sorted(here):
        copies.append(HeldUnits(COORDINATOR, unit, unit + 1, replica.step))
    if replica.complete:
        # every unit is here, those without parameters too (they hold nothing)
        copies.append(HeldUnits(COORDINATOR, 0, replica.plan.num_units, replica.step))
    own = replica.at_stages and not replica.fast
    points = [(replica, ReplicaPoint(replica.step, replica.plan, tuple(copies), own))]
    older = replica.fallback
    if fallback and older is not None:
        whole = (HeldUnits(COORDINATOR, 0, older.plan.num_units, older.step),)
        points.append((older, ReplicaPoint(older.step, older.plan, whole, False)))
    return points


def restore_from(
    replica: KeptReplica, new: Sequence[StageSpan], alive: Collection[str], *, fallback: bool = True
) -> RestoreChoice:
    """Where each device of ``new`` gets its units: FTPipeHD's Algorithm 1
    (:func:`zpipe.recovery.plan_restore`) over the replica's copies, each unit from
    the nearest live holder (the device's own snapshot, a surviving member of the
    stage that held it, the backup a neighbour keeps, the coordinator), or, when
    some unit has no live holder there (two adjacent stages died: one held the
    other's backup), from the older global replica behind it. Each fetch entry
    names its ``owner``: whose snapshot it is."""
    points = replica_points(replica, fallback=fallback)
    failed = {d for r, _ in points for d in r.plan.devices if d not in alive}
    try:
        restore = plan_restore(new, failed=failed, points=[p for _, p in points])
    except WeightsLostError as exc:
        lost = exc.units
        stages = [s for s in replica.plan.stages if any(s.start <= u < s.end for u in lost)]
        ran = ", ".join(d for s in stages for d in s.devices)
        held = ", ".join(replica.holders.get(s.devices[0]) or "none" for s in stages)
        raise UnitsLostError(
            (lost[0], lost[-1] + 1), f"{ran} and the holder of their backup ({held}) are gone"
        ) from exc
    used = points[restore.index][0]
    moves = restore.moves
    ranges = [(t.dest, t.source, t.start, t.end) for t in moves.transfers]
    ranges += [(k.device, k.device, k.start, k.end) for k in moves.kept]
    fetches: dict[str, list[dict[str, Any]]] = {d: [] for s in new for d in s.devices}
    here: dict[str, list[tuple[int, int]]] = {d: [] for s in new for d in s.devices}
    for dest, source, start, end in sorted(ranges, key=lambda r: (r[0], r[2])):
        if source == COORDINATOR:
            here[dest].append((start, end))  # comes with the assignment
            continue
        for stage in used.plan.stages:
            a, b = max(start, stage.start), min(end, stage.end)
            if a >= b:
                continue
            owner = source if source in stage.devices else stage.devices[0]
            fetches[dest].append(
                {"from": source, "owner": owner, "run": used.run, "step": used.step,
                 "start": a, "end": b}
            )  # fmt: skip
    for entries in fetches.values():
        entries.sort(key=lambda e: e["start"])
    return RestoreChoice(used, fetches, here, fell_back=restore.index > 0)


def fetch_plans(
    replica: KeptReplica, new: Sequence[StageSpan], alive: Collection[str]
) -> dict[str, list[dict[str, Any]]]:
    """The fetches of :func:`restore_from` from ``replica`` itself (no fallback)."""
    return restore_from(replica, new, alive, fallback=False).fetches


_GRANT_FIELDS = ("owner", "run", "step", "start", "end")


def fetch_grants(fetches: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, list[Any]]:
    """What each holder of :func:`fetch_plans` is told it may serve (``link_peers``'s
    ``fetches``): who fetches which units of whose snapshot. A holder answers no other
    fetch, so a peer cannot read units the new plan does not give it."""
    out: dict[str, list[Any]] = {}
    for dest, entries in sorted(fetches.items()):
        for e in entries:
            if e["from"] != dest:
                grant = {
                    "peer": dest,
                    **{k: e[k] for k in ("owner", "run", "step", "start", "end")},
                }
                out.setdefault(str(e["from"]), []).append(grant)
    return out


def replica_to_resume(
    replica: KeptReplica | None, resume: Mapping[str, Any], num_units: int
) -> KeptReplica:
    """The replica a resumed run starts from, or a :class:`ConfigError` saying why not."""
    run, step = resume.get("run"), resume.get("step")
    if replica is None or replica.run != run or replica.step != step:
        held = "none" if replica is None else f"run {replica.run} after step {replica.step}"
        raise ConfigError(f"no replica of run {run} after step {step} to resume (held: {held})")
    if replica.plan.num_units != num_units:
        raise ConfigError("the replica is of another model")
    return replica


def merge_fast_state(
    replica: KeptReplica, replies: Mapping[str, Weights | None]
) -> tuple[KeptReplica, dict[str, int], list[int], list[str]]:
    """The `fast` consistency (as FTPipeHD and Asteroid recover): survivors' newest
    weights and optimizer state over the replica's; only the units no survivor sent
    come from the replica. Returns the merged replica, each survivor's completed
    mini-batches, the units taken from the replica, and the survivors whose state
    is missing (their units fall back to the replica: still a consistent model)."""
    newer: dict[str, torch.Tensor] = {}
    completed: dict[str, int] = {}
    missing: list[str] = []
    for name, reply in replies.items():
        if reply is None or reply.error:
            missing.append(name)
            continue
        for key, tensor in zip(reply.keys, reply.tensors, strict=True):
            # a data-parallel group's members hold identical copies; one is kept
            newer.setdefault(str(key), tensor.clone())
        completed[name] = int(reply.completed or 0)
    # the units of the stages no survivor sent (a chain replica holds them at the stages)
    from_replica = [
        u
        for stage in replica.plan.stages
        if not any(d in completed for d in stage.devices)
        for u in range(stage.start, stage.end)
    ]
    # complete only if the replica was; a unit no survivor sent comes from the backup a
    # neighbour keeps (chain replication), or stays lost (a clear error) rather than
    # being built afresh
    merged = KeptReplica(
        replica.run,
        replica.step,
        replica.plan,
        {**replica.state, **newer},
        holders=replica.holders,
        global_copy=replica.complete,
        fast=True,
    )
    return merged, completed, from_replica, missing


# Families whose units take only the micro-batch size they were traced at.
FIXED_BATCH_FAMILIES = frozenset({"traced"})


def training_planner_for(family: str, algo: str) -> str:
    """The training planner that plans a ``family`` model when ``algo`` was asked for.

    A data-parallel group splits each micro-batch among its devices, but a traced
    model's units only take the micro-batch size of the trace. So the default
    "hpp" (Asteroid's hybrid plan, groups included) plans such a model "straight"
    (one device per stage), and "data-parallel" is refused with a message that
    names the planner to use instead.
    """
    if family not in FIXED_BATCH_FAMILIES:
        return algo
    if algo == "hpp":
        return "straight"
    if algo == "data-parallel":
        raise ConfigError(_fixed_batch_problem(family, "planner 'data-parallel'"))
    return algo


def check_plan_fits_model(family: str, plan: TrainingPlan) -> None:
    """Refuse a given training plan whose data-parallel groups a ``family`` model
    cannot run (see :func:`training_planner_for`)."""
    if family not in FIXED_BATCH_FAMILIES:
        return
    grouped = [st for st in plan.stages if len(st.devices) > 1]
    if grouped:
        what = f"the training plan's group {list(grouped[0].devices)}"
        raise ConfigError(_fixed_batch_problem(family, what))


def _fixed_batch_problem(family: str, what: str) -> str:
    return (
        f"a {family!r} model runs only at the micro-batch size it was traced at, so "
        f"{what} cannot split its micro-batches across a data-parallel group; plan it "
        "with planner 'straight' (python -m zpipe train --planner straight; "
        "fit(..., planner='straight')) or give a plan with one device per stage"
    )
