"""A stage's speed verdict, relayed by the coordinator, makes the client's next fed
mini-batch a re-partition look: once per verdict, never for cuts moved since.

The attempts controller is pure (events in, commands out); these feed it the
``SpeedNoticed`` events the feed's shell makes of the coordinator's ``speed_changed``.
"""

from __future__ import annotations

from typing import Any

from zpipe.client.batches import ReplayBuffer
from zpipe.client.options import TrainOptions
from zpipe.client.runs.async_repartition import looked_epoch
from zpipe.client.runs.fit import training_request
from zpipe.client.runs.training_attempts import (
    AttemptReady,
    AttemptStarted,
    FeedAt,
    Looked,
    RepartitionLook,
    SendMiniBatch,
    TrainingAttempts,
)
from zpipe.client.runs.training_events import SpeedNoticed
from zpipe.models import ModelSpec
from zpipe.planner.async_schedule import ASYNC_SCHEDULE
from zpipe.planner.training_plan import TrainingPlan, TrainStage

SPEC = ModelSpec("mlp", {"dims": [4, 8, 2]}, seed=0)


def _plan() -> TrainingPlan:
    stages = tuple(
        TrainStage(devices=(d,), start=i, end=i + 1, shares=(1,), warmup=2 - i)
        for i, d in enumerate(["a", "b"])
    )
    return TrainingPlan(
        algo="even",
        schedule=ASYNC_SCHEDULE,
        num_units=2,
        microbatch_size=1,
        num_microbatches=1,
        stages=stages,
    )


def _started(**repartition: Any) -> TrainingAttempts:
    options = TrainOptions(
        optimizer={"name": "sgd", "lr": 0.1},
        num_microbatches=1,
        schedule=ASYNC_SCHEDULE,
        repartition=repartition,
    )
    request = training_request(SPEC, options, 4, "tcp://127.0.0.1:9")
    attempts = TrainingAttempts(request, options, ReplayBuffer())
    attempts.start()
    attempts.handle(AttemptReady())
    attempts.handle(AttemptStarted(_plan(), now=0.0))
    return attempts


def _feed(attempts: TrainingAttempts, steps: range) -> list[int]:
    """Feed ``steps``; the ones that looked first (each look keeps the cuts)."""
    looked = []
    for step in steps:
        commands = attempts.handle(FeedAt(step))
        if commands == [RepartitionLook(step)]:
            looked.append(step)
            commands = attempts.handle(Looked(step, moved=False, plan_epoch=attempts.plan_epoch))
        assert commands == [SendMiniBatch(step)]
    return looked


def test_a_speed_notice_makes_the_next_fed_minibatch_a_look_once() -> None:
    attempts = _started(first=2, every=100, forward_watch=2.0)
    assert _feed(attempts, range(0, 5)) == [2]
    # two stages' verdicts before the next mini-batch: one look answers both
    assert attempts.handle(SpeedNoticed("b", 0, 10.0)) == []
    attempts.handle(SpeedNoticed("a", 0, 9.5))
    assert _feed(attempts, range(5, 9)) == [5]  # not 102, the next scheduled look


def test_a_notice_about_cuts_moved_since_is_dropped() -> None:
    attempts = _started(first=2, every=100, forward_watch=2.0)
    assert _feed(attempts, range(0, 2)) == []
    assert attempts.handle(FeedAt(2)) == [RepartitionLook(2)]
    attempts.handle(Looked(2, moved=True, period_s=0.1, plan_epoch=1))
    # measured on the cuts of epoch 0, before the move: says nothing about epoch 1's
    attempts.handle(SpeedNoticed("b", 0, 10.0))
    assert _feed(attempts, range(3, 8)) == []
    attempts.handle(SpeedNoticed("b", 1, 10.0))  # about the cuts it runs now
    assert _feed(attempts, range(8, 10)) == [8]


def test_a_notice_is_ignored_without_a_forward_watch() -> None:
    attempts = _started(first=2, every=100)  # scheduled looks only
    attempts.handle(SpeedNoticed("b", 0, 10.0))
    assert _feed(attempts, range(0, 8)) == [2]


def test_a_new_attempt_forgets_a_notice_of_the_last() -> None:
    attempts = _started(first=2, every=100, forward_watch=2.0)
    assert _feed(attempts, range(0, 4)) == [2]
    attempts.handle(SpeedNoticed("b", 0, 10.0))
    attempts.handle(AttemptStarted(_plan(), now=1.0))  # a recovery's attempt, say
    assert _feed(attempts, range(4, 8)) == []


def test_the_epoch_after_a_look_is_the_newest_looks() -> None:
    assert looked_epoch([]) is None
    assert looked_epoch([{"plan_epoch": 1}, {"plan_epoch": 2}]) == 2
    assert looked_epoch([{"plan_epoch": None}]) is None
    assert looked_epoch([{"plan_epoch": True}]) is None
