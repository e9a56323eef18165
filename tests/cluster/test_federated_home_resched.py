"""A pipeline client's home re-scheduled between tasks still trains what one process does.

Three stage processes emulate a Jetson NX, TX2 and Nano. The trainer reads each
device's speed from the real stage counters of its tasks; then the NX is reported
ten times slower (its counters scaled: a slowdown at a known moment, with no
timing to wait for), the home is planned again with the NX moved, and the next
task trains on that plan: its weights equal the numpy trainer's on the same
mini-batches, as before the re-schedule.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from zpipe.federated.model import MLPShape, init_weights, local_train
from zpipe.federated.pipeline_trainer import PipelineTrainer

SHAPE = MLPShape.from_dims([16, 24, 16, 12, 12, 8, 4])
HOME = ("nx", "tx2", "nano")
TOLERANCE = 2e-5  # float32 stages against float64 numpy, 4 SGD steps


async def test_a_rescheduled_home_trains_the_next_task_like_one_process() -> None:
    rng = np.random.default_rng(11)
    x, y = rng.normal(size=(40, SHAPE.n_in)), rng.integers(0, SHAPE.n_out, size=40)
    weights = init_weights(SHAPE, rng).astype(np.float32).astype(np.float64)
    task = {"steps": 4, "batch_size": 8, "lr": 0.2, "mu": 0.5}
    # a threshold no real swing reaches, until the NX is reported slow below
    async with PipelineTrainer(home=HOME, reschedule=100.0, start_timeout_s=240.0) as trainer:
        for seed in range(3):
            await trainer.train(weights, SHAPE, x, y, rng=np.random.default_rng(seed), **task)
        first = trainer.last_plan
        report = trainer.last_report
        assert first is not None and report is not None
        looks = trainer.reschedules
        assert "warms" in str(looks[0]["reason"]) and "no history" in str(looks[1]["reason"])
        # the third task was judged from the stages' own counters, every device measured
        assert not looks[2]["rescheduled"]
        assert set(looks[2]["deviations"]) == set(first.devices)  # type: ignore[arg-type]
        assert trainer.plan_for(SHAPE, 8) is first
        # the NX turns ten times slower: its counters say so
        slow = {d: dict(c) for d, c in report.stages.items()}
        for key in ("forward_s", "backward_s"):
            slow["nx0"][key] = 10 * float(slow["nx0"][key])
        trainer.last_report = replace(report, stages=slow)
        trainer.reschedule = 0.5
        trainer._look(SHAPE, 8, first)
        look = trainer.reschedules[-1]
        assert look["rescheduled"], look["reason"]
        new = trainer.plan_for(SHAPE, 8)
        assert new != first and "nx0" in str(look["reason"])
        got = await trainer.train(weights, SHAPE, x, y, rng=np.random.default_rng(7), **task)
        trained = trainer.last_report
    assert trained is not None and trained.training_plan is not None
    assert [(s.devices, s.start, s.end) for s in trained.training_plan.stages] == [
        (s.devices, s.start, s.end) for s in new.stages
    ]
    want = local_train(weights, SHAPE, x, y, rng=np.random.default_rng(7), **task)
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    assert np.abs(want - weights).max() > 100 * TOLERANCE


async def test_a_task_rebalanced_mid_way_keeps_fedprox_exact() -> None:
    # the NX, planned as the fastest device and given the most layers, computes 20x
    # slower from the start: the run moves cuts away from it at a replica, and the
    # stages restored there keep FedProx's anchor (the replica carries the optimizer's
    # state), so the task still trains what one process does. Wide layers, so that the
    # slowdown outweighs what a loaded machine adds to every stage alike.
    shape = MLPShape.from_dims([16, 256, 256, 256, 256, 4])
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(96, shape.n_in)), rng.integers(0, shape.n_out, size=96)
    weights = init_weights(shape, rng).astype(np.float32).astype(np.float64)
    task = {"steps": 6, "batch_size": 32, "lr": 0.05, "mu": 0.5}
    async with PipelineTrainer(
        home=HOME,
        microbatch_sizes=(16,),
        load_schedules={"nx0": "0:20"},
        rebalance=0.2,
        rebalance_every=2,
        start_timeout_s=240.0,
    ) as trainer:
        got = await trainer.train(weights, shape, x, y, rng=np.random.default_rng(5), **task)
    report = trainer.last_report
    assert report is not None and report.rebalances, "the slow NX was never rebalanced"
    assert report.recoveries == []
    want = local_train(weights, shape, x, y, rng=np.random.default_rng(5), **task)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    assert np.abs(want - weights).max() > 100 * 1e-4
    # without the proximal term the weights would differ by far more than the tolerance
    free = local_train(weights, shape, x, y, rng=np.random.default_rng(5), **{**task, "mu": 0.0})
    assert np.abs(free - want).max() > 10 * 1e-4


async def test_a_device_that_leaves_is_planned_out_and_the_next_task_trains_like_one_process() -> (
    None
):
    # the TX2's stage process is killed between two tasks: the home is planned again
    # over the NX and the Nano, and the task trains on them what one process does
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(40, SHAPE.n_in)), rng.integers(0, SHAPE.n_out, size=40)
    weights = init_weights(SHAPE, rng).astype(np.float32).astype(np.float64)
    task = {"steps": 4, "batch_size": 8, "lr": 0.2, "mu": 0.5}
    async with PipelineTrainer(home=HOME, reschedule=None, start_timeout_s=240.0) as trainer:
        await trainer.train(weights, SHAPE, x, y, rng=np.random.default_rng(0), **task)
        first = trainer.last_plan
        assert first is not None and "tx20" in first.devices
        trainer._cluster.kill("tx20")
        got = await trainer.train(weights, SHAPE, x, y, rng=np.random.default_rng(1), **task)
        trained = trainer.last_report
        look = trainer.reschedules[-1]
    assert look["left"] == ["tx20"] and look["rescheduled"]
    assert trained is not None and trained.training_plan is not None
    assert sorted(trained.training_plan.devices) == ["nano0", "nx0"]
    want = local_train(weights, SHAPE, x, y, rng=np.random.default_rng(1), **task)
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    assert np.abs(want - weights).max() > 100 * TOLERANCE
