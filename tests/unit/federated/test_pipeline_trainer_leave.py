"""A device that leaves a pipeline client's home is planned out and the task trained again.

The trainer's cluster is a fake here (no processes): its ``fit`` fails the way a run
whose stage died does (``StageFailedError`` naming the stage), or a stage's process
is reported exited before the task; the trainer plans the home again over the
devices left and trains the task again from its start.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zpipe._errors import ConfigError, StageFailedError
from zpipe.federated.model import MLPShape
from zpipe.federated.pipeline_trainer import PipelineTrainer
from zpipe.models.spec import ModelSpec
from zpipe.planner.training_plan import TrainingPlan

SHAPE = MLPShape.from_dims([16, 24, 16, 12, 12, 8, 4])
HOME = ("nx", "tx2", "nano")
SPEC = ModelSpec("mlp", {"dims": list(SHAPE.dims)}, seed=0)
BATCHES = [(torch.zeros(8, 16), torch.zeros(8, dtype=torch.int64))]


class _Exited:
    def poll(self) -> int | None:
        return -9


class _FakeCluster:
    """Fails every run whose plan uses a device of ``failing`` (the first of them
    named), and records each run's plan."""

    def __init__(self, failing: set[str]) -> None:
        self.failing = failing
        self.plans: list[TrainingPlan] = []
        self.processes: dict[str, Any] = {}

    async def fit(self, spec: ModelSpec, batches: Any, *, plan: TrainingPlan, **_: Any) -> str:
        self.plans.append(plan)
        dead = [d for d in plan.devices if d in self.failing]
        if dead:
            raise StageFailedError(dead[0], "no heartbeat for 5.0 s")
        return "report"


def _trainer(failing: set[str]) -> tuple[PipelineTrainer, _FakeCluster]:
    trainer = PipelineTrainer(home=HOME, reschedule=None)
    fake = _FakeCluster(failing)
    trainer._cluster = fake  # type: ignore[assignment]
    return trainer, fake


async def test_a_stage_that_dies_in_a_task_is_planned_out_and_the_task_runs_again() -> None:
    trainer, fake = _trainer({"tx20"})
    first = trainer.plan_for(SHAPE, 8)
    assert "tx20" in first.devices
    plan, report = await trainer._fit_on_home(SPEC, BATCHES, SHAPE, 8, 0.1, 0.0)
    assert report == "report"
    # the failed run on the whole home, then the same task on the two devices left
    assert fake.plans[0].devices == first.devices
    assert sorted(plan.devices) == ["nano0", "nx0"] and fake.plans[-1] is plan
    assert len(fake.plans) == 2
    look = trainer.reschedules[-1]
    assert look["left"] == ["tx20"] and look["rescheduled"] and look["task"] == 1
    assert "no heartbeat" in str(look["reason"])
    assert trainer.plan_for(SHAPE, 8) is plan  # the next task plans without it too


async def test_a_stage_process_that_exited_before_a_task_is_planned_out_first() -> None:
    trainer, fake = _trainer(set())
    fake.processes["nano0"] = _Exited()
    plan, _ = await trainer._fit_on_home(SPEC, BATCHES, SHAPE, 8, 0.1, 0.0)
    assert sorted(plan.devices) == ["nx0", "tx20"] and len(fake.plans) == 1
    assert "exited" in str(trainer.reschedules[-1]["reason"])


async def test_when_every_device_has_left_the_task_fails() -> None:
    trainer, _ = _trainer({"nx0", "tx20", "nano0"})
    with pytest.raises(StageFailedError):
        await trainer._fit_on_home(SPEC, BATCHES, SHAPE, 8, 0.1, 0.0)
    assert len(trainer.reschedules) == 2  # two left, the last one's failure is the task's


async def test_a_failure_of_a_stage_outside_the_home_is_not_taken_for_a_leave() -> None:
    trainer, fake = _trainer(set())

    async def fit(*_: Any, **__: Any) -> str:
        raise StageFailedError("somebody-else", "gone")

    fake.fit = fit  # type: ignore[method-assign]
    with pytest.raises(StageFailedError):
        await trainer._fit_on_home(SPEC, BATCHES, SHAPE, 8, 0.1, 0.0)
    assert trainer.reschedules == []


def test_a_home_emptied_by_exits_says_so() -> None:
    trainer, _ = _trainer(set())
    plan = trainer.plan_for(SHAPE, 8)
    with pytest.raises(ConfigError, match="every device of the home has left"):
        trainer._plan_out(["nx0", "tx20", "nano0"], plan, SHAPE, 8, "exited")
