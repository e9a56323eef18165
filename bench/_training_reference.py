"""The single-process reference of a pipelined training run: the whole model in one
:class:`~zpipe.stage.executors.training_shard.TrainShard`, fed the same micro-batches.

Synchronous pipelined training computes exactly this (for any partition and either
schedule), so a run's losses are checked against it rather than against another run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from zpipe.client import split_minibatch
from zpipe.models import ModelSpec, load_layer_sequence
from zpipe.stage.executors.training_shard import TrainShard


def reference_losses(
    spec: ModelSpec,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    num_microbatches: int,
    optimizer: Mapping[str, Any],
    threads: int,
) -> list[float]:
    """Each mini-batch's loss (the sum of its micro-batches'), trained in this process
    with ``threads`` intra-op threads (the stages' count: rounding depends on it)."""
    sequence = load_layer_sequence(spec)
    shard = TrainShard(
        sequence.build_units(0, sequence.num_units),
        start=0,
        first=True,
        last=True,
        loss="cross_entropy",
        optimizer=optimizer,
    )
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        losses = []
        for inputs, labels in batches:
            total = 0.0
            for mb, (x, y) in enumerate(split_minibatch((inputs, labels), num_microbatches)):
                _, loss, _ = shard.forward(mb, (x,), y, len(inputs))
                shard.backward(mb)
                total += loss or 0.0
            shard.step()
            losses.append(total)
        return losses
    finally:
        torch.set_num_threads(previous)
