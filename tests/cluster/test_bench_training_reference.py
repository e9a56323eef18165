"""bench/training.py's hetero check: pipelined CNN training (BatchNorm, conv units)
equals the single-process reference for the same micro-batching, for any split."""

from __future__ import annotations

import pytest
import torch

from bench._torch_pipelining_baseline import make_batches
from bench._training_reference import reference_losses
from zpipe.cluster import LocalCluster
from zpipe.models import ModelSpec

CNN = ModelSpec(
    "cnn",
    {"channels": [4, 8, 8], "pool": [False, True, True], "image_size": 8, "num_classes": 3},
    seed=3,
)
SGD = {"name": "sgd", "lr": 0.05}


def test_the_reference_depends_on_the_microbatching() -> None:
    """BatchNorm normalises per micro-batch: 2 and 4 micro-batches train differently,
    which is why a run is compared with the reference for its own micro-batching."""
    batches = make_batches(CNN, 3, 8, seed=1)
    two = reference_losses(CNN, batches, 2, SGD, threads=1)
    four = reference_losses(CNN, batches, 4, SGD, threads=1)
    assert max(abs(a - b) for a, b in zip(two, four, strict=True)) > 1e-3


@pytest.mark.parametrize(
    ("schedule", "partition"),
    [("1f1b", [[0, 1], [1, 3], [3, 4]]), ("gpipe", [[0, 2], [2, 4]])],
    ids=["1f1b-3-stages", "gpipe-2-stages"],
)
def test_pipelined_cnn_training_equals_the_reference(
    cluster: LocalCluster, schedule: str, partition: list[list[int]]
) -> None:
    batches = make_batches(CNN, 3, 8, seed=1)
    want = reference_losses(CNN, batches, 4, SGD, threads=torch.get_num_threads())
    report = cluster.fit(
        CNN,
        batches,
        optimizer=SGD,
        num_microbatches=4,
        schedule=schedule,
        partition=partition,
        progress=False,
    )
    assert report.losses == pytest.approx(want, rel=1e-5, abs=1e-6)
