"""Resuming a broken training run from its replica (the coordinator's side).

Which stages the broken run had (:func:`broken_run_stages`: a resume waits for the
suspect among them to be judged before it plans), the survivors' newest state
for the `fast` consistency (:func:`fast_replica`) and the lightweight or ResPipe
re-plan of the replica's plan without the dead (:func:`replan_training`).
FTPipeHD's fast recovery of an asynchronous run with live copies is
:mod:`zpipe.coordinator.runs.async_fast_recovery`.

Flows (:mod:`zpipe.coordinator.flows`): pure, driven by events.
"""

from __future__ import annotations

from zpipe._errors import InfeasiblePlanError
from zpipe.coordinator.commands import AwaitReplies, Log, Send
from zpipe.coordinator.current_run import KeptReplica
from zpipe.coordinator.decisions import live_members, merge_fast_state, replan_in_place
from zpipe.coordinator.flows import Flow
from zpipe.coordinator.runs.async_training import as_async_plan, as_planning_plan
from zpipe.coordinator.runs.sync_training import SyncTrainingController
from zpipe.coordinator.state import ControlState
from zpipe.models import ModelSpec
from zpipe.planner.async_schedule import ASYNC_SCHEDULE
from zpipe.protocol.client_control import RunRequest
from zpipe.protocol.stage_control import Weights, WeightsRequest


def broken_run_stages(state: ControlState, request: RunRequest) -> tuple[str, ...]:
    """The stages of the run a resume recovers: the run this process holds, the
    replica's plan and the stages the client names."""
    names = list(request.stage_names or ())
    if state.current is not None:
        names += state.current.run.devices
    if state.replica is not None:
        names += state.replica.plan.devices
    return tuple(dict.fromkeys(names))


def dead_of(request: RunRequest) -> set[str]:
    """The stages the client says died (its ``resume`` map's ``dead``)."""
    return {str(d) for d in ((request.resume or {}).get("dead") or [])}


def fast_replica(state: ControlState, replica: KeptReplica, request: RunRequest) -> Flow:
    """The `fast` consistency (as FTPipeHD and Asteroid recover): the survivors of
    the broken run keep their newest weights and optimizer state; only the units
    no survivor holds (the dead's) come from the replica."""
    current = state.current
    dead = dead_of(request)
    if not isinstance(current, SyncTrainingController) or current.run.training_plan is None:
        return replica  # no broken run here (a restarted coordinator): exact it is
    run = current.run
    alive = {m.name: m for m in live_members(state.membership)}
    survivors = [d for d in run.devices if d in alive and d not in dead | run.failed]
    ask = WeightsRequest(run=run.run, step=0, optimizer=True, latest=True, epoch=run.epoch)
    for name in survivors:
        yield Send(alive[name].routing_id, ask, name, stage=name)
    replies: dict[str, Weights] = yield AwaitReplies(
        tuple(survivors), Weights, state.timeouts.result_s, "weights", partial=True
    )
    merged, completed, from_replica, missing = merge_fast_state(
        replica, {name: replies.get(name) for name in survivors}
    )
    for name in missing:
        # Its units fall back to the replica: still a consistent model.
        reply = replies.get(name)
        error = "no reply" if reply is None else reply.error
        yield Log("warning", "fast_state_missing", {"stage": name, "error": str(error)})
    yield Log(
        "info",
        "fast_resume",
        {
            "run": run.run,
            "replica_step": replica.step,
            "completed": completed,
            "units_from_replica": from_replica,
        },
    )
    return merged


def replan_training(
    state: ControlState, replica: KeptReplica, policy: str, request: RunRequest, spec: ModelSpec
) -> Flow:
    """Lightweight or ResPipe re-planning of the replica's plan without the dead."""
    alive = {m.name: m for m in live_members(state.membership)}
    dead = dead_of(request)
    failed = dead | {d for d in replica.plan.devices if d not in alive}
    survivors = [alive[d] for d in replica.plan.devices if d not in failed]
    if not survivors:
        raise InfeasiblePlanError("no stage of the run survives to resume it")
    batch = replica.plan.microbatch_size
    profiles = {
        m.name: state.profiles.get(spec, batch, "float32", m, train=True) for m in survivors
    }
    plan = replan_in_place(
        as_planning_plan(replica.plan),
        failed,
        policy,
        survivors,
        profiles,
        batch_size=batch,
        train=True,
        links=state.measured_links(survivors),
        margin=state.memory_margin,
    )
    if replica.plan.schedule == ASYNC_SCHEDULE:
        plan = as_async_plan(plan)
    yield Log(
        "info",
        "training_replanned",
        {"policy": policy, "failed": sorted(failed), "plan": plan.to_dict()},
    )
    return plan
