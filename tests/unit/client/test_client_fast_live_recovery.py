"""The client's side of an asynchronous run's fast recovery (live copies, FTPipeHD): no
flush replica is ever kept, a death resumes at the first un-acknowledged mini-batch
of the broken run, and the coordinator's plan summary becomes the report's
``progress_lost`` and ``unit_sources``. A mini-batch whose loss came back is let go of
at once (no fast recovery trains it again), so a long run fed from a generator holds
only the mini-batches in flight; exact consistency keeps those since the replica.
Pure: events in, commands out."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from zpipe._errors import ConfigError, StageFailedError
from zpipe.client.batches import BatchSource, ReplayBuffer
from zpipe.client.options import TrainOptions
from zpipe.client.reports import TrainReport
from zpipe.client.runs.fit import training_request
from zpipe.client.runs.training_attempts import (
    Acknowledged,
    AttemptEnded,
    AttemptReady,
    AttemptStarted,
    FailFit,
    FeedAt,
    KeepReplica,
    ReplicaKept,
    RequestRun,
    SendMiniBatch,
    StartAttempt,
    TrainingAttempts,
)
from zpipe.models import ModelSpec
from zpipe.planner.training_plan import TrainingPlan, TrainStage

SGD = {"name": "sgd", "lr": 0.1}
SPEC = ModelSpec("mlp", {"dims": [4, 8, 8, 2]}, seed=0)
FAST = {"schedule": "async-1f1b", "recover": True, "live_copies": True, "consistency": "fast"}


def _plan(names: list[str]) -> TrainingPlan:
    n = len(names)
    stages = tuple(TrainStage((d,), i, i + 1, (1,), n - i) for i, d in enumerate(names))
    return TrainingPlan(algo="even", schedule="async-1f1b", num_units=n, microbatch_size=1,
                        num_microbatches=1, stages=stages)  # fmt: skip


def _report(run: int, tplan: TrainingPlan, losses: list[float]) -> TrainReport:
    return TrainReport(run=run, plan=None, model_spec=SPEC, schedule=tplan.schedule,  # type: ignore[arg-type]
                       num_microbatches=1, training_plan=tplan, losses=list(losses))  # fmt: skip


def _attempts(replay: ReplayBuffer[Any], **options: Any) -> TrainingAttempts:
    settings = TrainOptions(optimizer=SGD, num_microbatches=1, **options)
    request = training_request(SPEC, settings, 4, "tcp://127.0.0.1:9")
    return TrainingAttempts(request, settings, replay)


def test_fast_consistency_needs_the_live_copies_and_then_keeps_no_flush_replica() -> None:
    with pytest.raises(ConfigError, match="live_copies"):
        TrainOptions(optimizer=SGD, num_microbatches=1, schedule="async-1f1b", recover=True,
                     consistency="fast")  # fmt: skip
    options = TrainOptions(optimizer=SGD, num_microbatches=1, **FAST)  # type: ignore[arg-type]
    assert options.fast_live_recovery and options.replica_period is None
    exact = TrainOptions(optimizer=SGD, num_microbatches=1, **{**FAST, "consistency": "exact"})  # type: ignore[arg-type]
    assert not exact.fast_live_recovery and exact.replica_period is not None


def test_a_death_resumes_at_the_first_unacknowledged_mini_batch_and_reports_the_loss() -> None:
    replay: ReplayBuffer[int] = ReplayBuffer()
    attempts = _attempts(replay, **FAST)
    assert attempts.recovers
    tplan = _plan(["a", "b", "c"])
    attempts.start()
    attempts.handle(AttemptStarted(tplan))
    for step in range(8):
        assert attempts.handle(FeedAt(step)) == [SendMiniBatch(step)]  # never a flush
        replay.keep(step)
    failure = StageFailedError("b", "gone")
    losses = [float(i) for i in range(6)]  # 6 and 7 were in flight
    (command,) = attempts.handle(AttemptEnded(_report(4, tplan, losses), 0.0, failure))
    assert isinstance(command, RequestRun) and command.offset == 6
    resume = command.request.resume or {}
    assert resume["run"] == 4 and resume["step"] == 6 and resume["dead"] == ["b"]
    assert resume["consistency"] == "fast" and resume["live"] is True
    # the fit's first run: copies of runs before it are another fit's
    assert resume["since_run"] == 4
    assert (command.request.train or {})["async"]["depth"] == 3
    assert replay.kept == [6, 7]  # only what was in flight goes again
    fast = {
        "resume_at": 6, "max_lost": 2, "lost": {"1": 2},
        "copies_used": {"chain@c": [1]},
        "eq5": {"capacities": {"a": 1.0, "c": 2.5}, "links_mbit_s": None},
        "sources": [
            {"unit": 0, "kind": "kept", "source": "a"},
            {"unit": 1, "kind": "chain", "source": "c"},
            {"unit": 2, "kind": "kept", "source": "c"},
        ],
    }  # fmt: skip
    (start,) = attempts.handle(AttemptReady(fast_recovery=fast))
    assert isinstance(start, StartAttempt) and start.offset == 6
    assert start.replicate_every is None
    recovery = attempts.carried.recoveries[-1]
    assert recovery["progress_lost"] == 2 and recovery["resumed_at"] == 6
    assert recovery["unit_sources"] == {0: "kept", 1: "chain@c", 2: "kept"}
    assert recovery["eq5"]["capacities"] == {"a": 1.0, "c": 2.5}
    report = attempts.complete(_report(5, _plan(["a", "c"]), [6.0, 7.0]))
    assert report.losses == [float(i) for i in range(8)]
    assert report.progress_lost == 2
    assert report.unit_sources == {0: "kept", 1: "chain@c", 2: "kept"}


def test_a_resume_elsewhere_than_the_client_fails_the_fit() -> None:
    replay: ReplayBuffer[int] = ReplayBuffer()
    attempts = _attempts(replay, **FAST)
    tplan = _plan(["a", "b"])
    attempts.start()
    attempts.handle(AttemptStarted(tplan))
    failure = StageFailedError("b", "gone")
    attempts.handle(AttemptEnded(_report(1, tplan, [1.0, 2.0]), 0.0, failure))
    (failed,) = attempts.handle(AttemptReady(fast_recovery={"resume_at": 1}))
    assert isinstance(failed, FailFit) and "resumed at mini-batch 1" in str(failed.error)


def test_acknowledged_mini_batches_leave_the_buffer_and_the_resume_point_finds_the_rest() -> None:
    replay: ReplayBuffer[int] = ReplayBuffer()
    attempts = _attempts(replay, **FAST)
    assert attempts.releases_acknowledged
    tplan = _plan(["a", "b", "c"])
    attempts.start()
    attempts.handle(AttemptStarted(tplan))
    for step in range(8):
        replay.keep(step)
        attempts.handle(FeedAt(step))
        if step >= 2:  # three in flight, then one loss back per mini-batch sent
            assert attempts.handle(Acknowledged(step - 1)) == []
            assert replay.kept == list(range(step - 1, step + 1))
    assert replay.kept == [6, 7] and replay.kept_from == 6
    attempts.handle(Acknowledged(5))  # a late word changes nothing
    assert replay.kept == [6, 7] and replay.kept_from == 6
    failure = StageFailedError("b", "gone")
    losses = [float(i) for i in range(6)]
    (command,) = attempts.handle(AttemptEnded(_report(4, tplan, losses), 0.0, failure))
    assert isinstance(command, RequestRun) and command.offset == 6
    assert (command.request.resume or {})["step"] == 6  # the first un-acknowledged one
    assert replay.kept == [6, 7]  # every mini-batch the resume point trains is held
    assert attempts.carried.recoveries[-1]["replayed"] == 2


def test_exact_consistency_keeps_every_mini_batch_since_the_replica() -> None:
    replay: ReplayBuffer[int] = ReplayBuffer()
    exact = {**FAST, "consistency": "exact", "replicate_every": 4}
    attempts = _attempts(replay, **exact)
    assert not attempts.releases_acknowledged
    tplan = _plan(["a", "b", "c"])
    attempts.start()
    attempts.handle(AttemptStarted(tplan))
    for step in range(7):
        replay.keep(step)
        (command,) = attempts.handle(FeedAt(step))
        if isinstance(command, KeepReplica):  # before 0 and 4, after the pipeline drained
            attempts.handle(ReplicaKept(step, 4, step))
        attempts.handle(Acknowledged(step))  # every loss before this one is back
    assert replay.replicas == [0, 4]
    assert replay.kept == [4, 5, 6]  # acknowledged, but a rollback trains 4 and 5 again
    failure = StageFailedError("b", "gone")
    losses = [float(i) for i in range(6)]
    (command,) = attempts.handle(AttemptEnded(_report(4, tplan, losses), 0.0, failure))
    assert isinstance(command, RequestRun) and command.offset == 4
    assert (command.request.resume or {})["step"] == 4
    assert replay.kept == [4, 5, 6]


def test_a_generator_fed_fast_fit_holds_only_the_mini_batches_in_flight() -> None:
    window, total, dies_after = 3, 120, 70
    made: list[weakref.ref[torch.Tensor]] = []

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(total):
            inputs = torch.full((2, 4), float(i))
            made.append(weakref.ref(inputs))
            yield inputs, torch.zeros(2, dtype=torch.long)

    source = BatchSource(batches())
    attempts = _attempts(source, **FAST)
    tplan = _plan(["a", "b", "c"])
    trained: list[int] = []

    async def attempt(offset: int, stop: int | None) -> tuple[int, int, int]:
        """Feed as the shell does: at most ``window`` in flight, the oldest's loss back
        before the next goes; ``stop``: a death after that many are sent. (acknowledged,
        the most the buffer held, the most batches alive)"""
        sent = done = most = alive = 0
        async for batch in source.iterate():
            step = offset + sent
            assert int(batch[0][0, 0]) == step  # the feed sends the mini-batch of its step
            assert attempts.handle(FeedAt(step)) == [SendMiniBatch(step)]
            most = max(most, len(source.kept))
            alive = max(alive, sum(ref() is not None for ref in made))
            if sent - done == window:  # the window is full: the oldest loss comes back
                trained.append(offset + done)
                done += 1
                attempts.handle(Acknowledged(offset + done))
            sent += 1
            if sent == stop:
                break
        return done, most, alive

    attempts.start()
    attempts.handle(AttemptStarted(tplan))
    done, most, alive = asyncio.run(attempt(0, dies_after))
    # the window's mini-batches and the one the feed is about to send: on the
    # old code every mini-batch since the start stayed
    assert most == window + 1 and alive <= window + 1
    failure = StageFailedError("b", "gone")
    losses = [float(i) for i in range(done)]
    (command,) = attempts.handle(AttemptEnded(_report(4, tplan, losses), 0.0, failure))
    assert isinstance(command, RequestRun) and command.offset == done
    assert source.kept_from == done and len(source.kept) == dies_after - done
    (start,) = attempts.handle(AttemptReady(fast_recovery={"resume_at": done}))
    assert isinstance(start, StartAttempt)
    attempts.handle(AttemptStarted(_plan(["a", "c"])))
    after, most, alive = asyncio.run(attempt(done, None))
    assert most == window + 1 and alive <= window + 1
    # every mini-batch whose loss came back in the second attempt, none skipped
    assert trained == list(range(done + after))
