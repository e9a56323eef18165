"""An asynchronous run's plan: one device per stage, warm-ups n - i; a stage the
planner shared between devices (data parallelism) is refused with the reason."""

from __future__ import annotations

import pytest

from zpipe._errors import ConfigError
from zpipe.coordinator.runs.async_training import as_async_plan, as_planning_plan
from zpipe.planner.training_plan import TrainingPlan, TrainStage, validate_training_plan


def _plan(*stages: TrainStage) -> TrainingPlan:
    return TrainingPlan(
        algo="hpp",
        schedule="1f1b",
        num_units=4,
        microbatch_size=8,
        num_microbatches=1,
        stages=stages,
    )


def test_a_planned_pipeline_runs_asynchronously_with_warmups_n_minus_i() -> None:
    plan = _plan(TrainStage(("a",), 0, 2, (8,), 1), TrainStage(("b",), 2, 4, (8,), 1))
    run = as_async_plan(plan)
    assert run.schedule == "async-1f1b" and [s.warmup for s in run.stages] == [2, 1]
    validate_training_plan(run)
    assert as_planning_plan(run) == plan


def test_a_stage_shared_between_devices_is_refused_with_the_reason() -> None:
    plan = _plan(TrainStage(("a", "b"), 0, 2, (4, 4), 1), TrainStage(("c",), 2, 4, (8,), 1))
    with pytest.raises(ConfigError) as refused:
        as_async_plan(plan)
    message = str(refused.value)
    assert "['a', 'b']" in message and "data parallelism" in message
    assert "all-reduce at every update" in message and "planner 'straight'" in message
