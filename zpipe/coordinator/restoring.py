"""Where a resumed run's weights come from, and heavy recovery's gather.

:func:`choose_restore` decides it for a run resumed from a replica: each unit
from its nearest holder at that replica (:func:`zpipe.coordinator.decisions.restore_from`),
or from the older global copy behind it when the client said it can train again
from there (its ``resume`` names that copy under ``global``).

Asteroid (section 3.4) measures its lightweight recovery against "heavy
rescheduling": aggregate every stage's model at one node, run the planner again,
redistribute the weights by the new plan. :func:`gather_for_heavy` is the
aggregation: the moves of :func:`zpipe.recovery.heavy_restore` (each unit from
its nearest live holder: its device's own snapshot, else a neighbour's backup),
asked of every holder as one ``weights_request`` naming the snapshots to send.
The assignments then carry every unit from the coordinator. Lightweight recovery
(:func:`zpipe.coordinator.decisions.restore_from`) moves only the units that
change hands, from stage to stage.

A flow (:mod:`zpipe.coordinator.flows`): pure, driven by events.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from zpipe._errors import ConfigError, UnitsLostError
from zpipe.coordinator.commands import AwaitReplies, Log, Send
from zpipe.coordinator.current_run import KeptReplica
from zpipe.coordinator.decisions import RestoreChoice, replica_points, restore_from
from zpipe.coordinator.flows import Flow, request_resend_s
from zpipe.coordinator.membership import Member
from zpipe.coordinator.state import ControlState
from zpipe.protocol.client_control import RunRequest
from zpipe.protocol.stage_control import Weights, WeightsRequest
from zpipe.recovery import StageSpan, WeightsLostError, heavy_restore

if TYPE_CHECKING:
    import torch


def snapshot_requests(
    choice: RestoreChoice, new: Sequence[StageSpan], alive: set[str]
) -> dict[str, list[dict[str, Any]]]:
    """What each holder sends the coordinator for heavy recovery: ``{owner, run, step,
    start, end}`` ranges of the snapshots it keeps (its own, or a backup of ``owner``)."""
    used = choice.replica
    point = replica_points(used, fallback=False)[0][1]
    failed = {d for d in used.plan.devices if d not in alive}
    try:
        moves = heavy_restore(new, failed=failed, point=point)
    except WeightsLostError as exc:
        raise UnitsLostError((exc.units[0], exc.units[-1] + 1), "no live holder has them") from exc
    asks: dict[str, list[dict[str, Any]]] = {}
    for t in moves.gather:
        for stage in used.plan.stages:
            a, b = max(t.start, stage.start), min(t.end, stage.end)
            if a < b:
                owner = t.source if t.source in stage.devices else stage.devices[0]
                asks.setdefault(t.source, []).append(
                    {"owner": owner, "run": used.run, "step": used.step, "start": a, "end": b}
                )
    return asks


def gather_for_heavy(
    state: ControlState,
    choice: RestoreChoice,
    new: Sequence[StageSpan],
    members: Mapping[str, Member],
) -> Flow:
    """Every unit's state of ``choice``'s replica at the coordinator; returns the
    choice that sends each device all of its units from here."""
    asks = snapshot_requests(choice, new, set(members))
    used = choice.replica
    gathered: dict[str, torch.Tensor] = dict(used.state)
    nbytes = 0
    if asks:
        requests = tuple(
            Send(
                members[holder].routing_id,
                WeightsRequest(run=used.run, step=used.step, snapshot=ranges),
                holder,
                stage=holder,
            )
            for holder, ranges in sorted(asks.items())
        )
        replies: dict[str, Weights] = yield AwaitReplies(
            tuple(sorted(asks)),
            Weights,
            state.timeouts.result_s,
            "snapshots for heavy recovery",
            requests=requests,
            resend_s=request_resend_s(state.timeouts),
        )
        for holder in sorted(asks):
            reply = replies[holder]
            if reply.error:
                raise ConfigError(f"stage {holder!r} could not send its snapshots: {reply.error}")
            for key, tensor in zip(reply.keys, reply.tensors, strict=True):
                # a copy: the received frame's memory belongs to a zmq message
                gathered[str(key)] = tensor.clone()
                nbytes += tensor.numel() * tensor.element_size()
    yield Log(
        "info",
        "heavy_gathered",
        {"run": used.run, "step": used.step, "holders": sorted(asks), "bytes": nbytes},
    )
    everything = {d: [(s.start, s.end)] for s in new for d in s.devices}
    full = replace(used, state=gathered, holders={}, global_copy=True)
    return RestoreChoice(full, {d: [] for d in everything}, everything, choice.fell_back)


def choose_restore(
    state: ControlState,
    replica: KeptReplica,
    request: RunRequest,
    new: Sequence[StageSpan],
    live: Mapping[str, Member],
) -> Flow:
    """How the devices of ``new`` get their units from ``replica`` (see the module
    notes); heavy recovery (``recovery`` "heavy" after a death) gathers them here first."""
    resume = dict(request.resume or {})
    older = replica.fallback
    offered = resume.get("global")
    # the client replays from the global copy only if it still holds what came after it
    fallback = (
        older is not None
        and isinstance(offered, dict)
        and (offered.get("run"), offered.get("step")) == (older.run, older.step)
        and isinstance(offered.get("start_step"), int)
    )
    restore = restore_from(replica, new, set(live), fallback=fallback)
    if request.recovery == "heavy" and resume.get("dead"):
        restore = yield from gather_for_heavy(state, restore, new, live)
    yield Log("info", "restore_planned", {"recovery": request.recovery, **units_moved(restore)})
    if restore.fell_back:
        yield Log(
            "warning",
            "restored_from_global",
            {"asked": [replica.run, replica.step],
             "global": [restore.replica.run, restore.replica.step]},
        )  # fmt: skip
    return restore


def allow_fetches(
    restore: RestoreChoice, live: Mapping[str, Member], key_of: Callable[[str], str | None]
) -> None:
    """Name each peer a device fetches from: its probe endpoint and key."""
    for dest, entries in restore.fetches.items():
        for entry in entries:
            if entry["from"] != dest:
                entry["endpoint"] = str(live[entry["from"]].info["probe_endpoint"])
                entry["key"] = key_of(entry["from"])


def units_moved(restore: RestoreChoice) -> dict[str, Any]:
    """Units of the new plan by where they come from: a snapshot on the device itself
    (its own, or a backup it keeps: ``local``), another device (``from_peers``), the
    coordinator (``from_coordinator``); and the replica they are of."""
    local = from_peers = 0
    for dest, entries in restore.fetches.items():
        for e in entries:
            if e["from"] == dest:
                local += e["end"] - e["start"]
            else:
                from_peers += e["end"] - e["start"]
    here = sum(b - a for ranges in restore.from_coordinator.values() for a, b in ranges)
    return {
        "replica": [restore.replica.run, restore.replica.step],
        "local": local,
        "from_peers": from_peers,
        "from_coordinator": here,
    }
