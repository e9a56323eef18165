"""A lossy run's wait for its results when a death re-maps the dead device's super
neurons (``on_death="remap"``), as a sub-flow of :mod:`zpipe.coordinator.runs.lossy`.

    every lossy_result ─┬─> done
                        └─ a stage declared dead ─> lossy_dead(remap) to the others
                           ─> every lossy_hold (the last mini-batch each started)
                           ─> switch_at = the largest + 1; Algorithm 2's objective places
                              the dead device's super neurons on survivors
                              (zpipe.lossy.remap.remap_dead)
                           ─> lossy_remap to each survivor (the allocation, the rows it
                              takes over, inputs or labels it now needs) ─> wait again

The rows taken over come from the dead device's latest ``lossy_replica`` (its slices
after every ``replica_every``-th mini-batch, when the run asks for them) if it holds
them all, else at their run-start values (zpipe.lossy.remap).

A survivor holds at the last mini-batch it started, so none has started
``switch_at``: every survivor finishes the mini-batches before it on the old
allocation (null-filling the dead device) and runs the rest on the new one, the
same cut on every stage, which is what makes the run equal its simulation
(:mod:`zpipe.lossy.death_sim`). When a survivor is already past training (or
none can take the neurons) there is nothing to switch: ``lossy_remap`` without an
allocation, and the dead device stays null-filled as with ``on_death="null-fill"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from zpipe._errors import PipelineError, ProtocolError
from zpipe.coordinator.commands import AwaitReplies, Command, Log, Now, Send
from zpipe.coordinator.flows import Flow
from zpipe.coordinator.membership import Member, MemberState
from zpipe.coordinator.state import ControlState
from zpipe.lossy.partial import FloatArray
from zpipe.lossy.partition import Allocation
from zpipe.lossy.remap import initial_pieces, remap_dead, replica_covers
from zpipe.lossy.wire import to_array, to_tensor
from zpipe.protocol.lossy import LossyDead, LossyHold, LossyRemap, LossyReplica, LossyResult

ON_DEATH = ("null-fill", "remap")


@dataclass
class RemapRun:
    """What a remap needs of the run: its ids, links, and the data it started with."""

    run: int
    epoch: int
    n_data: int
    prr: FloatArray
    params: Sequence[tuple[FloatArray, FloatArray]]
    inputs: np.ndarray
    labels: np.ndarray
    x_test: np.ndarray | None
    alloc: Allocation
    #: re-mapped deaths: [device, stage, switch_at, allocation after, replica step]
    remaps: list[list[Any]] = field(default_factory=list)
    #: stage name of each device index
    names: dict[int, str] = field(default_factory=dict)
    #: each device's latest replica: (mini-batch, {layer: (start, stop, W, b)})
    replicas: dict[int, tuple[int, dict[int, tuple[int, int, FloatArray, FloatArray]]]] = field(
        default_factory=dict
    )


def keep_replica(state: ControlState, stage: str, replica: LossyReplica) -> list[Command]:
    """A stage's ``lossy_replica``: kept on its run's :class:`RemapRun` (the newest per
    device), what a remap gives the survivors that take its neurons over."""
    try:
        remap = state.lossy_runs.get(replica.run)
        if remap is None:
            return [Log("debug", "late_reply", {"stage": stage, "kind": replica.KIND})]
        if remap.names.get(replica.device) != stage:
            raise ProtocolError(f"lossy_replica for device {replica.device} from {stage!r}")
        sizes = remap.alloc.layer_sizes
        tensors = list(replica.tensors)
        if len(tensors) != 2 * len(replica.slices):
            raise ProtocolError("lossy_replica: one W and one b per slice")
        rows: dict[int, tuple[int, int, FloatArray, FloatArray]] = {}
        for k, entry in enumerate(replica.slices):
            layer, start, stop = (int(v) for v in entry)
            if not (1 <= layer < len(sizes) and 0 <= start < stop <= sizes[layer]):
                raise ProtocolError(f"lossy_replica: bad slice {entry!r}")
            w = to_array(tensors[2 * k], shape=(stop - start, sizes[layer - 1]),
                         dtype=torch.float64, what="replica weights")  # fmt: skip
            b = to_array(tensors[2 * k + 1], shape=(stop - start,), dtype=torch.float64,
                         what="replica bias")  # fmt: skip
            rows[layer] = (start, stop, w.copy(), b.copy())
    except (ProtocolError, TypeError, ValueError) as exc:
        return [Log("warning", "dropped_message", {"peer": stage, "error": str(exc)})]
    newest = remap.replicas.get(replica.device)
    if newest is None or replica.step > newest[0]:
        remap.replicas[replica.device] = (replica.step, rows)
    return []


def results_remapping(
    state: ControlState,
    remap: RemapRun,
    alive: dict[int, Member],
    result_s: float,
) -> Flow:
    """Every live stage's ``lossy_result`` within ``result_s``, re-mapping each stage
    declared dead meanwhile; returns ``{stage: result}`` (the dead and the silent
    missing). ``alive`` loses the dead."""
    results: dict[str, LossyResult] = {}
    remap.names = {d: m.name for d, m in alive.items()}
    state.lossy_runs[remap.run] = remap  # the stages' replicas go there
    try:
        deadline = (yield Now()) + result_s
        while True:
            waiting = tuple(m.name for m in alive.values() if m.name not in results)
            now = yield Now()
            if not waiting or now >= deadline:
                return results
            got = yield AwaitReplies(waiting, LossyResult, deadline - now, "lossy_result",
                                     run=remap.run, partial=True, stop_on_lost=True)  # fmt: skip
            results.update(got)
            lost = [d for d, m in alive.items() if m.name not in results and _dead(state, m.name)]
            for d in lost:
                dead = alive.pop(d)
                yield from _remap_one(state, remap, d, dead.name, alive, results)
    finally:
        state.lossy_runs.pop(remap.run, None)


def _remap_one(
    state: ControlState,
    remap: RemapRun,
    device: int,
    name: str,
    alive: dict[int, Member],
    results: dict[str, LossyResult],
) -> Flow:
    holders = {d: m for d, m in alive.items() if m.name not in results}
    for member in holders.values():
        notice = LossyDead(run=remap.run, device=device, remap=True, epoch=remap.epoch)
        yield Send(member.routing_id, notice, member.name, stage=member.name)
    names = tuple(m.name for m in holders.values())
    holds: dict[str, LossyHold] = yield AwaitReplies(
        names, LossyHold, state.timeouts.reply_s, "lossy_hold", run=remap.run, partial=True
    )
    if set(holds) != set(names):
        silent = sorted(set(names) - set(holds))
        raise PipelineError(f"stages {silent} did not answer while device {device} was re-mapped")
    frontiers = [h.frontier for h in holds.values()]
    frontier = max(frontiers, default=remap.n_data)
    if len(holders) < len(alive):  # a survivor is done: nothing left to switch
        frontier = remap.n_data
    switch_at = frontier + 1
    after = remap_dead(remap.alloc, remap.prr, device) if switch_at <= remap.n_data else None
    # the dead device's neurons resume from its latest replica if it holds them all,
    # else from the run's start (zpipe.lossy.remap)
    step, rows = remap.replicas.get(device, (None, None))
    if rows is None or not replica_covers(remap.alloc, device, rows):
        step, rows = None, None
    yield Log("warning", "lossy_remap", {"run": remap.run, "device": device, "stage": name,
              "switch_at": switch_at if after is not None else None, "replica": step})  # fmt: skip
    for d, member in holders.items():
        message = (
            LossyRemap(run=remap.run)
            if after is None
            else _remap_message(remap, after, d, switch_at, rows)
        )
        yield Send(member.routing_id, replace(message, epoch=remap.epoch), member.name,
                   stage=member.name)  # fmt: skip
    if after is not None:
        remap.remaps.append([device, name, switch_at, after.to_dict(), step])
        remap.alloc = after


def _remap_message(
    remap: RemapRun,
    after: Allocation,
    device: int,
    switch_at: int,
    replica: dict[int, tuple[int, int, FloatArray, FloatArray]] | None,
) -> LossyRemap:
    before = remap.alloc
    pieces = initial_pieces(before, after, device, remap.params, replica)
    tensors = [to_tensor(a) for _, _, _, w, b in pieces for a in (w, b)]
    inputs = _owns(after, 0, device) and not _owns(before, 0, device)
    last = after.n_layers - 1
    labels = _owns(after, last, device) and not _owns(before, last, device)
    if inputs:
        tensors.append(to_tensor(remap.inputs))
        if remap.x_test is not None:
            tensors.append(to_tensor(remap.x_test))
    if labels:
        tensors.append(to_tensor(remap.labels))
    return LossyRemap(
        run=remap.run,
        switch_at=switch_at,
        alloc=after.to_dict(),
        pieces=[[layer, a, b] for layer, a, b, _, _ in pieces],
        inputs=inputs or None,
        labels=labels or None,
        tensors=tuple(tensors),
    )


def _owns(alloc: Allocation, layer: int, device: int) -> bool:
    return any(d == device for d, _ in alloc.owners(layer))


def _dead(state: ControlState, name: str) -> bool:
    member = state.membership.get(name)
    return member is None or member.state is MemberState.DEAD
