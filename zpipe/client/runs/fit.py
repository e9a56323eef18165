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
(:class:`~zpipe.client.runs.sync_training.TrainingRun`); what goes from one attempt to
the next is decided by a pure controller
(:class:`~zpipe.client.runs.training_attempts.TrainingAttempts`), which
:class:`_Training` feeds what happened and obeys.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, Iterable, Sized
from typing import Any

from zpipe._errors import ConfigError, PipelineError
from zpipe.client.batches import BatchSource, TrainBatch, first_batch_size
from zpipe.client.connection import ClientConnection, ConnectedClient
from zpipe.client.options import TrainOptions
from zpipe.client.reports import TrainReport
from zpipe.client.runs.async_training import AsyncTrainingRun
from zpipe.client.runs.sync_training import AttemptEnd, TrainingRun
from zpipe.client.runs.training_attempts import (
    AttemptEnded,
    AttemptReady,
    AttemptStarted,
    Command,
    FailFit,
    FinishFit,
    RequestRun,
    StartAttempt,
    TrainingAttempts,
    rebalance_request,
    resume_request,
)
from zpipe.client.session import RunSession
from zpipe.client.trace import write_trace
from zpipe.log import get_logger
from zpipe.models import ModelSpec, declared_units
from zpipe.planner.async_schedule import ASYNC_SCHEDULE, AsyncSettings
from zpipe.progress import TerminalProgress
from zpipe.protocol.client_control import RunRequest

log = get_logger("zpipe.client")

__all__ = [
    "check_traced_microbatches",
    "fit",
    "rebalance_request",  # (from zpipe.client.runs.training_attempts)
    "resume_request",  # (from zpipe.client.runs.training_attempts)
    "training_request",
]

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
        periods = options.live_copy_periods
        settings = AsyncSettings(
            vertical_sync=options.vertical_sync,
            aggregate=options.aggregate,
            aggregate_multiple=options.aggregate_multiple,
            chain_every=periods[0] if periods else None,
            global_every=periods[1] if periods else None,
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
        # the given plan's unit costs, for rebalancing it
        profile=options.profile.to_dict() if options.profile is not None else None,
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


class _Training:
    """A whole fit: the I/O of its attempts; what goes from one to the next is the
    decision of its :class:`~zpipe.client.runs.training_attempts.TrainingAttempts`."""

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
        microbatch_size = options.microbatch_size
        size = first_batch_size(batches)
        if microbatch_size is None and size is not None:
            microbatch_size = -(-size // options.num_microbatches)
        check_traced_microbatches(model, size, options.num_microbatches)
        request = training_request(model, options, microbatch_size, connection.sink_endpoint)
        self.source = BatchSource(batches)
        self.total = len(batches) if isinstance(batches, Sized) else None
        self.attempts = TrainingAttempts(request, options, self.source)

    async def run(self) -> TrainReport:
        command: Command = self.attempts.start()
        while True:
            assert isinstance(command, RequestRun)
            session = RunSession(
                self.connection, what="training", stall_deadline=self.options.stall_deadline
            )
            async with TerminalProgress(self.options.progress).waiting(PLANNING):
                ready = await session.request_run(
                    command.request,
                    wait_for_stages_s=self.options.wait_for_stages_s,
                    doing="start the training run",
                )
            (start,) = self.attempts.handle(
                AttemptReady(ready.resumed, now=time.monotonic(), fast_recovery=ready.fast_recovery)
            )
            if isinstance(start, FailFit):
                raise start.error
            assert isinstance(start, StartAttempt)
            if ready.resumed is not None:
                log.warning("training_resumed_from_global", step=self.source.kept_from)
            run: TrainingRun | None = None
            # asynchronous 1F1B: its own attempt, which ends its feed explicitly
            attempt = AsyncTrainingRun if start.asynchronous else TrainingRun
            try:
                run = attempt(
                    session,
                    ready,
                    self.model,
                    self.attempts,
                    start,
                    max_steps_in_flight=self.options.max_steps_in_flight,
                )
                tplan = run.report.training_plan
                if self.options.on_plan is not None and tplan is not None:
                    self.options.on_plan(tplan)
                self.attempts.handle(AttemptStarted(tplan, now=time.monotonic()))
                end = await self._attempt(session, run)
            finally:
                await session.close()
                if run is not None:
                    run.close()
            ended = AttemptEnded(
                run.report,
                run.started,
                failure=end.stage_failure,
                rebalance_to=end.rebalance_to,
                now=time.monotonic(),
            )
            (command,) = self.attempts.handle(ended)
            match command:
                case FailFit(error=error):
                    raise error
                case FinishFit():
                    break
                case RequestRun(recovery=recovery) if recovery is not None:
                    log.warning(
                        "training_recovering",
                        run=run.run,
                        dead=recovery["dead"],
                        resume_from=recovery["resumed_from"],
                        consistency=recovery["consistency"],
                        replay=recovery["replayed"],
                        policy=recovery["policy"],
                    )
        trace = self.options.trace
        run.report.stages = await session.finish(timeline=trace is not None)
        if trace is not None:
            write_trace(trace, session.timelines, run=session.run)
        return self.attempts.complete(run.report)

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
            if self.attempts.recovers:
                reply_s = self.connection.timeouts.reply_s
                failure = await session.stage_failure_within(reply_s)
            if failure is None:
                raise
            return AttemptEnd(stage_failure=failure)
        # The last round ends when every stage has stepped, which the gather waited for.
        run.report.elapsed_s = time.perf_counter() - run.started
        return AttemptEnd()
