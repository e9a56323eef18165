"""An asynchronous training run's controller (PipeDream's and FTPipeHD's 1F1B).

The same start as a synchronous run (assign, ready, go, connect: see
:mod:`zpipe.coordinator.runs.sync_training`), and the same checkpoint at the end (every
stage's weights once it has backwarded every batch). A live re-partition (the
client pauses its feed, the stages flush, move units and commit) is
:mod:`zpipe.coordinator.runs.async_repartition`'s, as for synchronous runs. Replicas are taken
at flush points the client makes (:mod:`zpipe.coordinator.runs.async_replicas`): global
copies of every unit with its weight versions; a recovery resumes from one as a
synchronous run's does.

Pure: events in, commands out.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from zpipe._errors import ConfigError
from zpipe.coordinator.flows import Flow
from zpipe.coordinator.runs.async_replicas import collect_async_replica
from zpipe.coordinator.runs.sync_training import SyncTrainingController
from zpipe.planner.async_schedule import ASYNC_SCHEDULE, async_warmup
from zpipe.planner.training_plan import TrainingPlan


class AsyncTrainingController(SyncTrainingController):
    kind = "train-async"

    def collect_replica(self, step: int, global_copy: bool, counters: dict[str, Any]) -> Flow:
        return (yield from collect_async_replica(self, step, global_copy, counters))


def planning_schedule(schedule: str) -> str:
    """The schedule a training planner costs a run of ``schedule`` with: asynchronous
    1F1B runs one mini-batch per round, as synchronous 1F1B with M = 1 does."""
    return "1f1b" if schedule == ASYNC_SCHEDULE else schedule


def as_async_plan(plan: TrainingPlan) -> TrainingPlan:
    """A planned pipeline, run asynchronously: one device per stage, warm-ups n - i.

    A stage shared by several devices (data parallelism, which ``hpp`` may plan) is
    refused, with the reason: every stage of an asynchronous run updates after each
    mini-batch's backward, so a shared stage would all-reduce at every update and keep
    every weight version it stashes identical on each of its devices; that is not
    built (synchronous schedules all-reduce once per round)."""
    shared = [list(s.devices) for s in plan.stages if len(s.devices) > 1]
    if shared:
        raise ConfigError(
            f"{ASYNC_SCHEDULE} runs one device per stage; the planner shared stages "
            f"{shared} between devices (data parallelism), which asynchronous 1F1B does "
            "not do: each stage updates after every mini-batch, so a shared stage would "
            "all-reduce at every update and keep its weight versions equal on each "
            "device. Use planner 'straight', 'even' or 'pipeedge', or a partition"
        )
    n = len(plan.stages)
    stages = tuple(replace(s, warmup=async_warmup(i, n)) for i, s in enumerate(plan.stages))
    return replace(plan, schedule=ASYNC_SCHEDULE, num_microbatches=1, stages=stages)


def as_planning_plan(plan: TrainingPlan) -> TrainingPlan:
    """An asynchronous plan as the synchronous 1F1B plan (M = 1) the planners re-plan
    (:func:`planning_schedule`); :func:`as_async_plan` turns the result back."""
    if plan.schedule != ASYNC_SCHEDULE:
        return plan
    stages = tuple(replace(s, warmup=1) for s in plan.stages)
    return replace(plan, schedule=planning_schedule(plan.schedule), stages=stages)
