"""Asynchronous 1F1B training in one process: the reference a pipeline run must equal.

Runs every stage's action list (:mod:`zpipe.planner.async_schedule`) in one valid
global order, each stage an :class:`~zpipe.training.async_stage.AsyncStageCompute`,
moving activations and gradients by hand. Each stage's order is fixed and its
weight versions are its own, so any valid order, and so a multi-process run of
the same settings, gives the same weights and losses (up to float summation
order, which is the same too: the same ops run on the same tensors).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from zpipe._errors import ConfigError, ProtocolError
from zpipe.models import ModelSpec, load_layer_sequence
from zpipe.models.weights import unit_key
from zpipe.planner.async_schedule import (
    AsyncAction,
    AsyncSettings,
    aggregation_intervals,
    async_global_order,
    concurrent_versions,
    forward_version,
    versions_read_after,
)
from zpipe.training.async_regroup import (
    regroup_stages,
    unit_state_from_tensors,
    unit_state_tensors,
)
from zpipe.training.async_stage import AsyncStageCompute, common_versions


@dataclass
class AsyncReferenceResult:
    state_dict: dict[str, torch.Tensor]
    losses: list[float]
    # per stage: batch -> the weight version its forward / backward used
    forward_versions: list[dict[int, int]] = field(default_factory=list)
    backward_versions: list[dict[int, int]] = field(default_factory=list)
    # every unit's whole state at the end (weights, optimizer state, the versions the
    # next forwards read): what a checkpoint of the run keeps, ``start_state``'s form
    checkpoint: dict[str, torch.Tensor] = field(default_factory=dict)


def train_async_reference(
    spec: ModelSpec,
    batches: Sequence[tuple[torch.Tensor, ...]],
    *,
    bounds: Sequence[int],
    optimizer: dict[str, Any],
    loss: str = "cross_entropy",
    settings: AsyncSettings | None = None,
    repartitions: Mapping[int, Sequence[int]] | None = None,
    flushes: Sequence[int] = (),
    lr_schedule: Mapping[str, Any] | None = None,
    start_state: Mapping[str, torch.Tensor] | None = None,
) -> AsyncReferenceResult:
    """Train ``spec`` split at ``bounds`` (unit indices, first 0, last the unit count)
    on ``batches`` (``(inputs..., labels)``) as an asynchronous pipeline would.

    ``repartitions``: batch ``R`` -> the bounds the pipeline is cut at from batch ``R``
    on (a live re-partition: the pipeline flushes after batch ``R - 1`` and every
    unit moves with its state, :mod:`zpipe.training.async_regroup`). Bounds of fewer
    stages are a recovery onto the survivors at a replica taken there: the forwards
    keep the staleness of the depth the run started with (vertical sync), and the
    aggregations its windows (stage ``j`` averages ``depth - j`` versions: see
    :mod:`zpipe.planner.async_schedule`). ``flushes``: batches before which the
    pipeline only flushes (a replica of a run that recovers; a re-partition that
    keeps the cuts). ``lr_schedule``: read at each stage's own update count, as a
    stage does (:mod:`zpipe.training.async_stage`). ``loss`` and ``optimizer`` may name
    user code ("package.module:function"): this process's own choice, loaded as
    ``fit`` loads it. ``start_state``: a checkpoint of an asynchronous run (every
    unit's weights, optimizer state and weight versions, as ``TrainReport.save``
    writes them without the step count): the run goes on from its update count, as a
    resumed pipeline does; its ``batches`` are numbered from 0 again."""
    settings = settings or AsyncSettings()
    n = len(bounds) - 1
    if n < 1:
        raise ConfigError(f"bounds {list(bounds)} describe no stage")
    depth = settings.depth_of(n)
    cuts = {int(r): tuple(int(b) for b in c) for r, c in (repartitions or {}).items()}
    for r in flushes:
        cuts.setdefault(int(r), ())  # () : the cuts of the moment
    if any(not 0 < r < len(batches) for r in cuts):
        raise ConfigError(f"re-partitions at {sorted(cuts)} fall outside 1..{len(batches) - 1}")
    if any(cuts.values()) and not settings.vertical_sync:
        raise ConfigError("a live re-partition needs vertical sync (the versions it keeps)")
    sequence = load_layer_sequence(spec)
    stages = [
        AsyncStageCompute(
            sequence.build_units(bounds[i], bounds[i + 1]),
            first=i == 0,
            last=i == n - 1,
            loss=loss,
            optimizer=optimizer,
            lr_schedule=lr_schedule,
        )
        for i in range(n)
    ]
    if start_state is not None:
        stages = [
            _resumed(stage, bounds[i], start_state, lr_schedule=lr_schedule)
            for i, stage in enumerate(stages)
        ]
    origin = stages[0].updates
    activations: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
    grads: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
    losses: dict[int, float] = {}
    last_backward = [-1] * n
    forward_versions: list[dict[int, int]] = [{} for _ in range(n)]
    backward_versions: list[dict[int, int]] = [{} for _ in range(n)]
    segment_starts = [0, *sorted(cuts)]
    for lo, hi in zip(segment_starts, [*segment_starts[1:], len(batches)], strict=True):
        if cuts.get(lo):
            for i, stage in enumerate(stages):
                forward_versions[i].update(stage.forward_versions)
                backward_versions[i].update(stage.backward_versions)
            stages = regroup_stages(
                stages, cuts[lo], loss=loss, optimizer=optimizer, lr_schedule=lr_schedule
            )
            bounds = cuts[lo]
            n = len(bounds) - 1
            settings.depth_of(n)  # a pipeline no deeper than the run's
        every = aggregation_intervals(
            n, aggregate=settings.aggregate, multiple=settings.aggregate_multiple, depth=depth
        )
        order = async_global_order(
            n,
            hi,
            max_in_flight=settings.max_in_flight,
            aggregate_every=every,
            first_batch=lo,
            batches_before=origin,
        )
        _run_order(
            stages,
            order,
            batches,
            settings,
            depth,
            origin,
            activations,
            grads,
            losses,
            last_backward,
        )
    for i, stage in enumerate(stages):
        if i >= len(forward_versions):
            break
        forward_versions[i].update(stage.forward_versions)
        backward_versions[i].update(stage.backward_versions)
    state: dict[str, torch.Tensor] = {}
    for i, stage in enumerate(stages):
        for offset, unit in enumerate(stage.units):
            for name, tensor in unit.state_dict().items():
                state[unit_key(bounds[i] + offset, name)] = tensor.detach().clone()
    checkpoint: dict[str, torch.Tensor] = {}
    for i, stage in enumerate(stages):
        versions = versions_read_after(
            i, n, stage.updates, vertical_sync=settings.vertical_sync, depth=depth
        )
        for offset, kept in enumerate(stage.export_units()):
            for key, tensor in unit_state_tensors(bounds[i] + offset, kept, versions).items():
                checkpoint[key] = tensor.detach().clone()
    return AsyncReferenceResult(
        checkpoint=checkpoint,
        state_dict=state,
        losses=[losses[b] for b in range(len(batches))],
        forward_versions=forward_versions,
        backward_versions=backward_versions,
    )


def _run_order(
    stages: Sequence[AsyncStageCompute],
    order: Sequence[tuple[int, AsyncAction]],
    batches: Sequence[tuple[torch.Tensor, ...]],
    settings: AsyncSettings,
    depth: int,
    origin: int,
    activations: dict[tuple[int, int], tuple[torch.Tensor, ...]],
    grads: dict[tuple[int, int], tuple[torch.Tensor, ...]],
    losses: dict[int, float],
    last_backward: list[int],
) -> None:
    n = len(stages)
    for i, action in order:
        stage = stages[i]
        b = action.batch
        if action.kind == "F":
            assert b is not None
            inputs = tuple(batches[b][:-1]) if i == 0 else activations.pop((i, b))
            version = forward_version(
                i, n, origin + b, vertical_sync=settings.vertical_sync, depth=depth
            )
            target = batches[b][-1] if i == n - 1 else None
            samples = int(batches[b][0].shape[0])
            outputs, value = stage.forward(b, version, inputs, target, samples)
            if i == n - 1:
                assert value is not None
                losses[b] = value
            else:
                activations[(i + 1, b)] = outputs
            stage.forget_versions_before(version, keep_newest=concurrent_versions(i, depth))
        elif action.kind == "B":
            assert b is not None
            upstream = stage.backward(b, grads.pop((i, b), ()))
            if i > 0:
                grads[(i - 1, b)] = upstream
            last_backward[i] = b
        elif action.kind == "STEP":
            stage.step(last_backward[i])
        elif action.kind == "AGG":
            stage.aggregate(concurrent_versions(i, depth))


def _resumed(
    stage: AsyncStageCompute,
    start: int,
    state: Mapping[str, torch.Tensor],
    *,
    lr_schedule: Mapping[str, Any] | None,
) -> AsyncStageCompute:
    """``stage``'s units at the checkpoint ``state`` holds for them (a stage's
    :meth:`~zpipe.stage.executors.async_shard.AsyncShard.resume_checkpoint`)."""
    try:
        units = [
            unit_state_from_tensors(start + j, unit, state) for j, unit in enumerate(stage.units)
        ]
    except ProtocolError as exc:
        raise ConfigError(f"the checkpoint does not fit the model: {exc}") from None
    versions = common_versions(units)
    if not versions:
        raise ConfigError(
            f"the checkpoint holds no weight versions of units {start}..{start + len(units) - 1}"
            ": it is not one of an asynchronous run"
        )
    return AsyncStageCompute.adopt(
        units,
        updates=max(versions),
        first=stage.first,
        last=stage.last,
        loss=stage.loss,
        optimizer=stage.optimizer_config,
        lr_schedule=lr_schedule,
        policy=stage.policy,
    )
