"""Training a model across the cluster from Python: :func:`fit`.

``await client.fit(spec, batches, optimizer={...}, num_microbatches=4)`` asks
the coordinator for a training run, feeds each mini-batch's micro-batches to
the first stage and their labels to the last, collects the per-micro-batch
losses, and at the end gathers the trained weights (through the coordinator)
into one state dict with the full model's keys, which
:meth:`TrainReport.model` loads into ``build_full_model(spec)``.

Each item of ``batches`` is one mini-batch ``(inputs..., labels)``: the last
tensor is the labels, the others the model's inputs. A mini-batch is split
into exactly ``num_microbatches`` parts (sizes differ by at most one), and one
optimizer step follows each mini-batch, so the result equals single-process
training on the same mini-batches (up to float summation order).

With ``recover=True`` a run survives the death of a stage, exactly: every
``replicate_every`` mini-batches (and before the first) the pipeline drains
and the coordinator keeps a global replica of every unit's weights and
optimizer state (FTPipeHD's global replication). When a stage dies, the
client starts the run again over the survivors from that replica, planned by
``recovery`` (see :data:`zpipe.recovery.POLICIES`), and replays the
mini-batches since it, which it keeps until the next replica. The trained
model then equals an uninterrupted run's.

Each start (the first, after a recovery, after a rebalance) is one attempt
(:class:`~zpipe.client.training_run.TrainingRun`); :class:`_Training` carries
what goes from one attempt to the next.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterable, Iterable, Sized
from typing import Any

from zpipe._errors import ConfigError, PipelineError, StageFailedError
from zpipe.client.async_training import AsyncTrainingRun
from zpipe.client.batches import BatchSource, TrainBatch, first_batch_size
from zpipe.client.connection import ClientConnection, ConnectedClient
from zpipe.client.options import TrainOptions
from zpipe.client.reports import TrainReport
from zpipe.client.session import RunSession
from zpipe.client.trace import write_trace
from zpipe.client.training_run import AttemptEnd, TrainingRun
from zpipe.log import get_logger
from zpipe.models import ModelSpec, declared_units
from zpipe.planner.training_plan import TrainingPlan
from zpipe.progress import Progress
from zpipe.protocol.client_control import RunRequest
from zpipe.training.async_schedule import ASYNC_SCHEDULE, AsyncSettings

log = get_logger("zpipe.client")

PLANNING = "planning: stages profile training, the coordinator measures links and plans"


async def fit(
    client: ConnectedClient,
    model: ModelSpec,
    batches: Iterable[TrainBatch] | AsyncIterable[TrainBatch],
    options: TrainOptions | None = None,
    **keywords: Any,
) -> TrainReport:
    """Train ``model`` on ``batches``; returns the losses and the trained weights.

    The run's settings are ``options`` or the keywords of :class:`TrainOptions`
    (``optimizer`` and ``num_microbatches`` are required; keywords given with
    ``options`` replace its fields). They are checked before anything is sent.
    """
    settings = TrainOptions.from_keywords(options, keywords)
    return await _Training(client.connection, model, batches, settings).run()


def training_request(
    model: ModelSpec, options: TrainOptions, microbatch_size: int | None, sink_endpoint: str
) -> RunRequest:
    """The ``run_request`` that starts a training run."""
    names = list(options.stage_names) if options.stage_names is not None else None
    plan = options.plan
    train: dict[str, Any] = {
        "schedule": options.schedule,
        "num_microbatches": options.num_microbatches,
        "loss": options.loss,
        "optimizer": dict(options.optimizer),
        "warmups": list(options.warmups) if options.warmups is not None else None,
        # left out when "auto", so that an older coordinator understands the request
        **({} if options.warmup == "auto" else {"warmup": options.warmup}),
        "plan": plan.to_dict() if plan is not None else None,
    }
    # Only when used: a coordinator that predates them refuses unknown settings.
    if options.lr_schedule is not None:
        train["lr_schedule"] = dict(options.lr_schedule)
    if options.start_step:
        train["start_step"] = options.start_step
    if options.resume_optimizer:
        train["resume_optimizer"] = True
    asynchronous = options.schedule.lower() == ASYNC_SCHEDULE
    if asynchronous:
        settings = AsyncSettings(
            vertical_sync=options.vertical_sync,
            aggregate=options.aggregate,
            aggregate_multiple=options.aggregate_multiple,
        )
        train["async"] = settings.to_dict()
    if options.repartition_settings is not None:
        train["repartition"] = options.repartition_settings.to_dict()
    return RunRequest(
        model=model.to_dict(),
        # a user-code model's unit count (zpipe.models.declared_units); None: built in
        num_units=declared_units(model),
        partition=[list(r) for r in options.partition] if options.partition is not None else None,
        stages=options.stages,
        stage_names=names,
        dtype="float32",
        planner=options.planner
        or (
            # asynchronous 1F1B runs one device per stage: a straight pipeline
            ("straight" if asynchronous else "hpp") if microbatch_size is not None else "pipeedge"
        ),
        microbatch_size=microbatch_size,
        sink_endpoint=sink_endpoint,
        wait_for_stages_s=float(options.wait_for_stages_s),
        mode="train",
        rebalance=options.rebalance,
        replication=options.replication,
        # at a replica, devices of these that register (again) may join the plan
        admit=names,
        # a replica or the final weights may take long on slow links: while they move,
        # the coordinator says so, and the waits run on from the latest word
        progress=True,
        train=train,
    )


def check_traced_microbatches(
    model: ModelSpec, batch_size: int | None, num_microbatches: int
) -> None:
    """A traced model's units take only the micro-batch size of the trace: refuse,
    before anything starts, mini-batches that do not split into exactly that."""
    if model.family != "traced" or batch_size is None:
        return
    traced = model.config.get("microbatch_size")
    if isinstance(traced, int) and batch_size != traced * num_microbatches:
        raise ConfigError(
            f"the traced model was traced at micro-batches of {traced} samples, but "
            f"mini-batches of {batch_size} split into {num_microbatches} micro-batches "
            f"are not that: use mini-batches of {traced * num_microbatches} samples, or "
            f"set the spec's microbatch_size to {batch_size // num_microbatches or 1} "
            "(and divide evenly)"
        )


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


class _Training:
    """A whole fit: its attempts, and what carries from one to the next."""

    def __init__(
        self,
        connection: ClientConnection,
        model: ModelSpec,
        batches: Iterable[TrainBatch] | AsyncIterable[TrainBatch],
        options: TrainOptions,
    ) -> None:
        self.connection = connection
        self.model = model
        self.options = options
        self.every = options.replica_period
        microbatch_size = options.microbatch_size
        size = first_batch_size(batches)
        if microbatch_size is None and size is not None:
            microbatch_size = -(-size // options.num_microbatches)
        check_traced_microbatches(model, size, options.num_microbatches)
        self.request = training_request(model, options, microbatch_size, connection.sink_endpoint)
        self.plan = options.plan
        self.schedule, self.num_microbatches = options.schedule, options.num_microbatches
        self.source = BatchSource(batches)
        self.total = len(batches) if isinstance(batches, Sized) else None
        self.done: list[float] = []  # the losses of the mini-batches before this attempt's
        self.recoveries: list[dict[str, Any]] = []
        self.rebalances: list[dict[str, Any]] = []
        # the looks of live re-partitioning in attempts before this one, not replayed
        self.repartitions: list[dict[str, Any]] = []
        self.first_plan: TrainingPlan | None = None
        self.earlier_samples = 0  # of the attempts that ended early
        self.first_started: float | None = None

    async def run(self) -> TrainReport:
        while True:
            session = RunSession(
                self.connection, what="training", stall_deadline=self.options.stall_deadline
            )
            # the learning-rate schedule goes on from this attempt's first mini-batch
            start_step = self.options.start_step + self.source.kept_from
            # (an asynchronous run's replica carries its update count instead)
            if start_step and self.schedule != ASYNC_SCHEDULE:
                train = {**(self.request.train or {}), "start_step": start_step}
                self.request = dataclasses.replace(self.request, train=train)
            async with Progress(self.options.progress).waiting(PLANNING):
                ready = await session.request_run(
                    self.request,
                    wait_for_stages_s=self.options.wait_for_stages_s,
                    doing="start the training run",
                )
            if ready.resumed is not None:
                self._rewind_to_global(ready.resumed)
            if self.plan is not None:
                self.schedule, self.num_microbatches = (
                    self.plan.schedule,
                    self.plan.num_microbatches,
                )
            run: TrainingRun | None = None
            # asynchronous 1F1B: its own attempt, which ends its feed explicitly
            attempt = AsyncTrainingRun if self.schedule == ASYNC_SCHEDULE else TrainingRun
            try:
                run = attempt(
                    session,
                    ready,
                    self.model,
                    schedule=self.schedule,
                    num_microbatches=self.num_microbatches,
                    max_steps_in_flight=self.options.max_steps_in_flight,
                    offset=self.source.kept_from,
                    replicate_every=self.every,
                    global_every=self.options.global_period,
                )
                run.repartition = self.options.repartition_settings
                tplan = run.report.training_plan
                if self.options.on_plan is not None and tplan is not None:
                    self.options.on_plan(tplan)
                self.first_plan = self.first_plan or tplan
                if self.recoveries:
                    noticed = self.recoveries[-1]["noticed_at"]
                    self.recoveries[-1]["restart_s"] = time.monotonic() - noticed
                    if tplan is not None and "bounds" not in self.recoveries[-1]:
                        # the survivors' cuts (zpipe.training.async_recovery.cuts_of_run)
                        self.recoveries[-1]["bounds"] = [
                            *(st.start for st in tplan.stages),
                            tplan.stages[-1].end,
                        ]
                end = await self._attempt(session, run)
            finally:
                await session.close()
                if run is not None:
                    run.close()
            if end.rebalance_to is not None:
                self._move_to(run, end.rebalance_to)
            elif end.stage_failure is not None:
                self._recover_from(run, end.stage_failure)
            else:
                break
        trace = self.options.trace
        run.report.stages = await session.finish(timeline=trace is not None)
        if trace is not None:
            write_trace(trace, session.timelines, run=session.run)
        return self._final_report(run)

    async def _attempt(self, session: RunSession, run: TrainingRun) -> AttemptEnd:
        # losses and notices only: the socket's limits (an inference run may have
        # lowered them for its own outputs)
        await session.connection.limit_sink(session.connection.sink_fallback)
        await session.go()
        end = await run.train(
            self.source, self.options.progress, self.options.on_step, total=self.total
        )
        if end.stage_failure is not None or end.rebalance_to is not None:
            return end
        try:
            await run.gather_weights(optimizer=self.options.optimizer_state)
        except PipelineError:
            # A stage that dies after the last mini-batch fails the gather; with
            # recover, the run resumes from its replica as for any other death.
            failure = None
            if self.every is not None:
                reply_s = self.connection.timeouts.reply_s
                failure = await session.stage_failure_within(reply_s)
            if failure is None:
                raise
            return AttemptEnd(stage_failure=failure)
        # The last round ends when every stage has stepped, which the gather waited for.
        run.report.elapsed_s = time.perf_counter() - run.started
        return AttemptEnd()

    def _move_to(self, run: TrainingRun, plan: TrainingPlan) -> None:
        """Go on from the replica just kept, on the better-balanced ``plan``."""
        source = self.source
        self.done = (self.done + run.report.losses)[: source.replica_step]
        self._count_attempt(run)
        self.rebalances.append({"at": source.replica_step, "plan": plan.to_dict()})
        assert source.resume is not None  # the replica was just kept
        self.request = rebalance_request(self.request, plan, source.resume)
        self.plan = plan

    def _recover_from(self, run: TrainingRun, failure: StageFailedError) -> None:
        """Resume from the replica over the survivors, or raise ``failure``."""
        source, options = self.source, self.options
        if self.every is None or source.resume is None:
            raise failure
        tplan = run.report.training_plan
        assert tplan is not None
        dead = sorted({*(r["dead"] for r in self.recoveries), failure.stage})
        survivors = [d for d in tplan.devices if d not in dead]
        if not survivors:
            raise failure
        if options.consistency == "fast":
            # Every completed mini-batch stays: only those in flight go again.
            self.done = self.done + run.report.losses
            source.forget_before(len(self.done))
        else:
            # What the replica holds stays; what came after it is trained again.
            self.done = (self.done + run.report.losses)[: source.replica_step]
        self._count_attempt(run)
        self._keep_looks(run, source.kept_from)
        self.recoveries.append(
            {
                "dead": failure.stage,
                "reason": failure.reason,
                "noticed_at": time.monotonic(),
                "resumed_from": source.kept_from,
                "replica": source.replica_step,
                "replayed": len(source.kept),
                "policy": options.recovery,
                "consistency": options.consistency,
            }
        )
        log.warning(
            "training_recovering",
            run=run.run,
            dead=failure.stage,
            resume_from=source.kept_from,
            consistency=options.consistency,
            replay=len(source.kept),
            policy=options.recovery,
        )
        self.request = resume_request(
            self.request, survivors, dead, options.recovery, source.resume, options.consistency
        )
        if self.schedule == ASYNC_SCHEDULE:
            train = dict(self.request.train or {})
            repartition = train.get("repartition")
            if repartition is not None and "bounds" in repartition:
                # forced cuts name the pipeline the run started with: the survivors'
                # looks decide on what they measure (zpipe.training.async_recovery)
                train["repartition"] = {k: v for k, v in repartition.items() if k != "bounds"}
            planner = self.request.planner
            if planner == "hpp":
                planner = "straight"  # one device per stage, re-planned
            # the survivors keep the staleness of the pipeline the run started with
            # (zpipe.coordinator.async_replicas): what makes the recovery exact
            settings = dict(train.get("async") or {})
            settings.setdefault("depth", len(tplan.stages))
            train["async"] = settings
            self.request = dataclasses.replace(self.request, planner=planner, train=train)
            self.recoveries[-1]["depth"] = settings["depth"]
        if options.consistency == "exact" and source.global_resume is not None:
            # the older copy to resume from if some unit lost every chain copy; the
            # learning-rate schedule then goes on from its mini-batch
            resume = dict(self.request.resume or {})
            resume["global"] = {
                "run": source.global_resume[0],
                "step": source.global_resume[1],
                # (an asynchronous run's replica carries its update count instead)
                "start_step": 0
                if self.schedule == ASYNC_SCHEDULE
                else self.options.start_step + (source.global_step or 0),
            }
            self.request = dataclasses.replace(self.request, resume=resume)
        self.plan = None

    def _rewind_to_global(self, resumed: Any) -> None:
        """The coordinator resumed from the newest global copy, older than the replica
        asked for (some unit lost every chain copy): train again from there."""
        source = self.source
        if source.global_resume is None or [source.global_resume[0], source.global_resume[1]] != [
            resumed.get("run"),
            resumed.get("step"),
        ]:
            raise PipelineError(
                f"the coordinator resumed from replica {resumed}, which this client does "
                f"not hold the mini-batches since (its global copy: {source.global_resume})"
            )
        source.rewind_to_global()
        self.done = self.done[: source.kept_from]
        self.repartitions = [r for r in self.repartitions if int(r["at"]) <= source.kept_from]
        if self.recoveries:
            self.recoveries[-1].update(
                resumed_from=source.kept_from,
                replica=source.replica_step,
                replayed=len(source.kept),
                from_global=True,
            )
        log.warning("training_resumed_from_global", step=source.kept_from)

    def _keep_looks(self, run: TrainingRun, resumed_from: int) -> None:
        """The attempt's looks up to the replica the next attempt resumes from (those
        after it are made again, on the mini-batches trained again)."""
        kept = [r for r in run.report.repartitions if int(r["at"]) <= resumed_from]
        self.repartitions += kept

    def _count_attempt(self, run: TrainingRun) -> None:
        self.earlier_samples += run.report.samples
        self.first_started = self.first_started or run.started

    def _final_report(self, run: TrainingRun) -> TrainReport:
        report = run.report
        report.losses = self.done + report.losses
        if self.first_started is not None:
            # the whole fit, earlier attempts included: samples count replays again
            report.samples += self.earlier_samples
            report.elapsed_s += run.started - self.first_started
        report.recoveries = self.recoveries
        report.rebalances = self.rebalances
        report.repartitions = self.repartitions + report.repartitions
        report.first_training_plan = self.first_plan
        report.replicas = list(self.source.replicas)
        report.start_step = self.options.start_step
        report.with_optimizer_state = self.options.optimizer_state
        return report
