"""Asynchronous 1F1B on real stage shards in one process: what a stage executor calls
(``forward_at``, ``backward``, ``step_batch``, ``aggregate``), in one valid global
order, so a shard's settings (lr schedule, user code, device, resumed state) are
checked against :func:`~zpipe.training.async_reference.train_async_reference`
without processes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zpipe.models.weights import unit_key
from zpipe.planner.async_schedule import (
    AsyncSettings,
    aggregation_intervals,
    async_global_order,
    concurrent_versions,
    forward_version,
)
from zpipe.stage.executors.async_shard import AsyncShard


def run_shards(
    shards: Sequence[AsyncShard],
    batches: Sequence[tuple[torch.Tensor, ...]],
    *,
    settings: AsyncSettings | None = None,
) -> list[float]:
    """Train ``batches`` on ``shards`` (one per stage), numbering them from 0 again and
    counting versions from the shards' update count (a resumed run, as the executor's
    ``origin``); the losses."""
    settings = settings or AsyncSettings()
    n = len(shards)
    depth = settings.depth_of(n)
    origin = shards[0].updates
    every = aggregation_intervals(
        n, aggregate=settings.aggregate, multiple=settings.aggregate_multiple, depth=depth
    )
    order = async_global_order(n, len(batches), aggregate_every=every, batches_before=origin)
    activations: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
    grads: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
    losses: dict[int, float] = {}
    steps = [0] * n
    for i, action in order:
        shard, b = shards[i], action.batch
        if action.kind == "F":
            assert b is not None
            inputs = tuple(batches[b][:-1]) if i == 0 else activations.pop((i, b))
            target = batches[b][-1] if i == n - 1 else None
            version = forward_version(
                i, n, origin + b, vertical_sync=settings.vertical_sync, depth=depth
            )
            outputs, loss, _ = shard.forward_at(
                b,
                version,
                inputs,
                target,
                int(batches[b][0].shape[0]),
                concurrent_versions(i, depth),
            )
            if i == n - 1:
                assert loss is not None
                losses[b] = loss
            else:
                activations[(i + 1, b)] = outputs
        elif action.kind == "B":
            assert b is not None
            upstream, _ = shard.backward(b, grads.pop((i, b), ()))
            if i > 0:
                grads[(i - 1, b)] = upstream
        elif action.kind == "STEP":
            shard.step_batch(steps[i])
            steps[i] += 1
        elif action.kind == "AGG":
            shard.aggregate(concurrent_versions(i, depth))
    return [losses[b] for b in range(len(batches))]


def shard_weights(shards: Sequence[AsyncShard]) -> dict[str, torch.Tensor]:
    """Every shard's live weights under the full model's keys (the reference's
    ``state_dict``)."""
    out: dict[str, torch.Tensor] = {}
    for shard in shards:
        for offset, unit in enumerate(shard.units):
            for name, tensor in unit.state_dict().items():
                out[unit_key(shard.start + offset, name)] = tensor.detach().to("cpu")
    return out
