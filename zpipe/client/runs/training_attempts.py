"""The decisions of a fit's training attempts, as a pure controller: events in, commands out.

A fit (:func:`zpipe.client.fit`) is a sequence of attempts: the first, one after
each recovery from a dead stage, one after each move to a better-balanced plan.
:class:`TrainingAttempts` decides what goes from one attempt to the next (the run
request, the mini-batch to resume from, what to replay, the losses that stand) and,
within an attempt, when the feed looks for a re-partition or has a replica kept.
:class:`StepLedger` counts one attempt's losses: which mini-batch each answers, and
when a mini-batch is complete. Neither touches a socket, a clock or a task: the
shell (:mod:`zpipe.client.runs.fit`, :mod:`zpipe.client.runs.sync_training`) does the I/O,
feeds what happened in as events, and carries out the commands::

    start()                            -> RequestRun(request, offset)
    AttemptReady(resumed, now)         -> StartAttempt(schedule, m, offset, ...) | FailFit
    AttemptStarted(training_plan, now) -> ()
    FeedAt(step)                       -> RepartitionLook | KeepReplica | SendMiniBatch
    Acknowledged(step, now)            -> ()
    Looked(step, moved, period_s)      -> KeepReplica | SendMiniBatch
    SpeedNoticed(stage, plan_epoch)    -> ()  (the next FeedAt looks)
    ReplicaKept(step, run, run_step)   -> SendMiniBatch | EndAttempt(rebalance_to)
    ReplicaRefused(step)               -> SendMiniBatch
    AttemptEnded(report, failure, ...) -> RequestRun(request, offset) | FinishFit | FailFit

The clock is an input (``now`` of an event), never read here. Where a decision
already has a pure function (:func:`zpipe.recovery.replicas_due`), it is called.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from zpipe._errors import PipelineError, ProtocolError, StageFailedError
from zpipe.client.batches import ReplayBuffer
from zpipe.client.options import TrainOptions
from zpipe.client.reports import TrainReport
from zpipe.client.runs.training_events import (
    Acknowledged,
    AttemptEnded,
    AttemptReady,
    AttemptStarted,
    Command,
    EndAttempt,
    Event,
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
    SpeedNoticed,
    StartAttempt,
)
from zpipe.planner.async_schedule import ASYNC_SCHEDULE
from zpipe.planner.training_plan import TrainingPlan
from zpipe.protocol.client_control import RunRequest
from zpipe.recovery import replicas_due
from zpipe.training.repartition_watch import SlowdownWatch

# ---------------------------------------------------------------------------- one attempt's losses


class StepLedger:
    """One attempt's mini-batches in flight and the losses that answer them.

    Each mini-batch is split into ``microbatches`` parts, and every device of the last
    stage answers every part with a loss (a share of no rows answers 0.0), so a
    mini-batch is complete with ``microbatches * len(last_devices)`` distinct answers.
    An answer for a mini-batch not in flight, from a device not in the last stage, or
    a second answer for the same (micro-batch, device) is refused: it counts nowhere.
    Mini-batches complete in order (the stages run their rounds one after another),
    and a complete one is released only after every one before it.
    """

    def __init__(self, microbatches: int, last_devices: Collection[str]) -> None:
        self.devices = frozenset(last_devices)
        self.per_step = microbatches * len(self.devices)
        self.sent = 0
        self.done = 0
        self._answers: dict[int, dict[tuple[int, str], float]] = {}
        self._complete: dict[int, float] = {}

    @property
    def in_flight(self) -> int:
        return self.sent - self.done

    def send(self) -> int:
        """The next mini-batch goes out: its number within the attempt."""
        step = self.sent
        self.sent += 1
        return step

    def check(self, step: int, mb: int, src: str) -> None:
        """:class:`ProtocolError` unless a loss for ``step`` from ``src`` is expected."""
        if src not in self.devices:
            raise ProtocolError(f"a loss from {src!r}, not a last-stage device")
        if not self.done <= step < self.sent or step in self._complete:
            raise ProtocolError(f"a loss for mini-batch {step}, which is not in flight")
        if (mb, src) in self._answers.get(step, {}):
            raise ProtocolError(f"a second loss for micro-batch {mb} from {src!r}")

    def answer(self, step: int, mb: int, src: str, loss: float) -> list[tuple[int, float]]:
        """Take one loss; the mini-batches it completes, in order, with their loss sums."""
        self.check(step, mb, src)
        answers = self._answers.setdefault(step, {})
        answers[(mb, src)] = loss
        if len(answers) < self.per_step:
            return []
        self._complete[step] = sum(self._answers.pop(step).values())
        done = []
        while self.done in self._complete:
            done.append((self.done, self._complete.pop(self.done)))
            self.done += 1
        return done


# ---------------------------------------------------------------------------- the whole fit


@dataclass
class _Carried:
    """What goes from one attempt to the next."""

    done: list[float] = field(default_factory=list)  # losses of the steps before this attempt
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    rebalances: list[dict[str, Any]] = field(default_factory=list)
    # the looks of live re-partitioning in attempts before this one, not replayed
    repartitions: list[dict[str, Any]] = field(default_factory=list)
    first_plan: TrainingPlan | None = None
    earlier_samples: int = 0  # of the attempts that ended early
    first_started: float | None = None
    first_run: int | None = None  # the fit's first run: its copies are of this fit


class TrainingAttempts:
    """The decisions of one fit across its attempts (see the module's table)."""

    def __init__(self, request: RunRequest, options: TrainOptions, replay: ReplayBuffer[Any]):
        self.request = request
        self.options = options
        self.replay = replay
        self.every = options.replica_period
        # FTPipeHD's fast recovery from live copies: no flush replica to resume from
        self.fast_live = options.fast_live_recovery
        self.global_every = options.global_period if self.every is not None else None
        self.plan = options.plan
        self.schedule, self.num_microbatches = options.schedule, options.num_microbatches
        self.carried = _Carried()
        # an early look when the losses slow down (RepartitionSettings.watch)
        self.watch: SlowdownWatch | None = None
        # a stage's speed verdict makes the next fed mini-batch a look, once
        # (RepartitionSettings.forward_watch); the cuts' epoch of the last look
        self.speed_due = False
        self.plan_epoch = 0
        self.offset = 0  # the current attempt's first mini-batch
        self.training_plan: TrainingPlan | None = None  # the current attempt's
        self.last_started = 0.0  # when the last attempt that ended began training

    @property
    def recovers(self) -> bool:
        """Whether a stage's death is recovered from (replicas are kept)."""
        return self.every is not None or self.fast_live

    @property
    def releases_acknowledged(self) -> bool:
        """Whether a mini-batch is let go of once its loss is back. A fast recovery
        (FTPipeHD's from live copies, or from a flush replica) resumes at the first
        mini-batch whose loss had not come back, and a run that does not recover
        never trains one again: no acknowledged mini-batch is asked for again. An
        exact recovery trains again every mini-batch since the replica (or since the
        global copy it falls back to): those stay until the next replica."""
        return not self.recovers or self.options.consistency == "fast"

    # -------------------------------------------------------------------- attempts

    def start(self) -> RequestRun:
        """The first attempt's request."""
        return self._request_run(None)

    def handle(self, event: Event) -> list[Command]:
        match event:
            case AttemptReady():
                return [self._ready(event)]
            case AttemptStarted():
                self._started(event)
                return []
            case FeedAt(step=step):
                if self._fresh(step) and self._look_due(step):
                    return [RepartitionLook(step)]
                return [self._replica_or_send(step, moved=False)]
            case Acknowledged(step=step, now=now):
                if self.watch is not None and now is not None:
                    self.watch.acknowledged(step, now)
                if self.releases_acknowledged:
                    # the buffer holds only the mini-batches in flight (and the one
                    # the feed holds): a long run fed from a generator stays bounded
                    self.replay.forget_before(step)
                return []
            case SpeedNoticed():
                self._speed_noticed(event)
                return []
            case Looked(step=step, moved=moved, period_s=period_s, plan_epoch=plan_epoch):
                if plan_epoch is not None:
                    self.plan_epoch = max(self.plan_epoch, plan_epoch)
                if moved and self.watch is not None:
                    # the interval before ran on the old cuts (repartition_watch)
                    self.watch.moved(period_s)
                return [self._replica_or_send(step, moved=moved)]
            case ReplicaKept():
                return [self._replica_kept(event)]
            case ReplicaRefused(step=step):
                return [SendMiniBatch(step)]
            case AttemptEnded():
                return [self._attempt_ended(event)]
        raise TypeError(f"not an event of a fit: {event!r}")

    def _request_run(self, recovery: dict[str, Any] | None) -> RequestRun:
        # the learning-rate schedule goes on from this attempt's first mini-batch
        # (an asynchronous run's replica carries its update count instead)
        start_step = self.options.start_step + self.replay.kept_from
        if start_step and self.schedule != ASYNC_SCHEDULE:
            train = {**(self.request.train or {}), "start_step": start_step}
            self.request = dataclasses.replace(self.request, train=train)
        self.offset = self.replay.kept_from
        return RequestRun(self.request, self.offset, recovery)

    def _ready(self, event: AttemptReady) -> StartAttempt | FailFit:
        if event.resumed is not None:
            try:
                self._rewind_to_global(event.resumed)
            except PipelineError as error:
                return FailFit(error)
        if event.fast_recovery is not None:
            try:
                self._fast_recovered(event.fast_recovery)
            except PipelineError as error:
                return FailFit(error)
        if self.plan is not None:
            self.schedule, self.num_microbatches = self.plan.schedule, self.plan.num_microbatches
        return StartAttempt(
            schedule=self.schedule,
            num_microbatches=self.num_microbatches,
            offset=self.offset,
            replicate_every=self.every,
            global_every=self.global_every,
        )

    def _started(self, event: AttemptStarted) -> None:
        tplan = self.training_plan = event.training_plan
        settings = self.options.repartition_settings
        # each attempt's pipeline is watched afresh (a recovery changes its stages)
        self.watch = SlowdownWatch(settings.watch) if settings and settings.watch else None
        self.speed_due, self.plan_epoch = False, 0  # a new run: its cuts count from 0
        if self.watch is not None:
            # the losses before the first look are its baseline: a move there that
            # lands on a device slowing meanwhile is seen before the second look
            self.watch.looked(self.offset)
        carried = self.carried
        carried.first_plan = carried.first_plan or tplan
        if carried.recoveries:
            last = carried.recoveries[-1]
            last["restart_s"] = event.now - last["noticed_at"]
            if tplan is not None and "bounds" not in last:
                # the survivors' cuts (zpipe.training.async_recovery.cuts_of_run)
                last["bounds"] = [*(st.start for st in tplan.stages), tplan.stages[-1].end]

    def _rewind_to_global(self, resumed: dict[str, Any]) -> None:
        """The coordinator resumed from the newest global copy, older than the replica
        asked for (some unit lost every chain copy): train again from there."""
        replay, carried = self.replay, self.carried
        known = replay.global_resume
        if known is None or [known[0], known[1]] != [resumed.get("run"), resumed.get("step")]:
            raise PipelineError(
                f"the coordinator resumed from replica {resumed}, which this client does "
                f"not hold the mini-batches since (its global copy: {known})"
            )
        replay.rewind_to_global()
        self.offset = replay.kept_from
        carried.done = carried.done[: replay.kept_from]
        carried.repartitions = [r for r in carried.repartitions if int(r["at"]) <= replay.kept_from]
        if carried.recoveries:
            carried.recoveries[-1].update(
                resumed_from=replay.kept_from,
                replica=replay.replica_step,
                replayed=len(replay.kept),
                from_global=True,
            )

    def _fast_recovered(self, fast: dict[str, Any]) -> None:
        """The coordinator recovered the run FTPipeHD's way: record what it lost and
        where each unit came from (the report's ``progress_lost``, ``unit_sources``)."""
        resumed_at = fast.get("resume_at")
        if resumed_at != self.offset or not self.carried.recoveries:
            raise PipelineError(
                f"the coordinator resumed at mini-batch {resumed_at}, this client at {self.offset}"
            )
        sources = {}
        for entry in fast.get("sources") or []:
            kind, source = str(entry.get("kind")), str(entry.get("source"))
            sources[int(entry["unit"])] = f"chain@{source}" if kind == "chain" else kind
        self.carried.recoveries[-1].update(
            resumed_at=resumed_at,
            progress_lost=int(fast.get("max_lost") or 0),
            lost_per_unit={int(u): int(n) for u, n in (fast.get("lost") or {}).items()},
            unit_sources=sources,
            copies_used=fast.get("copies_used") or {},
            # which capacities and links re-cut the survivors (eq. 5), from where
            eq5=fast.get("eq5") or {},
        )

    def _attempt_ended(self, event: AttemptEnded) -> RequestRun | FinishFit | FailFit:
        self.last_started = event.started
        if event.rebalance_to is not None:
            self._move_to(event, event.rebalance_to)
            return self._request_run(None)
        if event.failure is not None:
            try:
                recovery = self._recover_from(event, event.failure)
            except StageFailedError as error:
                return FailFit(error)
            return self._request_run(recovery)
        return FinishFit()

    def _move_to(self, event: AttemptEnded, plan: TrainingPlan) -> None:
        """Go on from the replica just kept, on the better-balanced ``plan``."""
        replay, carried = self.replay, self.carried
        carried.done = (carried.done + event.report.losses)[: replay.replica_step]
        self._count_attempt(event)
        carried.rebalances.append({"at": replay.replica_step, "plan": plan.to_dict()})
        assert replay.resume is not None  # the replica was just kept
        self.request = rebalance_request(self.request, plan, replay.resume)
        self.plan = plan

    def _recover_from(self, event: AttemptEnded, failure: StageFailedError) -> dict[str, Any]:
        """Resume from the replica over the survivors (the recovery's record), or raise
        ``failure``."""
        replay, options, carried = self.replay, self.options, self.carried
        if not self.fast_live and (self.every is None or replay.resume is None):
            raise failure
        tplan = event.report.training_plan
        assert tplan is not None
        dead = sorted({*(r["dead"] for r in carried.recoveries), failure.stage})
        survivors = [d for d in tplan.devices if d not in dead]
        if not survivors:
            raise failure
        losses = event.report.losses
        if options.consistency == "fast":
            # Every completed mini-batch stays: only those in flight go again.
            carried.done = carried.done + losses
            replay.forget_before(len(carried.done))
        else:
            # What the replica holds stays; what came after it is trained again.
            carried.done = (carried.done + losses)[: replay.replica_step]
        self._count_attempt(event)
        # the attempt's looks up to the replica the next attempt resumes from (those
        # after it are made again, on the mini-batches trained again)
        carried.repartitions += [
            r for r in event.report.repartitions if int(r["at"]) <= replay.kept_from
        ]
        recovery: dict[str, Any] = {
            "dead": failure.stage,
            "reason": failure.reason,
            "noticed_at": event.now,
            "resumed_from": replay.kept_from,
            "replica": replay.replica_step,
            "replayed": len(replay.kept),
            "policy": options.recovery,
            "consistency": options.consistency,
        }
        carried.recoveries.append(recovery)
        if self.fast_live:
            # resume at the first un-acknowledged mini-batch of the broken run, from
            # the survivors' weights and the dead's copies (no replica is named)
            resume_at = (event.report.run, len(carried.done))
        else:
            assert replay.resume is not None
            resume_at = replay.resume
        request = resume_request(
            self.request, survivors, dead, options.recovery, resume_at, options.consistency
        )
        if self.fast_live:
            # "since_run": copies of runs before this fit's first are another job's
            # (a coordinator keeps the newest copy of each stage across fits)
            live = {"live": True, "since_run": self.carried.first_run}
            request = dataclasses.replace(request, resume={**(request.resume or {}), **live})
        if self.schedule == ASYNC_SCHEDULE:
            request = _async_resume(request, depth=len(tplan.stages))
            recovery["depth"] = (request.train or {})["async"]["depth"]
        if options.consistency == "exact" and replay.global_resume is not None:
            # the older copy to resume from if some unit lost every chain copy; the
            # learning-rate schedule then goes on from its mini-batch
            resume = dict(request.resume or {})
            resume["global"] = {
                "run": replay.global_resume[0],
                "step": replay.global_resume[1],
                # (an asynchronous run's replica carries its update count instead)
                "start_step": 0
                if self.schedule == ASYNC_SCHEDULE
                else options.start_step + (replay.global_step or 0),
            }
            request = dataclasses.replace(request, resume=resume)
        self.request = request
        self.plan = None
        return recovery

    def _count_attempt(self, event: AttemptEnded) -> None:
        self.carried.earlier_samples += event.report.samples
        self.carried.first_started = self.carried.first_started or event.started
        if self.carried.first_run is None:
            self.carried.first_run = event.report.run

    # -------------------------------------------------------------------- the feed

    def _fresh(self, step: int) -> bool:
        # a look (and a replica) at the mini-batch this run resumed from was made
        # before the replica it resumed from (zpipe.training.async_recovery)
        return self.replay.resume is None or self.replay.replica_step != step

    def _look_due(self, step: int) -> bool:
        settings = self.options.repartition_settings
        if settings is None:
            return False
        due = settings.due(step) or self.speed_due or (self.watch is not None and self.watch.due())
        if due:
            self.speed_due = False  # this look answers the verdicts so far
            if self.watch is not None:
                self.watch.looked(step)
        return due

    def _speed_noticed(self, event: SpeedNoticed) -> None:
        """A stage's forwards changed speed for good: look before the next mini-batch,
        unless the verdict is about cuts a look has moved since (see SpeedNoticed)."""
        settings = self.options.repartition_settings
        if settings is None or not settings.forward_watch:
            return
        if event.plan_epoch < self.plan_epoch:
            return  # measured on units the stage no longer runs
        self.speed_due = True

    def _replica_or_send(self, step: int, *, moved: bool) -> KeepReplica | SendMiniBatch:
        # a replica before every ``replicate_every``-th mini-batch (and a global copy
        # before every ``global_every``-th), the first one included, unless this run
        # resumed from the one taken there; and after a look that moved units, so
        # that a recovery restores them on the cuts they moved to
        if self.every is None:
            return SendMiniBatch(step)
        chain, whole = replicas_due(step, chain_every=self.every, global_every=self.global_every)
        if (chain or whole or moved) and self._fresh(step):
            return KeepReplica(step, global_copy=whole)
        return SendMiniBatch(step)

    def _replica_kept(self, event: ReplicaKept) -> SendMiniBatch | EndAttempt:
        self.replay.replicated(
            event.step,
            event.run,
            event.run_step,
            global_copy=event.global_copy,
            keep=self.global_every is not None,
        )
        if event.rebalance is not None:
            return EndAttempt(event.rebalance)
        return SendMiniBatch(event.step)

    # -------------------------------------------------------------------- the end

    def complete(self, report: TrainReport) -> TrainReport:
        """The last attempt's ``report`` as the whole fit's."""
        carried = self.carried
        report.losses = carried.done + report.losses
        if carried.first_started is not None:
            # the whole fit, earlier attempts included: samples count replays again
            report.samples += carried.earlier_samples
            report.elapsed_s += self.last_started - carried.first_started
        report.recoveries = carried.recoveries
        report.rebalances = carried.rebalances
        report.repartitions = carried.repartitions + report.repartitions
        report.first_training_plan = carried.first_plan
        report.replicas = list(self.replay.replicas)
        fast = [r for r in carried.recoveries if "progress_lost" in r]
        report.progress_lost = sum(int(r["progress_lost"]) for r in fast)
        report.unit_sources = dict(fast[-1]["unit_sources"]) if fast else {}
        report.start_step = self.options.start_step
        report.with_optimizer_state = self.options.optimizer_state
        return report


# ---------------------------------------------------------------------------- requests


def resume_request(
    request: RunRequest,
    survivors: list[str],
    dead: list[str],
    recovery: str,
    resume: tuple[int, int],
    consistency: str,
) -> RunRequest:
    """The run request that resumes from the replica over the survivors."""
    train = dict(request.train or {})
    planner = request.planner
    if request.partition is not None or train.get("plan") is not None:
        # The user's own partition named the dead: plan the survivors ("heavy") instead.
        planner = "hpp" if request.microbatch_size is not None else "even"
    return dataclasses.replace(
        request,
        partition=None,
        stages=None,
        stage_names=survivors,
        planner=planner,
        recovery=recovery,
        resume={"run": resume[0], "step": resume[1], "dead": dead, "consistency": consistency},
        train={**train, "plan": None},
    )


def rebalance_request(
    request: RunRequest, plan: TrainingPlan, resume: tuple[int, int]
) -> RunRequest:
    """The run request that goes on from the replica on the better-balanced ``plan``."""
    return dataclasses.replace(
        request,
        partition=None,
        stages=None,
        stage_names=list(plan.devices),
        resume={"run": resume[0], "step": resume[1], "dead": []},
        train={**(request.train or {}), "plan": plan.to_dict()},
    )


def _async_resume(request: RunRequest, *, depth: int) -> RunRequest:
    """An asynchronous run's resume over the survivors: one device per stage, the
    survivors' own looks, and the staleness of the pipeline the run started with."""
    train = dict(request.train or {})
    repartition = train.get("repartition")
    if repartition is not None and "bounds" in repartition:
        # forced cuts name the pipeline the run started with: the survivors'
        # looks decide on what they measure (zpipe.training.async_recovery)
        train["repartition"] = {k: v for k, v in repartition.items() if k != "bounds"}
    planner = "straight" if request.planner == "hpp" else request.planner
    # the survivors keep the staleness of the pipeline the run started with
    # (zpipe.coordinator.runs.async_replicas): what makes the recovery exact
    settings = dict(train.get("async") or {})
    settings.setdefault("depth", depth)
    train["async"] = settings
    return dataclasses.replace(request, planner=planner, train=train)
