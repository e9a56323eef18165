"""The client's training attempts as a pure controller: events in, commands out, no sockets.

:class:`TrainingAttempts` decides what goes from one attempt of a fit to the next
(recovery from a dead stage, a move to a better-balanced plan, a rewind to an
older global copy) and when the feed looks or keeps a replica; :class:`StepLedger`
decides which loss answers which mini-batch. The properties at the end drive a whole
simulated fit through random failures, re-plans, refused replicas and rebalances.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zpipe._errors import PipelineError, ProtocolError, StageFailedError
from zpipe.client.batches import ReplayBuffer
from zpipe.client.options import TrainOptions
from zpipe.client.reports import TrainReport
from zpipe.client.runs.async_repartition import predicted_period
from zpipe.client.runs.fit import training_request
from zpipe.client.runs.training_attempts import (
    Acknowledged,
    AttemptEnded,
    AttemptReady,
    AttemptStarted,
    EndAttempt,
    FailFit,
    FeedAt,
    FinishFit,
    KeepReplica,
    Looked,
    RepartitionLook,
    ReplicaKept,
    ReplicaRefused,
    RequestRun,
    SendMiniBatch,
    StartAttempt,
    StepLedger,
    TrainingAttempts,
)
from zpipe.models import ModelSpec
from zpipe.planner.async_schedule import ASYNC_SCHEDULE
from zpipe.planner.training_plan import TrainingPlan, TrainStage

SGD = {"name": "sgd", "lr": 0.1}
SPEC = ModelSpec("mlp", {"dims": [4, 8, 2]}, seed=0)


def _plan(
    names: list[str], *, last_group: int = 1, m: int = 1, schedule: str = "1f1b"
) -> TrainingPlan:
    """One device per stage, the last ``last_group`` devices together in the last one."""
    last_group = min(last_group, len(names))
    groups = [(n,) for n in names[: len(names) - last_group]]
    groups.append(tuple(names[len(names) - last_group :]))
    stages = tuple(
        TrainStage(
            devices=g,
            start=i,
            end=i + 1,
            shares=(last_group,) if len(g) == 1 else (1,) * len(g),
            warmup=len(groups) - i if schedule == ASYNC_SCHEDULE else 1,
        )
        for i, g in enumerate(groups)
    )
    return TrainingPlan(
        algo="even",
        schedule=schedule,
        num_units=len(stages),
        microbatch_size=last_group,
        num_microbatches=m,
        stages=stages,
    )


def _attempts(replay: ReplayBuffer[Any] | None = None, **options: Any) -> TrainingAttempts:
    settings = TrainOptions(optimizer=SGD, **{"num_microbatches": 1, **options})
    request = training_request(SPEC, settings, 4, "tcp://127.0.0.1:9")
    return TrainingAttempts(request, settings, replay if replay is not None else ReplayBuffer())


def _report(run: int, tplan: TrainingPlan, losses: list[float], samples: int = 0) -> TrainReport:
    return TrainReport(
        run=run,
        plan=None,  # type: ignore[arg-type]  (the controller never reads the plan)
        model_spec=SPEC,
        schedule=tplan.schedule,
        num_microbatches=tplan.num_microbatches,
        training_plan=tplan,
        losses=list(losses),
        samples=samples,
    )


# ---------------------------------------------------------------------------- the ledger


def test_a_mini_batch_is_done_when_every_part_and_device_answered_once() -> None:
    ledger = StepLedger(2, ["c", "d"])
    assert ledger.send() == 0 and ledger.send() == 1
    assert ledger.answer(0, 0, "c", 1.0) == []
    assert ledger.answer(0, 0, "d", 2.0) == []
    with pytest.raises(ProtocolError, match="second loss"):
        ledger.answer(0, 0, "d", 2.0)  # a duplicate counts nowhere
    with pytest.raises(ProtocolError, match="not a last-stage device"):
        ledger.answer(0, 1, "x", 1.0)
    assert ledger.answer(0, 1, "c", 3.0) == []
    assert ledger.answer(0, 1, "d", 4.0) == [(0, 10.0)]
    assert (ledger.done, ledger.in_flight) == (1, 1)
    with pytest.raises(ProtocolError, match="not in flight"):
        ledger.answer(0, 0, "c", 1.0)
    with pytest.raises(ProtocolError, match="not in flight"):
        ledger.answer(2, 4, "c", 1.0)


def test_mini_batches_are_released_in_order_whatever_order_they_complete_in() -> None:
    ledger = StepLedger(1, ["c"])
    ledger.send(), ledger.send()
    assert ledger.answer(1, 1, "c", 5.0) == []  # complete, but 0 is not yet
    with pytest.raises(ProtocolError, match="not in flight"):
        ledger.answer(1, 1, "c", 5.0)
    assert ledger.answer(0, 0, "c", 4.0) == [(0, 4.0), (1, 5.0)]


# ---------------------------------------------------------------------------- the feed


def test_replicas_come_before_the_first_and_every_nth_mini_batch() -> None:
    attempts = _attempts(recover=True, replicate_every=2)
    attempts.start()
    attempts.handle(AttemptReady())
    assert attempts.handle(FeedAt(0)) == [KeepReplica(0, global_copy=False)]
    assert attempts.handle(ReplicaKept(0, run=1, run_step=0)) == [SendMiniBatch(0)]
    assert attempts.handle(FeedAt(1)) == [SendMiniBatch(1)]
    assert attempts.handle(FeedAt(2)) == [KeepReplica(2, global_copy=False)]
    assert attempts.handle(ReplicaRefused(2)) == [SendMiniBatch(2)]
    assert attempts.replay.replicas == [0]  # the refused one is not kept


def test_without_recovery_the_feed_only_sends() -> None:
    attempts = _attempts()
    assert not attempts.recovers
    assert [attempts.handle(FeedAt(s)) for s in range(3)] == [[SendMiniBatch(s)] for s in range(3)]


def test_a_resumed_attempt_does_not_replicate_again_where_it_resumed() -> None:
    replay: ReplayBuffer[int] = ReplayBuffer()
    attempts = _attempts(replay, recover=True, replicate_every=2)
    replay.replicated(2, 1, 2)
    assert attempts.handle(FeedAt(2)) == [SendMiniBatch(2)]
    assert attempts.handle(FeedAt(4)) == [KeepReplica(4, global_copy=False)]


def test_a_look_that_moved_units_is_followed_by_a_replica() -> None:
    attempts = _attempts(
        schedule=ASYNC_SCHEDULE,
        recover=True,
        replicate_every=10,
        repartition={"first": 3, "every": 3},
    )
    assert attempts.handle(FeedAt(3)) == [RepartitionLook(3)]
    assert attempts.handle(Looked(3, moved=False)) == [SendMiniBatch(3)]
    assert attempts.handle(FeedAt(6)) == [RepartitionLook(6)]
    assert attempts.handle(Looked(6, moved=True)) == [KeepReplica(6, global_copy=False)]


def test_a_rebalance_at_a_replica_ends_the_attempt_and_the_next_runs_on_its_plan() -> None:
    attempts = _attempts(recover=True, replicate_every=2, rebalance=0.1)
    tplan = _plan(["a", "b"])
    better = _plan(["b", "a"])
    attempts.start()
    attempts.handle(AttemptReady())
    attempts.handle(AttemptStarted(tplan))
    attempts.handle(ReplicaKept(0, 1, 0))
    attempts.handle(ReplicaKept(2, 1, 2, rebalance=better))
    (command,) = attempts.handle(
        AttemptEnded(_report(1, tplan, [1.0, 2.0]), started=5.0, rebalance_to=better)
    )
    assert isinstance(command, RequestRun) and command.offset == 2
    assert command.request.stage_names == ["b", "a"]
    assert command.request.resume == {"run": 1, "step": 2, "dead": []}
    assert (command.request.train or {})["plan"] == better.to_dict()
    assert attempts.carried.rebalances == [{"at": 2, "plan": better.to_dict()}]
    assert attempts.handle(AttemptReady()) == [
        StartAttempt("1f1b", 1, offset=2, replicate_every=2, global_every=None)
    ]


# ---------------------------------------------------------------------------- recovery


def test_a_death_resumes_from_the_replica_over_the_survivors() -> None:
    replay: ReplayBuffer[int] = ReplayBuffer()
    attempts = _attempts(replay, recover=True, replicate_every=2, start_step=10)
    tplan = _plan(["a", "b", "c"])
    attempts.start()
    attempts.handle(AttemptReady())
    attempts.handle(AttemptStarted(tplan, now=1.0))
    for step in range(3):
        replay.keep(step)
    attempts.handle(ReplicaKept(0, 4, 0))
    attempts.handle(ReplicaKept(2, 4, 2))
    failure = StageFailedError("b", "no heartbeat")
    ended = AttemptEnded(_report(4, tplan, [1.0, 2.0], samples=3), 0.5, failure=failure, now=7.0)
    (command,) = attempts.handle(ended)
    assert isinstance(command, RequestRun) and command.offset == 2
    request = command.request
    assert request.stage_names == ["a", "c"]
    assert request.resume == {"run": 4, "step": 2, "dead": ["b"], "consistency": "exact"}
    # the learning-rate schedule goes on from the replica's mini-batch
    assert (request.train or {})["start_step"] == 12
    assert command.recovery is not None and command.recovery["replayed"] == 1
    assert attempts.carried.done == [1.0, 2.0]
    attempts.handle(AttemptReady())
    attempts.handle(AttemptStarted(_plan(["a", "c"]), now=9.5))
    assert attempts.carried.recoveries[-1]["restart_s"] == 2.5
    assert attempts.carried.recoveries[-1]["bounds"] == [0, 1, 2]


def test_fast_consistency_keeps_every_completed_mini_batch() -> None:
    replay: ReplayBuffer[int] = ReplayBuffer()
    attempts = _attempts(replay, recover=True, replicate_every=10, consistency="fast")
    tplan = _plan(["a", "b"])
    attempts.start()
    attempts.handle(AttemptStarted(tplan))
    attempts.handle(ReplicaKept(0, 1, 0))
    for step in range(4):
        replay.keep(step)
    failure = StageFailedError("a", "gone")
    (command,) = attempts.handle(AttemptEnded(_report(1, tplan, [1.0, 2.0, 3.0]), 0.0, failure))
    assert isinstance(command, RequestRun) and command.offset == 3
    assert replay.kept == [3] and attempts.carried.done == [1.0, 2.0, 3.0]


def test_a_death_without_a_replica_or_survivors_fails_the_fit() -> None:
    attempts = _attempts()  # no recovery
    tplan = _plan(["a"])
    failure = StageFailedError("a", "gone")
    assert attempts.handle(AttemptEnded(_report(1, tplan, []), 0.0, failure)) == [FailFit(failure)]
    attempts = _attempts(recover=True)
    attempts.handle(ReplicaKept(0, 1, 0))
    assert attempts.handle(AttemptEnded(_report(1, tplan, []), 0.0, failure)) == [FailFit(failure)]


def test_an_older_global_copy_rewinds_the_fit_or_fails_it_when_unknown() -> None:
    replay: ReplayBuffer[int] = ReplayBuffer()
    attempts = _attempts(replay, recover=True, replication="chain", chain_every=2, global_every=4)
    tplan = _plan(["a", "b", "c"])
    attempts.start()
    attempts.handle(AttemptStarted(tplan))
    for step in range(5):
        replay.keep(step)
    attempts.handle(ReplicaKept(0, 1, 0, global_copy=True))
    attempts.handle(ReplicaKept(2, 1, 2))
    attempts.handle(ReplicaKept(4, 1, 4))
    failure = StageFailedError("c", "gone")
    (command,) = attempts.handle(AttemptEnded(_report(1, tplan, [1, 2, 3, 4.0]), 0.0, failure))
    assert isinstance(command, RequestRun)
    assert (command.request.resume or {})["global"] == {"run": 1, "step": 0, "start_step": 0}
    (start,) = attempts.handle(AttemptReady(resumed={"run": 1, "step": 0}))
    assert isinstance(start, StartAttempt) and start.offset == 0
    assert replay.kept == [0, 1, 2, 3, 4] and attempts.carried.done == []
    assert attempts.carried.recoveries[-1]["from_global"] is True
    (refused,) = attempts.handle(AttemptReady(resumed={"run": 9, "step": 2}))
    assert isinstance(refused, FailFit) and isinstance(refused.error, PipelineError)


# ---------------------------------------------------------------------------- whole fits


@dataclasses.dataclass
class _Fit:
    """What a simulated fit did."""

    attempts: int = 0
    completed_by: dict[int, int] = dataclasses.field(default_factory=dict)  # step -> attempt
    sent: int = 0
    error: BaseException | None = None
    report: TrainReport | None = None


@dataclasses.dataclass
class _Chaos:
    """How often the simulated cluster misbehaves."""

    failure: float = 0.0
    refuse: float = 0.0
    rebalance: float = 0.0
    look_moves: float = 0.0
    from_global: float = 0.0


class _Attempt:
    """One attempt against a simulated cluster, driven the way the shell drives it: the
    last devices answer each micro-batch once each, in random order, and die at random."""

    def __init__(
        self,
        rng: random.Random,
        fit: _Fit,
        attempts: TrainingAttempts,
        start: StartAttempt,
        tplan: TrainingPlan,
        chaos: _Chaos,
    ) -> None:
        self.rng, self.fit, self.attempts, self.start = rng, fit, attempts, start
        self.tplan, self.chaos = tplan, chaos
        self.run = fit.attempts
        self.last = tplan.stages[-1].devices
        self.ledger = StepLedger(start.num_microbatches, self.last)
        self.losses: list[float] = []
        self.answers: list[tuple[int, int, str]] = []  # answers the cluster still owes
        self.failure: StageFailedError | None = None
        self.rebalance_to: TrainingPlan | None = None

    def deliver(self, count: int) -> None:
        self.rng.shuffle(self.answers)
        for _ in range(min(count, len(self.answers))):
            step, mb, src = self.answers.pop()
            # the answers of a mini-batch sum to its number in the fit
            loss = (self.start.offset + step) / self.ledger.per_step
            completed = self.ledger.answer(step, mb, src, loss)
            for done, total in completed:
                self.losses.append(total)
                self.fit.completed_by[self.start.offset + done] = self.run
            if completed:  # as the shell does: what no recovery asks for again goes
                self.attempts.handle(Acknowledged(self.start.offset + self.ledger.done))
            if self.rng.random() < 0.1:  # a copy the network made: refused, counts nowhere
                with pytest.raises(ProtocolError):
                    self.ledger.answer(step, mb, src, 0.0)

    def die(self) -> StageFailedError:
        return StageFailedError(self.rng.choice(self.tplan.devices), "no heartbeat")

    def feed(self, replay: ReplayBuffer[int], pool: Iterator[int]) -> None:
        rng, chaos, ledger, attempts = self.rng, self.chaos, self.ledger, self.attempts
        m = self.start.num_microbatches
        batches = iter(list(replay.kept))  # as BatchSource.iterate: the kept ones first
        while True:
            batch = next(batches, None)
            if batch is None:
                batch = next(pool, None)
                if batch is None:
                    return
                replay.keep(batch)
            step = self.start.offset + ledger.sent
            assert batch == step, "the feed sends the mini-batch of its step"
            commands = attempts.handle(FeedAt(step))
            while commands:
                (cmd,) = commands
                if isinstance(cmd, RepartitionLook):
                    commands = attempts.handle(Looked(step, rng.random() < chaos.look_moves))
                elif isinstance(cmd, KeepReplica):
                    self.deliver(len(self.answers))  # the pipeline drains first
                    assert ledger.in_flight == 0
                    if rng.random() < chaos.refuse:
                        commands = attempts.handle(ReplicaRefused(step))
                        continue
                    better = None
                    if rng.random() < chaos.rebalance and attempts.options.rebalance:
                        devices = list(reversed(self.tplan.devices))
                        better = _plan(devices, last_group=len(self.last), m=m)
                    kept = ReplicaKept(step, self.run, ledger.done, cmd.global_copy, better)
                    commands = attempts.handle(kept)
                elif isinstance(cmd, EndAttempt):
                    self.rebalance_to = cmd.rebalance_to
                    return
                else:
                    assert cmd == SendMiniBatch(step)
                    local = ledger.send()
                    self.fit.sent += 1
                    self.answers += [(local, local * m + i, d) for i in range(m) for d in self.last]
                    commands = []
                    self.check_buffer(replay)
            if rng.random() < chaos.failure:
                self.failure = self.die()
                return
            self.deliver(rng.randrange(len(self.answers) + 1))

    def check_buffer(self, replay: ReplayBuffer[int]) -> None:
        """What the replay buffer holds just after a send: with fast consistency (or
        without recovery) none whose loss came back (the mini-batches in flight, and
        those of a recovery not yet sent again); with exact consistency every one
        since the replica (each one a recovery trains again)."""
        held = range(replay.kept_from, replay.kept_from + len(replay.kept))
        assert replay.kept == list(held)
        assert held.stop >= self.start.offset + self.ledger.sent
        if self.attempts.releases_acknowledged:
            assert held.start == self.start.offset + self.ledger.done
        else:
            assert held.start == replay.replica_step

    def end(self) -> AttemptEnded:
        if self.failure is None and self.rebalance_to is None:
            self.deliver(len(self.answers))
            if self.rng.random() < self.chaos.failure / 2:  # a death at the weights' gather
                self.failure = self.die()
        report = _report(self.run, self.tplan, self.losses, samples=self.ledger.sent)
        return AttemptEnded(report, float(self.run), self.failure, self.rebalance_to)


def _simulate(
    rng: random.Random,
    *,
    total: int,
    m: int,
    last_group: int,
    options: dict[str, Any],
    chaos: _Chaos,
) -> _Fit:
    """A whole fit of ``total`` mini-batches, to its report or its error."""
    replay: ReplayBuffer[int] = ReplayBuffer()
    attempts = _attempts(replay, num_microbatches=m, **options)
    pool = iter(range(total))  # the user's batches: mini-batch s is s
    fit = _Fit()
    command: Any = attempts.start()
    while True:
        assert isinstance(command, RequestRun)
        fit.attempts += 1
        assert fit.attempts < 200, "the fit never ends"
        resumed = None
        resume = command.request.resume or {}
        if "global" in resume and rng.random() < chaos.from_global:
            resumed = {"run": resume["global"]["run"], "step": resume["global"]["step"]}
        (start,) = attempts.handle(AttemptReady(resumed=resumed))
        assert isinstance(start, StartAttempt)
        devices = list(command.request.stage_names or ["a", "b", "c", "d", "e"])
        tplan = _plan(devices, last_group=last_group, m=m, schedule=start.schedule)
        attempts.handle(AttemptStarted(tplan))
        attempt = _Attempt(rng, fit, attempts, start, tplan, chaos)
        attempt.feed(replay, pool)
        ended = attempt.end()
        (command,) = attempts.handle(ended)
        if isinstance(command, FailFit):
            fit.error = command.error
            return fit
        if isinstance(command, FinishFit):
            fit.report = attempts.complete(ended.report)
            return fit


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    total=st.integers(0, 24),
    m=st.integers(1, 3),
    last_group=st.integers(1, 2),
    every=st.integers(1, 5),
    consistency=st.sampled_from(["exact", "fast"]),
    replication=st.sampled_from(["global", "chain"]),
    global_every=st.integers(1, 6),
    failure_rate=st.sampled_from([0.0, 0.05, 0.2]),
    refuse_rate=st.sampled_from([0.0, 0.3]),
    rebalance_rate=st.sampled_from([0.0, 0.3]),
)
def test_every_mini_batch_is_answered_once_whatever_dies_or_moves(
    seed: int,
    total: int,
    m: int,
    last_group: int,
    every: int,
    consistency: str,
    replication: str,
    global_every: int,
    failure_rate: float,
    refuse_rate: float,
    rebalance_rate: float,
) -> None:
    options: dict[str, Any] = {"recover": True, "consistency": consistency}
    if replication == "chain":
        options.update(replication="chain", chain_every=every, global_every=global_every)
    else:
        options.update(replicate_every=every, rebalance=0.1)
    fit = _simulate(
        random.Random(seed),
        total=total,
        m=m,
        last_group=last_group,
        options=options,
        chaos=_Chaos(failure_rate, refuse_rate, rebalance_rate, from_global=0.5),
    )
    if fit.error is not None:
        # only a death the fit cannot recover from: no replica kept yet, or none survive
        assert isinstance(fit.error, StageFailedError)
        return
    report = fit.report
    assert report is not None
    # one loss per mini-batch of the fit, none lost or counted twice: each the sum of
    # the answers of every part from every last device, from the attempt that last
    # completed it
    assert report.steps == total
    assert sorted(fit.completed_by) == list(range(total))
    assert report.losses == pytest.approx(list(range(total)))
    # samples count every mini-batch sent, replays included
    assert report.samples == fit.sent >= total


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    total=st.integers(0, 30),
    every=st.integers(1, 6),
    first=st.integers(1, 5),
    look_every=st.integers(1, 5),
    failure_rate=st.sampled_from([0.0, 0.1]),
    look_move_rate=st.sampled_from([0.0, 0.5]),
)
def test_an_asynchronous_fit_with_looks_and_deaths_trains_each_mini_batch_once(
    seed: int,
    total: int,
    every: int,
    first: int,
    look_every: int,
    failure_rate: float,
    look_move_rate: float,
) -> None:
    options: dict[str, Any] = {
        "schedule": ASYNC_SCHEDULE,
        "recover": True,
        "replicate_every": every,
        "repartition": {"first": first, "every": look_every},
    }
    fit = _simulate(
        random.Random(seed),
        total=total,
        m=1,
        last_group=1,
        options=options,
        chaos=_Chaos(failure=failure_rate, look_moves=look_move_rate),
    )
    if fit.error is not None:
        assert isinstance(fit.error, StageFailedError)
        return
    assert fit.report is not None
    assert fit.report.losses == pytest.approx(list(range(total)))
    assert sorted(fit.completed_by) == list(range(total))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    total=st.integers(0, 30),
    failure_rate=st.sampled_from([0.0, 0.1, 0.3]),
)
def test_a_fast_fit_from_live_copies_holds_only_the_mini_batches_in_flight(
    seed: int, total: int, failure_rate: float
) -> None:
    # FTPipeHD's recovery (no flush replica): every resume point finds its mini-batch
    # in the buffer (the feed asserts it sends the mini-batch of its step), and the
    # buffer never holds an acknowledged one (_Attempt.check_buffer)
    options: dict[str, Any] = {
        "schedule": ASYNC_SCHEDULE,
        "recover": True,
        "live_copies": True,
        "consistency": "fast",
    }
    fit = _simulate(
        random.Random(seed),
        total=total,
        m=1,
        last_group=1,
        options=options,
        chaos=_Chaos(failure=failure_rate),
    )
    if fit.error is not None:  # every stage died
        assert isinstance(fit.error, StageFailedError)
        return
    assert fit.report is not None
    assert fit.report.losses == pytest.approx(list(range(total)))
    assert sorted(fit.completed_by) == list(range(total))


def test_a_watched_run_looks_early_when_its_losses_slow_down() -> None:
    attempts = _attempts(
        schedule=ASYNC_SCHEDULE, repartition={"first": 2, "every": 8, "watch": 2.0}
    )
    attempts.start()
    attempts.handle(AttemptReady())
    attempts.handle(AttemptStarted(_plan(["a", "b"], schedule=ASYNC_SCHEDULE), now=0.0))
    t = 0.0
    for step in range(2, 14):  # the looks before 2 and 10, at 0.1 s per mini-batch
        if step in (2, 10):
            assert attempts.handle(FeedAt(step)) == [RepartitionLook(step)]
            attempts.handle(Looked(step, moved=False))
        else:
            assert attempts.handle(FeedAt(step)) == [SendMiniBatch(step)]
        t += 0.1
        attempts.handle(Acknowledged(step + 1, now=t))
    # a device slows after the look before 10: two losses at 0.5 s each (of the last
    # three gaps, the median is slow)
    for step in (14, 15):
        assert attempts.handle(FeedAt(step)) == [SendMiniBatch(step)]
        t += 0.5
        attempts.handle(Acknowledged(step + 1, now=t))
    assert attempts.handle(FeedAt(16)) == [RepartitionLook(16)]  # not 18, the next scheduled


def test_an_unwatched_run_looks_on_schedule_only() -> None:
    attempts = _attempts(schedule=ASYNC_SCHEDULE, repartition={"first": 2, "every": 100})
    attempts.start()
    attempts.handle(AttemptReady())
    attempts.handle(AttemptStarted(_plan(["a", "b"], schedule=ASYNC_SCHEDULE), now=0.0))
    assert attempts.handle(FeedAt(2)) == [RepartitionLook(2)]
    attempts.handle(Looked(2, moved=False))
    t = 0.0
    for step in range(3, 20):  # 0.1 s per mini-batch, then 1 s: a device slowed 10x
        t += 0.1 if step < 10 else 1.0
        attempts.handle(Acknowledged(step, now=t))
        assert attempts.handle(FeedAt(step)) == [SendMiniBatch(step)]


def test_the_losses_before_the_first_look_are_the_baseline_after_it() -> None:
    attempts = _attempts(
        schedule=ASYNC_SCHEDULE, repartition={"first": 6, "every": 20, "watch": 2.0}
    )
    attempts.start()
    attempts.handle(AttemptReady())
    attempts.handle(AttemptStarted(_plan(["a", "b"], schedule=ASYNC_SCHEDULE), now=0.0))
    t = 0.0
    for step in range(6):  # 0.1 s per mini-batch before the first look
        assert attempts.handle(FeedAt(step)) == [SendMiniBatch(step)]
        t += 0.1
        attempts.handle(Acknowledged(step + 1, now=t))
    assert attempts.handle(FeedAt(6)) == [RepartitionLook(6)]
    # the move lands on a device that slowed: 0.6 s per mini-batch
    assert attempts.handle(Looked(6, moved=True)) == [SendMiniBatch(6)]
    t += 0.1
    attempts.handle(Acknowledged(7, now=t))
    for step in range(7, 10):
        assert attempts.handle(FeedAt(step)) == [SendMiniBatch(step)]
        t += 0.6
        attempts.handle(Acknowledged(step + 1, now=t))
    assert attempts.handle(FeedAt(10)) == [RepartitionLook(10)]  # not 26, the second scheduled


def test_a_move_makes_the_period_it_predicted_the_loss_watchs_baseline() -> None:
    # the even cuts ran at 0.5 s; the first move predicted 0.12 s; the device then
    # slowed to 0.95 s, under twice the old cuts' period (bench r24_middle)
    attempts = _attempts(
        schedule=ASYNC_SCHEDULE, repartition={"first": 6, "every": 20, "watch": 2.0}
    )
    attempts.start()
    attempts.handle(AttemptReady())
    attempts.handle(AttemptStarted(_plan(["a", "b"], schedule=ASYNC_SCHEDULE), now=0.0))
    t = 0.0
    for step in range(6):
        assert attempts.handle(FeedAt(step)) == [SendMiniBatch(step)]
        t += 0.5
        attempts.handle(Acknowledged(step + 1, now=t))
    assert attempts.handle(FeedAt(6)) == [RepartitionLook(6)]
    assert attempts.handle(Looked(6, moved=True, period_s=0.12)) == [SendMiniBatch(6)]
    for step, gap in zip(range(7, 11), [1.5, 0.1, 0.1, 0.1], strict=True):
        t += gap
        attempts.handle(Acknowledged(step, now=t))
        assert attempts.handle(FeedAt(step)) == [SendMiniBatch(step)]
    for step in (11, 12):
        t += 0.95
        attempts.handle(Acknowledged(step, now=t))
    assert attempts.handle(FeedAt(12)) == [RepartitionLook(12)]  # not 26, the next scheduled


def test_the_predicted_period_is_the_newest_moving_looks() -> None:
    assert predicted_period([]) is None
    assert predicted_period([{"moved": False, "new_period_s": 0.1}]) is None
    assert predicted_period([{"moved": True, "new_period_s": 0.12}]) == 0.12
    assert predicted_period([{"moved": True}]) is None  # an older coordinator's look
    assert predicted_period([{"moved": True, "new_period_s": True}]) is None
