"""Asynchronous 1F1B on real stages takes what a synchronous run takes: a learning-rate
schedule, a user loss and optimizer (the stages' ``--allow-factory``), and a resume
from a checkpoint with optimizer state; N mini-batches, a checkpoint and N more equal
the single-process reference of 2N with the same settings."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests._support.async_training import SPEC, make_batches
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.models import ModelSpec
from zpipe.planner.async_schedule import AsyncSettings
from zpipe.training.async_reference import train_async_reference

TORCH_CE = "torch.nn.functional:cross_entropy"
TORCH_ADAM = "torch.optim:Adam"
OPTIMIZER = {"name": TORCH_ADAM, "lr": 0.01, "betas": [0.8, 0.99]}
COSINE = {"name": "cosine", "warmup_steps": 2, "total_steps": 10}
PARTITION = [[0, 2], [2, 4]]


@pytest.fixture(scope="module")
def factory_cluster() -> Iterator[LocalCluster]:
    with LocalCluster(
        [DeviceSpec("p0"), DeviceSpec("p1")],
        heartbeat_interval_s=0.5,
        allow_factories=(TORCH_CE, TORCH_ADAM),
    ) as running:
        yield running


def test_n_then_a_checkpoint_then_n_more_equals_the_reference_of_2n(
    factory_cluster: LocalCluster, tmp_path: Path
) -> None:
    batches = make_batches(10, 5, seed=13)
    settings = AsyncSettings(aggregate=True)
    want = train_async_reference(
        SPEC,
        batches,
        bounds=[0, 2, 4],
        optimizer=OPTIMIZER,
        loss=TORCH_CE,
        settings=settings,
        lr_schedule=COSINE,
    )
    common = {
        "optimizer": OPTIMIZER,
        "loss": TORCH_CE,
        "lr_schedule": COSINE,
        "num_microbatches": 1,
        "schedule": "async-1f1b",
        "partition": PARTITION,
        "aggregate": True,
        "progress": False,
    }
    first = factory_cluster.fit(SPEC, batches[:5], optimizer_state=True, **common)
    assert first.losses == pytest.approx(want.losses[:5], rel=1e-6)
    # the checkpoint keeps each unit's weight versions beside the optimizer's state
    assert any("#v" in k or "#live_versions" in k for k in first.state_dict)
    checkpoint = tmp_path / "async.safetensors"
    first.save(checkpoint)
    resumed = ModelSpec(SPEC.family, SPEC.config, seed=SPEC.seed, weights=str(checkpoint))
    second = factory_cluster.fit(
        resumed, batches[5:], resume_optimizer=True, start_step=5, **common
    )
    assert second.losses == pytest.approx(want.losses[5:], rel=1e-6)
    assert set(second.state_dict) == set(want.state_dict)
    for key, value in want.state_dict.items():
        torch.testing.assert_close(second.state_dict[key], value, rtol=1e-6, atol=1e-7)
