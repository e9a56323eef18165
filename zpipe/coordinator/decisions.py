"""The coordinator's decisions that both run kinds share, as pure functions.

Who takes part in a run, how a plan is repaired without its dead, where a
recovering stage gets its units' weights: each decided here from plain data
(members, plans, replicas), by calling :mod:`zpipe.recovery` and
:mod:`zpipe.planner`, never re-implementing them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, TypeVar

import torch

from zpipe._errors import ConfigError, InfeasiblePlanError, UnitsLostError
from zpipe.coordinator.membership import Member, Membership, MemberState
from zpipe.coordinator.planning import cluster_from_members
from zpipe.coordinator.runs import Replica
from zpipe.models.weights import split_unit_key
from zpipe.planner import ClusterLink, Plan
from zpipe.planner.profile import ModelProfile
from zpipe.planner.training_plan import TrainingPlan
from zpipe.recovery import (
    COORDINATOR,
    StageSpan,
    WeightsLostError,
    plan_recovery,
    plan_redistribution,
)
from zpipe.recovery import Replica as HeldUnits
from zpipe.recovery.replanning import RecoveryError

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
        cluster = cluster_from_members(survivors, known, links=links)
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
    return {u[0] for key in state if (u := split_unit_key(key)) is not None}


def units_state(state: Mapping[str, torch.Tensor], start: int, end: int) -> dict[str, torch.Tensor]:
    """The entries of a replica that belong to units ``[start, end)``."""
    out = {}
    for key, tensor in state.items():
        parsed = split_unit_key(key)
        if parsed is not None and start <= parsed[0] < end:
            out[key] = tensor
    return out


def fetch_plans(
    replica: Replica, new: Sequence[StageSpan], alive: Collection[str]
) -> dict[str, list[dict[str, Any]]]:
    """Where each device of ``new`` gets its units of a replica kept at the stages.

    FTPipeHD's Algorithm 1 (:func:`zpipe.recovery.plan_redistribution`) at the
    replica's step: every live device of the replica's plan holds a snapshot of its
    own units, every live holder a backup of its owner's, the coordinator what it
    holds here. What the coordinator holds comes with the assignment; every other
    range is fetched from the device's own snapshot (``from`` itself), a surviving
    member of the stage that held it, or the backup its holder keeps. Each entry
    names its ``owner``: whose snapshot it is.
    """
    old = replica.plan
    here = held_at_coordinator(replica.state)
    failed = {d for d in old.devices if d not in alive}
    backups: list[HeldUnits] = []
    for stage in old.stages:
        holder = replica.holders.get(stage.devices[0], "")
        if holder and holder != COORDINATOR:
            backups.append(HeldUnits(holder, stage.start, stage.end, replica.step))
    for unit in sorted(here):
        backups.append(HeldUnits(COORDINATOR, unit, unit + 1, replica.step))
    try:
        moves = plan_redistribution(
            old,
            new,
            failed=failed,
            live_version=replica.step,
            replicas=backups,
            version=replica.step,
        )
    except WeightsLostError as exc:
        lost = exc.units
        stages = [s for s in old.stages if any(s.start <= u < s.end for u in lost)]
        ran = ", ".join(d for s in stages for d in s.devices)
        held = ", ".join(replica.holders.get(s.devices[0]) or "none" for s in stages)
        raise UnitsLostError(
            (lost[0], lost[-1] + 1), f"{ran} and the holder of their backup ({held}) are gone"
        ) from exc
    ranges = [(t.dest, t.source, t.start, t.end) for t in moves.transfers]
    ranges += [(k.device, k.device, k.start, k.end) for k in moves.kept]
    out: dict[str, list[dict[str, Any]]] = {d: [] for s in new for d in s.devices}
    for dest, source, start, end in sorted(ranges, key=lambda r: (r[0], r[2])):
        if source == COORDINATOR:
            continue  # comes with the assignment
        for stage in old.stages:
            a, b = max(start, stage.start), min(end, stage.end)
            if a >= b or all(u in here for u in range(a, b)):
                continue
            owner = source if source in stage.devices else stage.devices[0]
            out[dest].append(
                {
                    "from": source,
                    "owner": owner,
                    "run": replica.run,
                    "step": replica.step,
                    "start": a,
                    "end": b,
                }
            )
    for entries in out.values():
        entries.sort(key=lambda e: e["start"])
    return out


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
    replica: Replica | None, resume: Mapping[str, Any], num_units: int
) -> Replica:
    """The replica a resumed run starts from, or a :class:`ConfigError` saying why not."""
    run, step = resume.get("run"), resume.get("step")
    if replica is None or replica.run != run or replica.step != step:
        held = "none" if replica is None else f"run {replica.run} after step {replica.step}"
        raise ConfigError(f"no replica of run {run} after step {step} to resume (held: {held})")
    if replica.plan.num_units != num_units:
        raise ConfigError("the replica is of another model")
    return replica


def merge_fast_state(
    replica: Replica, replies: Mapping[str, Any]
) -> tuple[Replica, dict[str, int], list[int], list[str]]:
    """The `fast` consistency (as FTPipeHD and Asteroid recover): survivors' newest
    weights and optimizer state over the replica's; only the units no survivor sent
    come from the replica. Returns the merged replica, each survivor's completed
    mini-batches, the units taken from the replica, and the survivors whose state
    is missing (their units fall back to the replica: still a consistent model)."""
    newer: dict[str, torch.Tensor] = {}
    completed: dict[str, int] = {}
    missing: list[str] = []
    for name, reply in replies.items():
        if reply is None or reply["error"]:
            missing.append(name)
            continue
        for key, tensor in zip(reply["keys"], reply.tensors, strict=True):
            # a data-parallel group's members hold identical copies; one is kept
            newer.setdefault(str(key), tensor.clone())
        completed[name] = int(reply.get("completed") or 0)
    from_replica = sorted(
        {u[0] for k in replica.state if k not in newer and (u := split_unit_key(k))}
    )
    merged = Replica(replica.run, replica.step, replica.plan, {**replica.state, **newer})
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
