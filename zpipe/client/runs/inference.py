"""An inference stream on the client side: the data source, the sink's results, the order.

The client sends micro-batches straight to the first stage and receives
results straight from the last one, keeping at most ``max_in_flight``
micro-batches in the pipeline (backpressure), and yields results in input
order whatever order they arrive in. After a re-plan (a stage died) it sends
every input without a result again to the new first stage.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable

import torch
import zmq.asyncio

from zpipe._errors import PipelineError, ProtocolError, TransportTimeout
from zpipe.client.batches import (
    Batch,
    Outputs,
    as_tensors,
    check_fits_first_stage,
    microbatch_count,
    split_microbatches,
)
from zpipe.client.connection import CLIENT_NAME, ClientConnection
from zpipe.client.options import InferOptions
from zpipe.client.reports import InferenceReport
from zpipe.client.session import RunSession
from zpipe.client.sink_limits import most_rows, sink_limits
from zpipe.client.trace import recovery_marks, write_trace
from zpipe.log import get_logger
from zpipe.models import ModelSpec, declared_units
from zpipe.planner import Plan
from zpipe.progress import ResultBar, TerminalProgress
from zpipe.protocol import WireMessage
from zpipe.protocol.client_control import RunReady, RunReplanned, RunRequest
from zpipe.protocol.data_plane import Data, MicroBatchError
from zpipe.transport.sockets import send

log = get_logger("zpipe.client")

# what the client waits for between its request and the plan: named, for the person
PLANNING = "planning: stages profile the model, the coordinator measures links and plans"


def inference_request(model: ModelSpec, options: InferOptions, sink_endpoint: str) -> RunRequest:
    """The ``run_request`` that starts an inference stream."""
    partition = options.partition
    names = options.stage_names
    return RunRequest(
        model=model.to_dict(),
        # a user-code model's unit count, which spares the coordinator running the
        # factory (zpipe.models.declared_units); None for a built-in family
        num_units=declared_units(model),
        partition=[list(r) for r in partition] if partition is not None else None,
        stages=options.stages,
        stage_names=list(names) if names is not None else None,
        dtype=options.dtype,
        planner=options.planner or "pipeedge",
        microbatch_size=options.microbatch_size,
        profile=options.profile.to_dict() if options.profile is not None else None,
        sink_endpoint=sink_endpoint,
        wait_for_stages_s=float(options.wait_for_stages_s),
        recover=options.recover,
        recovery=options.recovery,
        # left out when "auto", so that an older coordinator understands the request
        bucketing=None if options.bucketing == "auto" else str(options.bucketing),
    )


class InferenceRun:
    """One inference stream: ``async for outputs in run.outputs(batches)``, then
    :attr:`report` (plan, throughput, each stage's counters, recoveries)."""

    def __init__(self, connection: ClientConnection, model: ModelSpec, options: InferOptions):
        self.connection = connection
        self.model = model
        self.options = options
        self.report: InferenceReport | None = None

    async def outputs(
        self, batches: Iterable[Batch] | AsyncIterable[Batch]
    ) -> AsyncIterator[Outputs]:
        session = RunSession(
            self.connection, what="stream", stall_deadline=self.options.stall_deadline
        )
        async with TerminalProgress(self.options.phases).waiting(PLANNING):
            ready = await session.request_run(
                inference_request(self.model, self.options, self.connection.sink_endpoint),
                wait_for_stages_s=self.options.wait_for_stages_s,
                doing="start the run",
            )
        stream = _Stream(session, ready, self.options)
        bar = _default_bar(self.options, batches)
        if bar is not None:
            stream.progress = bar
        try:
            if self.options.on_plan is not None:
                self.options.on_plan(stream.plan)
            # before the last stage connects (on go): the sink takes what this run sends
            rows = most_rows(batches, self.options.microbatch_size)
            limits = sink_limits(self.model, rows, self.connection.sink_fallback)
            await self.connection.limit_sink(limits)
            await session.go()
            async for outputs in stream.outputs_in_order(batches):
                yield outputs
        finally:
            await session.close()
            stream.close()
            if bar is not None:
                bar.close()
        trace = self.options.trace
        stream.report.stages = await session.finish(timeline=trace is not None)
        self.report = stream.report
        if trace is not None:
            write_trace(
                trace, session.timelines, run=session.run, marks=recovery_marks(self.report)
            )


def _default_bar(options: InferOptions, batches: object) -> ResultBar | None:
    """A bar of micro-batches on a terminal, unless the caller follows progress itself."""
    progress = TerminalProgress(options.phases)
    if options.progress is not None or not progress.enabled:
        return None
    total = microbatch_count(batches, options.microbatch_size)
    return ResultBar(progress, total=total, desc="streaming")


class _Stream:
    """The data plane of one stream: source, sink results and reordering."""

    def __init__(self, session: RunSession, ready: RunReady, options: InferOptions) -> None:
        self.session = session
        self.connection = session.connection
        self.timeouts = session.timeouts
        self.plan = Plan.from_dict(ready.plan)
        self.first_stage = ready.first_stage
        # the first stage's data port limit per frame (None: an older coordinator)
        self.first_limit: int | None = ready.first_max_message_bytes
        self.microbatch_size = options.microbatch_size
        self.window = asyncio.Semaphore(options.max_in_flight)
        self.progress = options.progress
        self.on_plan = options.on_plan
        baseline = ready.baseline
        self.report = InferenceReport(
            run=session.run,
            plan=self.plan,
            baseline=Plan.from_dict(baseline) if baseline is not None else None,
        )
        self.source: zmq.asyncio.Socket = self.connection.push_to(
            ready.first_endpoint, ready.first_key, self.first_stage
        )
        session.allow_sink_senders([ready.last_key])
        # inputs whose results have not arrived, to send again after a re-plan
        self.unanswered: dict[int, tuple[torch.Tensor, ...]] = {}
        self.send_lock = asyncio.Lock()
        # micro-batch id -> (batch index, part index); batch index -> number of parts
        self.owner: dict[int, tuple[int, int]] = {}
        self.parts: dict[int, int] = {}
        self.arrived: dict[int, dict[int, Outputs]] = {}
        self.results: asyncio.Queue[tuple[int, Outputs | None]] = asyncio.Queue()
        self.sent = 0
        self.received = 0
        self.total_batches: int | None = None

    async def outputs_in_order(
        self, batches: Iterable[Batch] | AsyncIterable[Batch]
    ) -> AsyncIterator[Outputs]:
        started = time.perf_counter()
        session = self.session
        session.watch(
            self._check_result, self._take_result, awaited="results", on_replanned=self._replay
        )
        session.spawn(self._feed(batches), "feed")
        next_batch = 0
        waiting: dict[int, Outputs] = {}
        result_s = self.timeouts.result_s
        while self.total_batches is None or next_batch < self.total_batches:
            try:
                # results that arrived before a failure are delivered first
                if not self.results.empty():
                    index, value = self.results.get_nowait()
                else:
                    index, value = await session.race(self.results.get(), timeout_s=result_s)
            except asyncio.TimeoutError:
                raise TransportTimeout(
                    session.last_stage, f"the result of batch {next_batch}", result_s
                ) from None
            if value is None:  # the feeder finished: now the number of batches is known
                continue
            waiting[index] = value
            while next_batch in waiting:
                yield waiting.pop(next_batch)
                next_batch += 1
        self.report.elapsed_s = time.perf_counter() - started
        self.report.microbatches = self.received

    async def _feed(self, batches: Iterable[Batch] | AsyncIterable[Batch]) -> None:
        index = 0
        if isinstance(batches, AsyncIterable):
            async for batch in batches:
                await self._send_batch(index, batch)
                index += 1
        else:
            for batch in batches:
                await self._send_batch(index, batch)
                index += 1
        self.total_batches = index
        await self.results.put((-1, None))

    async def _send_batch(self, index: int, batch: Batch) -> None:
        tensors = as_tensors(batch)
        micro = split_microbatches(tensors, self.microbatch_size)
        self.parts[index] = len(micro)
        self.report.samples += int(tensors[0].shape[0])
        for part, mb_tensors in enumerate(micro):
            await self.window.acquire()
            async with self.send_lock:  # not interleaved with a replay to a new first stage
                mb = self.sent
                self.sent += 1
                self.session.stall.sent(time.monotonic())
                self.owner[mb] = (index, part)
                self.unanswered[mb] = mb_tensors
                await self._send_input(mb, mb_tensors)

    async def _send_input(self, mb: int, tensors: tuple[torch.Tensor, ...]) -> None:
        check_fits_first_stage(tensors, self.first_limit, self.first_stage)
        data = Data(run=self.session.run, mb=mb, src=CLIENT_NAME, epoch=self.session.epoch,
                    tensors=tensors)  # fmt: skip
        await send(
            self.source, data.to_message(), timeout_s=self.timeouts.send_s, peer=self.first_stage
        )

    def _check_result(self, message: WireMessage) -> None:
        session = self.session
        if not isinstance(message, (Data, MicroBatchError)):
            raise ProtocolError(f"{message.KIND!r} does not belong on the sink")
        if message.epoch != session.epoch or message.run != session.run:
            raise ProtocolError(f"a result of epoch {message.epoch}, expected {session.epoch}")
        if message.src != session.last_stage:  # a failure notice too: it ends the run
            raise ProtocolError(
                f"{message.KIND!r} from {message.src!r}, not {session.last_stage!r}"
            )
        if message.mb not in self.owner:
            raise ProtocolError(f"a result for unknown or finished micro-batch {message.mb}")

    async def _take_result(self, message: WireMessage) -> None:
        assert isinstance(message, Data)  # _check_result let only results through
        mb = message.mb
        index, part = self.owner.pop(mb)
        self.unanswered.pop(mb, None)
        self.window.release()
        self.received += 1
        self.session.stall.completed(time.monotonic())
        pieces = self.arrived.setdefault(index, {})
        pieces[part] = message.tensors
        if self.progress is not None:
            try:
                self.progress(self.received, self.sent)
            except Exception as exc:  # the caller's callback: its error ends the stream
                self.session.fail(exc)
                return
        if len(pieces) < self.parts[index]:
            return
        del self.arrived[index]
        ordered = [pieces[p] for p in range(len(pieces))]
        try:
            outputs = tuple(
                torch.cat(group) if len(ordered) > 1 else group[0]
                for group in zip(*ordered, strict=False)
            )
        except RuntimeError as exc:
            self.session.fail(
                PipelineError(f"the results of batch {index}'s micro-batches do not fit: {exc}")
            )
            return
        await self.results.put((index, outputs))

    async def _replay(self, notice: RunReplanned) -> None:
        """Follow a re-plan: the new first and last stage, then every unanswered input."""
        async with self.send_lock:
            first_stage = notice.first_stage
            source = self.connection.push_to(notice.first_endpoint, notice.first_key, first_stage)
            self.source.close(linger=0)
            self.source, self.first_stage = source, first_stage
            self.first_limit = notice.first_max_message_bytes
            # results of the old epoch are dropped from now on
            self.session.follow(notice.epoch, notice.last_stage, notice.last_key)
            self.plan = Plan.from_dict(notice.plan)
            self.report.plan = self.plan
            if self.on_plan is not None:
                self.on_plan(self.plan)
            replayed = sorted(self.unanswered)
            for mb in replayed:
                await self._send_input(mb, self.unanswered[mb])
        self.report.recoveries.append(
            {
                "dead": notice.dead,
                # (the report's 0.0: a coordinator that did not measure it)
                "detected_s": float(notice.detected_s or 0.0),
                "recovered_s": float(notice.recovered_s),
                "replayed": len(replayed),
                "epoch": notice.epoch,
                # this process's time.monotonic() when the new plan arrived
                "at": time.monotonic(),
                # the coordinator's clock when the new plan ran (None: an older one)
                "clock": notice.clock,
            }
        )
        log.warning(
            "stream_replanned",
            run=self.session.run,
            dead=notice.dead,
            replayed=len(replayed),
            plan=notice.plan["stages"],
        )

    def close(self) -> None:
        self.source.close(linger=0)
