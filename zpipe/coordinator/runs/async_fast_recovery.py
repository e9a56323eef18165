"""FTPipeHD's fast recovery of an asynchronous run with live copies, as the coordinator
carries it out (``consistency="fast"``, section III-F).

The client asks to resume a broken ``async-1f1b`` run whose stages copy their units
without draining (``live_copies``): its ``resume`` names the run, the dead stages,
``consistency`` "fast", ``live`` and, as ``step``, how many mini-batches it has
acknowledged (their losses came back). Then:

    the survivors' state ─> each survivor stops the broken run, keeps its live
        weights and optimizer state as its own snapshot after its update count and
        sends the keys and the count (``weights_request`` ``latest`` ``keep``): the
        tensors stay where they are
    the decision ─> :func:`zpipe.recovery.fast_recovery.plan_fast_recovery` over
        the coordinator's copy ledger (never decided here: the plan says where every
        unit goes, where it comes from, where the run resumes); eq. 5 re-cuts the
        survivors over what the run measured (:func:`zpipe.recovery.
        fast_recovery_inputs.eq5_inputs`: its live re-partition controller's
        capacities and links, the coordinator's links between new neighbours; every
        capacity 1 before any look), and the report says which
    the dead's units ─> from the copy the plan names: a chain copy held by a
        surviving stage, peer to peer (the holder first confirms it holds it: a
        ``weights_request`` ``snapshot`` naming owner, run and mini-batch, with
        ``keep``, answered with the keys only; then the new holder fetches it from
        there under a grant, or loads it in place when it is the holder itself),
        or one the coordinator holds (the last stage's chain copy, a global copy,
        sent with the assignment); a unit of
        no copy (a death before the first copy landed) is built afresh from the
        model spec by its new holder (a fetch entry marked ``initial``: version 0,
        nothing travels), and the plan reports every acknowledged mini-batch lost
    the survivors' units ─> peer to peer: each new holder's assignment names them
        as fetch entries (:func:`survivor_fetches`), a unit it keeps from its own
        snapshot, a unit the re-cut moves from the survivor that had it (the fetch
        grants of a synchronous run's lightweight recovery); the coordinator never
        carries them
    the resume state ─> every unit at one weight version, the acknowledged count
        (:func:`zpipe.training.async_fast_state.restart_state_at`): the dead's units
        here, the survivors' at the stage that fetched them (the entry's
        ``restart``); the survivors' weights bit for bit, the copies' as they were
        taken

The result is how each stage of the new partition gets its units (a
:class:`~zpipe.coordinator.decisions.RestoreChoice`: the dead's with the
assignment, the survivors' fetched), which the run's start
(:mod:`zpipe.coordinator.starting`) assigns, and the plan, whose summary goes
back to the client in ``run_ready`` (``fast_recovery``) for the fit's report.

A survivor that dies after it sent its keys (or confirmed a chain copy), while a
new holder fetches from it, fails the new run's start as any member's death during
an assignment does (it is a member of the new plan: eq. 5 gives every survivor a
unit). A holder that cannot confirm a copy (it restarted, or dropped it) or dies
before it answers is planned around (``fast_copy_unavailable``,
``fast_holder_lost``).

Pure: events in, commands out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import TYPE_CHECKING, Any

from zpipe._errors import ConfigError, InfeasiblePlanError, PipelineError
from zpipe.coordinator.commands import AwaitReplies, Log, Send
from zpipe.coordinator.current_run import KeptReplica
from zpipe.coordinator.decisions import RestoreChoice, live_members, units_state
from zpipe.coordinator.flows import Flow, request_resend_s
from zpipe.coordinator.runs.async_repartition import (
    LiveRepartitioning,
    reference_unit_s,
    run_controller,
)
from zpipe.coordinator.runs.async_training import AsyncTrainingController, as_async_plan
from zpipe.coordinator.runs.repartition_cuts import plan_bounds
from zpipe.coordinator.state import ControlState
from zpipe.models.weights import split_unit_key
from zpipe.planner.async_schedule import AsyncSettings, async_warmup
from zpipe.planner.training_plan import TrainingPlan
from zpipe.protocol.client_control import RunRequest
from zpipe.protocol.stage_control import Weights, WeightsRequest
from zpipe.recovery.fast_recovery import FastRecoveryPlan, plan_fast_recovery
from zpipe.recovery.fast_recovery_inputs import UNMEASURED, PipelineMeasurements, eq5_inputs
from zpipe.recovery.live_copies import CopyLedger
from zpipe.recovery.spans import COORDINATOR, StageSpan
from zpipe.training.async_fast_state import restart_state_at

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class FastResume:
    """A fast recovery's outcome: the survivors' ``plan`` to assign, where each of its
    stages gets its units (``restore``: the dead's from the replica here, the
    survivors' fetched peer to peer), and the decision (``fast``) for the report."""

    plan: TrainingPlan
    restore: RestoreChoice
    fast: FastRecoveryPlan


def is_fast_live_resume(resume: dict[str, Any] | None) -> bool:
    """Whether a run request's ``resume`` asks for this recovery."""
    if not resume:
        return False
    return resume.get("consistency") == "fast" and bool(resume.get("live"))


def this_fits_copies(
    ledger: CopyLedger, since_run: int | None, unusable: set[tuple[str, str]]
) -> CopyLedger:
    """The copies a fast recovery may restore from: the fit's own (made by its first
    run, ``since_run``, or a later one; the coordinator keeps the newest copy of
    each stage across fits, and another fit's are another model's weights), less
    those a holder could not give. A client that does not say keeps them all."""
    return CopyLedger(
        {
            key: copy
            for key, copy in ledger.copies.items()
            if key not in unusable and (since_run is None or copy.run >= since_run)
        }
    )


def async_fast_resume(state: ControlState, request: RunRequest) -> Flow:
    """The fast recovery of the broken run ``request.resume`` names (see the module
    notes): returns a :class:`FastResume`."""
    resume = dict(request.resume or {})
    current = state.current
    if (
        not isinstance(current, AsyncTrainingController)
        or current.run.training_plan is None
        or current.run.run != resume.get("run")
    ):
        raise ConfigError(
            f"no broken asynchronous run {resume.get('run')} here to recover fast from "
            "(the coordinator restarted, or another run replaced it)"
        )
    acknowledged = resume.get("step")
    if isinstance(acknowledged, bool) or not isinstance(acknowledged, int) or acknowledged < 0:
        raise ConfigError(
            f"a fast resume names the mini-batches acknowledged, got {acknowledged!r}"
        )
    since = resume.get("since_run")
    if since is not None and (isinstance(since, bool) or not isinstance(since, int)):
        raise ConfigError(f"a fast resume's since_run is a run id, got {since!r}")
    run = current.run
    tplan = run.training_plan
    assert tplan is not None
    devices, bounds = plan_bounds(tplan)
    alive = {m.name: m for m in live_members(state.membership)}
    dead = {str(d) for d in resume.get("dead") or []} | set(run.failed)
    dead |= {d for d in devices if d not in alive}
    survivors = [d for d in devices if d not in dead]
    if not survivors:
        raise InfeasiblePlanError("no stage of the run survives to resume it")

    # The survivors' live state: they stop the broken run first and keep it, sending
    # its keys (the units each holds) and its update count.
    ask = WeightsRequest(
        run=run.run, step=0, optimizer=True, latest=True, keep=True, epoch=run.epoch
    )
    for name in survivors:
        yield Send(alive[name].routing_id, ask, name, stage=name)
    replies: dict[str, Weights] = yield AwaitReplies(
        tuple(survivors), Weights, state.timeouts.result_s, "the survivors' weights", partial=True
    )
    kept: dict[str, list[str]] = {}  # each survivor's keys, its state kept there
    updates: dict[str, int] = {}
    for name in survivors:
        reply = replies.get(name)
        if reply is None or reply.error or reply.updates is None:
            # its units come from their copies, as a dead stage's do
            error = "no reply" if reply is None else reply.error or "no update count"
            yield Log("warning", "fast_state_missing", {"stage": name, "error": str(error)})
            dead.add(name)
            continue
        kept[name] = [str(k) for k in reply.keys]
        updates[name] = int(reply.updates)

    # What each survivor holds: its committed units, or those of a move it switched
    # to when a death stopped the move's commit elsewhere (the coordinator has the
    # old cuts then; zpipe.recovery.fast_recovery's notes)
    committed = dict(zip(devices, pairwise(bounds), strict=True))
    target = _move_target(current)
    holding: dict[str, tuple[int, int]] = {}
    for name in list(kept):
        i = devices.index(name)
        moved = None if target is None else (target[i], target[i + 1])
        found = _held_range(kept[name], committed[name], moved)
        if found is None:
            units = sorted(_units_in(kept[name]))
            yield Log("warning", "fast_state_missing", {"stage": name,
                      "error": f"it holds units {units}, of neither the committed cuts "
                      f"{bounds} nor a move's {target}"})  # fmt: skip
            dead.add(name)
            del kept[name], updates[name]
        else:
            holding[name] = found

    spans = [StageSpan((d,), a, b) for d, (a, b) in zip(devices, pairwise(bounds), strict=True)]
    # copies a holder could not give after all (it restarted, or dropped an old one):
    # planned again without them (the older copy, or the global one); a holder that
    # dies while it sends them: planned again without it (its own units from copies)
    unusable: set[tuple[str, str]] = set()
    while True:
        # eq. 5 over what the run measured (its live re-partition's capacities, links)
        remaining = [d for d in devices if d not in dead]
        eq5 = eq5_inputs(remaining, _measurements(current, tplan, remaining)) if remaining else None
        usable = this_fits_copies(state.async_copies.ledger, since, unusable)
        fast = plan_fast_recovery(
            spans,
            sorted(d for d in devices if d in dead),
            ledger=usable,
            updates=updates,
            acknowledged=acknowledged,
            holding=holding,
            move_pending=target is not None,  # the report: a move was under way
            **(eq5.kwargs() if eq5 is not None else {"reference_unit_s": [1.0] * tplan.num_units}),
        )
        if eq5 is not None:
            fast = replace(fast, inputs=eq5.report)

        # The dead's units' state, from the copies the plan names: those held here
        # now, those at a stage once it confirmed it holds them (they travel peer
        # to peer, as the survivors' units do: survivor_fetches).
        merged: dict[str, torch.Tensor] = {}
        asks: dict[str, list[dict[str, Any]]] = {}
        failed: dict[tuple[str, str], str] = {}
        for dest in fast.order:
            for r in fast.ranges_of(dest):
                if r.kind in _AT_THE_STAGES:
                    continue
                if r.source == COORDINATOR:
                    try:
                        merged.update(
                            _held_here(state, r.owner, r.kind, r.run, r.version, r.start, r.end)
                        )
                    except ConfigError as exc:
                        failed[(r.owner, r.kind)] = str(exc)
                else:
                    asks.setdefault(r.source, []).append(
                        {"owner": r.owner, "run": r.run, "step": r.version,
                         "start": r.start, "end": r.end}
                    )  # fmt: skip
        if asks and not failed:
            refused, lost = yield from _confirm_chain_copies(state, alive, asks)
            for holder, error in refused.items():
                for entry in asks[holder]:
                    failed[(str(entry["owner"]), "chain")] = f"{holder}: {error}"
            if lost:
                yield Log("warning", "fast_holder_lost", {"run": run.run, "stages": lost})
                for name in lost:
                    dead.add(name)
                    kept.pop(name, None)
                    updates.pop(name, None)
                    holding.pop(name, None)
                continue
        if not failed:
            break
        if not set(failed) - unusable:  # cannot happen: an unusable copy is never planned
            raise ConfigError(f"the copies the plan names cannot be had: {failed}")
        unusable |= set(failed)
        copies = [{"owner": o, "kind": k, "error": e} for (o, k), e in sorted(failed.items())]
        yield Log("warning", "fast_copy_unavailable", {"run": run.run, "copies": copies})

    settings = AsyncSettings.from_dict((request.train or {}).get("async"))
    depth = settings.depth_of(len(fast.order))
    by_device = {s.devices[0]: s for s in tplan.stages}
    n = len(fast.order)
    stages = tuple(
        replace(by_device[d], start=a, end=b, warmup=async_warmup(i, n))
        for i, (d, (a, b)) in enumerate(zip(fast.order, pairwise(fast.bounds), strict=True))
    )
    new_plan = as_async_plan(replace(tplan, stages=stages))
    replica = KeptReplica(
        run.run,
        acknowledged,
        new_plan,
        restart_state_at(merged, version=acknowledged, depth=depth),
        global_copy=False,
        fast=True,
    )
    restore = RestoreChoice(
        replica,
        survivor_fetches(fast, run.run, updates, depth=depth),
        {d: [(r.start, r.end) for r in fast.ranges_of(d) if r.source == COORDINATOR]
         for d in fast.order},
    )  # fmt: skip
    if fast.initial_units:
        # no copy of these units was left: they start again from version 0
        yield Log("warning", "fast_initial_weights", {"run": run.run,
                  "units": fast.initial_units, "progress_lost": acknowledged})  # fmt: skip
    yield Log("info", "async_fast_recovery", {"run": run.run, **fast.summary()})
    return FastResume(new_plan, restore, fast)


# the sources a stage gets without the coordinator: a survivor's live weights (its
# own or a peer's snapshot), and the initial weights it builds itself
_AT_THE_STAGES = ("kept", "peer", "initial")


def survivor_fetches(
    fast: FastRecoveryPlan, run: int, updates: dict[str, int], *, depth: int
) -> dict[str, list[dict[str, Any]]]:
    """Each new holder's fetch entries for the survivors' units the plan gives it: a
    range it keeps from its own snapshot (``from`` itself), a range the re-cut moves
    from the survivor's that had it (a peer fetch, granted to it alone); every
    snapshot is the survivor's state after its update count (``keep``), put at the
    resume version by the stage that loads it (``restart``). A range of a chain copy
    a stage holds (confirmed) is fetched from that holder, or loaded in place when
    the new holder holds it, by the copy's owner, run and mini-batch; a range of no
    copy (``initial``) the new holder builds from the model spec (``from`` itself,
    step 0); each put at the resume version too."""
    restart = {"version": fast.resume_at, "depth": depth}
    out: dict[str, list[dict[str, Any]]] = {d: [] for d in fast.order}
    for dest in fast.order:
        for r in fast.ranges_of(dest):
            if r.kind in ("kept", "peer"):
                out[dest].append(
                    {"from": r.source, "owner": r.source, "run": run,
                     "step": updates[r.source], "start": r.start, "end": r.end,
                     "restart": dict(restart)}
                )  # fmt: skip
            elif r.kind == "chain" and r.source != COORDINATOR:
                out[dest].append(
                    {"from": r.source, "owner": r.owner, "run": r.run, "step": r.version,
                     "start": r.start, "end": r.end, "restart": dict(restart)}
                )  # fmt: skip
            elif r.kind == "initial":
                out[dest].append(
                    {"from": dest, "owner": r.owner, "run": run, "step": r.version,
                     "start": r.start, "end": r.end, "initial": True,
                     "restart": dict(restart)}
                )  # fmt: skip
    return out


def _measurements(
    current: AsyncTrainingController, plan: TrainingPlan, survivors: list[str]
) -> PipelineMeasurements:
    """What the broken run measured, for eq. 5 over ``survivors``: its live re-partition
    controller's capacities, own costs, boundary sizes and links (a link probed since
    its last look, and one between survivors a death made neighbours, from the
    coordinator's links); without a controller, the profiled unit times alone (every
    capacity 1, links not costed: the rule before any look)."""
    flows = LiveRepartitioning(current)
    controller = run_controller(current)
    if controller is None or len(controller.reference_unit_s) != plan.num_units:
        units = reference_unit_s(plan, flows._profile(plan))
        return PipelineMeasurements(tuple(units), capacity_source=UNMEASURED)
    caps, fixed = controller.measured()
    looks = [d.at for d in controller.decisions if d.measured]
    source = (
        f"the live re-partition's looks (the last after mini-batch {looks[-1]})"
        if caps and looks
        else UNMEASURED
    )
    links: dict[tuple[str, str], float] = {}
    origins: dict[tuple[str, str], str] = {}
    sizes = controller.output_bytes
    if sizes is not None:
        for pair, bps in controller.links_by_pair().items():
            links[pair], origins[pair] = bps, "the live re-partition's last look"
        for pair, (bps, origin) in flows.links_of(survivors).items():
            # a probe newer than the look, or a pair the controller never costed
            if origin == "measured" or (pair not in links and pair[::-1] not in links):
                links[pair], origins[pair] = bps, origin
    return PipelineMeasurements(
        tuple(controller.reference_unit_s),
        caps,
        fixed,
        source,
        None if sizes is None else tuple(sizes),
        links,
        origins,
    )


def _move_target(current: AsyncTrainingController) -> tuple[int, ...] | None:
    """The cuts of a live re-partition's move not committed here (decided, maybe
    fetched and committed at some stages), or None."""
    controller = run_controller(current)
    if controller is None or not controller.decisions:
        return None
    last = controller.decisions[-1].bounds
    return None if last is None or last == controller.bounds else tuple(last)


def _units_in(keys: Iterable[str]) -> set[int]:
    found = (split_unit_key(k) for k in keys)
    return {u[0] for u in found if u is not None}


def _held_range(
    state: Iterable[str], committed: tuple[int, int], moved: tuple[int, int] | None
) -> tuple[int, int] | None:
    """The units a survivor holds, from its state's keys: of its committed range and the
    range a move gave it, the narrower that holds every unit with state (None:
    neither holds them all). Units without parameters have no keys, so both may fit:
    the narrower never claims a unit whose weights the survivor lacks (a unit it
    does not claim is restored from a copy, where such a unit has nothing to
    restore)."""
    units = _units_in(state)
    fits = [c for c in (committed, moved) if c is not None and all(c[0] <= u < c[1] for u in units)]
    return min(fits, key=lambda c: c[1] - c[0]) if fits else None


def _held_here(
    state: ControlState, owner: str, kind: str, run: int | None, step: int, start: int, end: int
) -> dict[str, torch.Tensor]:
    """Units ``[start, end)`` of ``owner``'s ``kind`` copy the coordinator holds, the one
    the plan chose (its run and mini-batch)."""
    record = state.async_copies.ledger.newest(owner, kind)
    held = state.async_copies.state_of(owner, kind)
    if record is None or held is None or (record.run, record.step) != (run, step):
        raise ConfigError(
            f"the coordinator no longer holds {owner!r}'s {kind} copy of mini-batch {step}"
        )
    return units_state(held, start, end)


def _confirm(ranges: list[dict[str, Any]]) -> WeightsRequest:
    """Ask a holder whether it holds these copies' units (``keep``: only the keys)."""
    return WeightsRequest(run=0, step=0, snapshot=ranges, keep=True)


def _confirm_chain_copies(
    state: ControlState, alive: dict[str, Any], asks: dict[str, list[dict[str, Any]]]
) -> Flow:
    """That the surviving stages hold the chain copies the plan names for dead ones, by
    owner, run and mini-batch (``keep``: the keys come back, the tensors stay there
    for the new holders to fetch): returns, by holder, the error of each that could
    not confirm its copies, and the holders that died meanwhile (the caller plans
    again without either; a holder that neither answers nor dies fails the
    recovery)."""
    holders = tuple(sorted(asks))
    requests = tuple(Send(alive[h].routing_id, _confirm(asks[h]), h, stage=h) for h in holders)
    replies: dict[str, Weights] = yield AwaitReplies(
        holders,
        Weights,
        state.timeouts.result_s,
        "the chain copies of the dead stages",
        requests=requests,
        resend_s=request_resend_s(state.timeouts),
        partial=True,
        stop_on_lost=True,
    )
    living = {m.name for m in live_members(state.membership)}
    lost = [h for h in holders if h not in replies and h not in living]
    silent = [h for h in holders if h not in replies and h in living]
    if silent and not lost:
        raise PipelineError(f"no chain copies from {silent} within {state.timeouts.result_s} s")
    refused: dict[str, str] = {}
    keys = 0
    for holder in holders:
        reply = replies.get(holder)
        if reply is None:
            continue  # lost (planned again without it) or cut short by a death: asked again
        if reply.error:
            refused[holder] = str(reply.error)
            continue
        if not reply.keys:
            refused[holder] = "it holds no state of those units"
            continue
        keys += len(reply.keys)
    got = [h for h in holders if h in replies and h not in refused]
    yield Log("info", "chain_copies_confirmed", {"holders": got, "keys": keys})
    return refused, lost


__all__ = ["FastResume", "async_fast_resume", "is_fast_live_resume"]
