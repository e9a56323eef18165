"""The CNN (Fig. 10(c)) on ordinary stages: the session's shared cluster of three
stages runs it, and every run equals its in-process simulation exactly (the same
partials lost, the same losses and weights, the same test-time predictions)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from zpipe.client.runs.lossy import StagesLossyResult, run_lossy
from zpipe.cluster import LocalCluster
from zpipe.lossy.data import Dataset
from zpipe.lossy.evaluation import EvalSpec
from zpipe.lossy.simulate import PreparedRun, RunConfig, prepare_run
from zpipe.lossy.trace import evaluate_in_process, train_in_process

pytestmark = pytest.mark.timeout(180)

SIDE, CLASSES = 6, 4
# 3 devices: the convolution layers on one, the dense head on two; region 80 m: lossy
BASE = RunConfig(
    allocation="vertical",
    model="cnn",
    n_devices=3,
    region_m=80.0,
    seed=3,
    conv_channels=(2, 3, 3),
    hidden=(6, 6, 5),
    lr=0.1,
    batch_size=5,
    n_data=4,
    mapping="exhaustive",
)


@pytest.fixture(scope="module")
def data() -> Dataset:
    rng = np.random.default_rng(2)
    x = rng.uniform(size=(60, SIDE * SIDE))
    y = rng.integers(0, CLASSES, size=60)
    y[0] = CLASSES - 1
    return Dataset("images", x, y, x[:10], y[:10])


@pytest.fixture(scope="module")
def stages(cluster: LocalCluster) -> list[str]:
    cluster.wait_for_stages(3, timeout_s=60)
    return [d.name for d in cluster.devices]


def _run(
    cluster: LocalCluster, prepared: PreparedRun, data: Dataset, **options: Any
) -> StagesLossyResult:
    async def go() -> StagesLossyResult:
        async with cluster.client() as client:
            return await run_lossy(client, prepared, data, **options)

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("allocation", "lossless"), [("hybrid", True), ("vertical", False), ("hybrid", False)]
)
def test_a_cnn_run_on_stages_equals_its_simulation(
    cluster: LocalCluster, stages: list[str], data: Dataset, allocation: str, lossless: bool
) -> None:
    prepared = prepare_run(replace(BASE, allocation=allocation, lossless=lossless), data)
    want = train_in_process(prepared, data)
    if not lossless:  # the comparison means something only if messages were lost
        assert want.propagation.rate("forward", "backward") < 1.0
    result = _run(cluster, prepared, data, stage_names=stages, test_repeats=2)
    assert result.alloc == prepared.alloc  # the coordinator partitioned the CNN the same way
    got = result.trace
    assert got.arrivals == want.arrivals
    assert {k: v.as_dict() for k, v in got.traffic.items()} == {
        k: v.as_dict() for k, v in want.traffic.items()
    }
    np.testing.assert_allclose(list(got.losses.values()), list(want.losses.values()), rtol=1e-10)
    for (w1, b1), (w2, b2) in zip(got.params, want.params, strict=True):
        np.testing.assert_allclose(w1, w2, rtol=1e-10, atol=1e-13)
        np.testing.assert_allclose(b1, b2, rtol=1e-10, atol=1e-13)
    assert result.late == 0 and not any(result.protocol_errors.values())
    assert result.test is not None
    spec = EvalSpec(len(data.x_test), BASE.batch_size, repeats=2)
    simulated = evaluate_in_process(prepared, want.params, data.x_test, spec)
    assert result.test.same_as(simulated)
    assert result.test_acc == simulated.accuracy(data.y_test)
