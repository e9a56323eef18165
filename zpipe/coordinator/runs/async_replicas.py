"""Replicas of an asynchronous training run, taken at flush points (FTPipeHD III-E).

Asynchronous stages never drain at a batch boundary by themselves, so the client
makes one: before every ``replicate_every``-th mini-batch it ends its feed for a
moment (the ``end`` marker a live re-partition pauses with,
:mod:`zpipe.client.runs.async_training`), every stage backwards every earlier batch and
waits there. Then, in three steps that reuse a re-partition's phases:

    prepare (repartition_request) ─> each stage, once flushed, keeps a snapshot of
        its units: weights, optimizer state, and the weight versions the next
        forwards read (the run's depth of them)
    weights_request with ``snapshot`` ─> those snapshots come here: the global copy;
        or, under chain (topology) replication, backup_request ─> each stage backs
        the same state up to its holder, with a global copy every ``global_every``
    commit with the same cuts ─> every stage goes on from the same batch

A recovery then resumes as a synchronous run's does
(:mod:`zpipe.coordinator.starting`): each stage of the new plan gets its units,
versions included, from the replica (:meth:`zpipe.stage.executors.async_shard.AsyncShard.
load_training_state`), its update count goes on from the replica's, and its forwards
keep the staleness of the depth the run started with (``AsyncSettings.depth``, which
the client sets when it resumes), so the recovered run trains exactly as the
uninterrupted one with the same flushes (which change nothing either). With weight
aggregation it keeps that depth's windows too, and equals the single-process
reference of the cuts it went through (:mod:`zpipe.training.async_recovery`, which
also says how replicas and live re-partitions share the flush points).

Pure: events in, commands out.
"""

from __future__ import annotations

from typing import Any

from zpipe._errors import ConfigError, StageLostError, ZpipeError
from zpipe.coordinator.commands import AwaitReplies, Log, Send
from zpipe.coordinator.flows import Flow, request_resend_s
from zpipe.coordinator.membership import Member
from zpipe.coordinator.runs.async_repartition import LiveRepartitioning, PhaseAsk
from zpipe.coordinator.runs.repartition_cuts import plan_bounds
from zpipe.coordinator.runs.sync_training import SyncTrainingController, state_of_replies
from zpipe.planner.async_schedule import AsyncSettings
from zpipe.protocol.client_control import RunRequest
from zpipe.protocol.stage_control import Weights, WeightsRequest
from zpipe.training.async_recovery import async_recovery_refusal


def collect_async_replica(
    owner: SyncTrainingController, step: int, global_copy: bool, counters: dict[str, Any]
) -> Flow:
    """A replica at the flush before batch ``step`` (see the module notes): ``(keys,
    tensors, holders, whole)`` as :meth:`SyncTrainingController.collect_replica` returns
    them; the stages go on from ``step`` whether it was kept or not."""
    run = owner.run
    if run.training_plan is None:
        raise ConfigError(f"run {run.run} has no training plan")
    devices, bounds = plan_bounds(run.training_plan)
    members = {m.name: m for m in owner.state.membership.alive()}
    stages = LiveRepartitioning(owner)
    holders: dict[str, str] = {}
    whole = run.replication == "global" or global_copy
    try:
        # the client refuses these too; a request that slipped past it must not be
        # kept as a replica a recovery could not resume exactly
        refusal = _recovery_refusal(run.request, run.rebalance)
        if refusal is not None:
            raise ConfigError(refusal)
        missing = [d for d in devices if d not in members]
        if missing:
            raise StageLostError(", ".join(missing), "gone; the run cannot keep a replica")
        prepared = yield from stages.ask(members, devices, step, PhaseAsk("prepare"))
        counters.update({d: dict(r.metrics or {}) for d, r in prepared.items()})
        if run.replication == "global":
            keys, tensors = yield from _gather_snapshots(owner, members, devices, bounds, step)
        else:
            # chain (FTPipeHD) or topology backups of the flushed state, versions included
            keys, tensors, holders = yield from owner.back_up(step, {})
            if global_copy:
                more_keys, more = yield from _gather_snapshots(
                    owner, members, devices, bounds, step
                )
                keys, tensors = keys + more_keys, tensors + more
    except (ZpipeError, ValueError) as exc:
        # The client paused its feed and every flushed stage waits for a commit: resume
        # the live ones (a recovery replays from the replica before this one), so a
        # replica that failed without a death does not leave the pipeline paused.
        yield Log("warning", "async_replica_not_kept", {"run": run.run, "error": str(exc)})
        live = [d for d in devices if d in members]
        try:
            if live:
                yield from stages.ask(members, live, step, _commit(bounds))
        except ZpipeError as resume_error:
            yield Log("warning", "async_resume_failed",
                      {"run": run.run, "error": str(resume_error)})  # fmt: skip
        raise
    yield from stages.ask(members, devices, step, _commit(bounds))
    return keys, tensors, holders, whole


def _recovery_refusal(request: RunRequest | None, rebalance: Any) -> str | None:
    train = request.train if request is not None else None
    settings = AsyncSettings.from_dict(train.get("async") if isinstance(train, dict) else None)
    return async_recovery_refusal(
        vertical_sync=settings.vertical_sync,
        consistency="exact",  # a fast resume is refused when it is asked for
        rebalance=rebalance,
    )


def _commit(bounds: list[int]) -> PhaseAsk:
    return PhaseAsk("commit", bounds=list(bounds))


def _gather_snapshots(
    owner: SyncTrainingController,
    members: dict[str, Member],
    devices: list[str],
    bounds: list[int],
    step: int,
) -> Flow:
    """Each stage's snapshot of its own units at ``step``, as kept by ``prepare``."""
    run = owner.run
    timeouts = owner.state.timeouts
    requests = []
    for i, device in enumerate(devices):
        own = {"owner": device, "run": run.run, "step": step}
        ranges = [{**own, "start": bounds[i], "end": bounds[i + 1]}]
        request = WeightsRequest(run=run.run, step=step, snapshot=ranges, epoch=run.epoch)
        requests.append(Send(members[device].routing_id, request, device, stage=device))
    replies = yield AwaitReplies(
        tuple(devices),
        Weights,
        timeouts.result_s,
        "the snapshots of an asynchronous replica",
        requests=tuple(requests),
        resend_s=request_resend_s(timeouts),
        on_progress=owner.progress_notice("weights"),
    )
    return state_of_replies(replies, devices, "snapshot", None)
