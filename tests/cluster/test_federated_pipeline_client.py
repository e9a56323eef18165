"""A pipeline client on a planned heterogeneous home trains what one process does.

Three stage processes emulate a Jetson NX, TX2 and Nano (``--slowdown`` 1, 1.5
and 3); Eco-FL's planner orders them and cuts a six-layer MLP unevenly; the
task's mini-batches are the numpy trainer's (the same generator), FedProx's term
included. Weights are compared with a tolerance far below how far training moves
them, and far below what mu changes.
"""

from __future__ import annotations

import numpy as np

from zpipe.federated.model import MLPShape, init_weights, local_train
from zpipe.federated.pipeline_trainer import PipelineTrainer

SHAPE = MLPShape.from_dims([16, 24, 16, 12, 12, 8, 4])
HOME = ("nano", "tx2", "nx")
TOLERANCE = 2e-5  # float32 stages against float64 numpy, 4 SGD steps


def _task() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(11)
    x, y = rng.normal(size=(40, SHAPE.n_in)), rng.integers(0, SHAPE.n_out, size=40)
    # the stages hold float32 weights: start the numpy trainer from the same values
    weights = init_weights(SHAPE, rng).astype(np.float32).astype(np.float64)
    return weights, x, y


def _numpy(weights: np.ndarray, x: np.ndarray, y: np.ndarray, mu: float) -> np.ndarray:
    return local_train(
        weights, SHAPE, x, y, steps=4, batch_size=8, lr=0.2, mu=mu, rng=np.random.default_rng(7)
    )


async def test_a_planned_three_stage_home_trains_like_one_process() -> None:
    weights, x, y = _task()
    mu = 0.5
    async with PipelineTrainer(home=HOME, start_timeout_s=240.0) as trainer:
        got = await trainer.train(
            weights, SHAPE, x, y, steps=4, batch_size=8, lr=0.2, mu=mu, rng=np.random.default_rng(7)
        )
    plan, report = trainer.last_plan, trainer.last_report
    assert plan is not None and report is not None
    # Eco-FL's plan: 3 stages, cut unevenly, fastest device first, micro-batches of the mini-batch
    spans = [(s.start, s.end) for s in plan.stages]
    assert len(spans) == 3 and spans != [(0, 2), (2, 4), (4, 6)]
    assert plan.stages[0].devices == ("nx0",)
    assert plan.num_microbatches * plan.microbatch_size == 8 and plan.num_microbatches > 1
    # the run trained on that plan, every stage process computing
    assert report.training_plan is not None
    assert [(s.devices, s.start, s.end) for s in report.training_plan.stages] == [
        (s.devices, s.start, s.end) for s in plan.stages
    ]
    assert len(report.losses) == 4
    want = _numpy(weights, x, y, mu)
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    # the comparison could fail: training moves the weights, and mu changes them, by far more
    assert np.abs(want - weights).max() > 100 * TOLERANCE
    assert np.abs(_numpy(weights, x, y, 0.0) - want).max() > 10 * TOLERANCE
