"""The embedded API of a pipelined generation run: sequences in, token events out.

::

    async with PipelineClient(coordinator) as client:
        async for event in client.generate(spec, [[5, 17, 3], [9, 1]], stages=3):
            print(event.sequence, event.index, event.token, event.finish_reason)

The client asks the coordinator for the run (``gen_run_request``; the
coordinator sets up the stages, :mod:`zpipe.coordinator.runs.generation`), then
talks to the first stage only: each sequence goes there (``gen_submit``), and the
first stage, which runs the scheduler, streams each sequence's events to this
client's sink (a step's events in one ``gen_token_batch``, handed out here one at
a time in their order; ``gen_refused`` for one it cannot take, with its kind). At
the end (or when the caller stops iterating) the client closes the run
(``gen_close``), and every stage frees its caches.

When a stage dies the coordinator re-plans the run over the survivors and tells
this client (``run_replanned``, :mod:`zpipe.coordinator.runs.generation_recovery`).
The client keeps each sequence's prompt, settings and the tokens it received, so it
sends every unfinished sequence again, to the new first stage, with those tokens:
the new stages prefill prompt + generated tokens and the stream goes on at the next
index. Events of the old plan that arrive later are dropped (their epoch), so no
token comes twice and none is missing; greedy tokens are those of an uninterrupted
run. A recovery that fails ends the stream with
:class:`~zpipe._errors.StageFailedError`.

Every wait has a deadline: the coordinator's answer (``result_s``) and each next
event of the run (``token_timeout_s``, counted again from a re-plan's notice), so a
run that stops without a notice fails the stream with
:class:`~zpipe._errors.TransportTimeout`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
import zmq.asyncio

from zpipe._errors import (
    ConfigError,
    PipelineError,
    ProtocolError,
    RunRefusedError,
    SequenceRefused,
    TransportTimeout,
    ZpipeError,
)
from zpipe.client.connection import ClientConnection
from zpipe.client.failures import stage_failed_error
from zpipe.generation.params import SamplingParams, TokenEvent
from zpipe.generation.refusals import kind_from_wire
from zpipe.generation.wire import (
    check_dtype,
    events_from_wire,
    finish_from_wire,
    params_to_map,
)
from zpipe.log import get_logger
from zpipe.models import ModelSpec
from zpipe.models.causal_lm import FAMILY, read_causal_lm_config
from zpipe.planner import Plan
from zpipe.protocol.client_control import RunEnd, RunFailed, RunReplanned, RunReport, StageFailed
from zpipe.protocol.generation import (
    GenCancel,
    GenClose,
    GenRefused,
    GenRunReady,
    GenRunRequest,
    GenSubmit,
    GenToken,
    GenTokenBatch,
)
from zpipe.transport.sockets import recv_frames, send

log = get_logger("zpipe.client")

CLIENT = "client"


@dataclass(frozen=True)
class GenerateOptions:
    """A generation run's settings, checked when made (a ConfigError before anything
    is sent).

    ``stages`` / ``stage_names`` / ``partition`` (units per stage): which stages hold
    the model (without a partition the planner splits the units within each stage's
    memory). ``max_context``: the
    most tokens of one sequence (default: the model's positions). ``max_sequences``:
    sequences admitted at once; ``steps_in_flight``: micro-batches on the ring at
    once (default: one per stage, so no stage waits); ``chunk_tokens``: prefill
    tokens per step. ``kv_budget_bytes``: each stage's KV cache (default: room for
    every admitted sequence at full context). ``token_timeout_s``: the longest wait
    for the run's next event (default: the client's ``result_s``). ``text``: each
    event carries the text it completes, and stop strings are honoured, with the
    tokenizer in the model's checkpoint directory (which the first stage reads).
    """

    stages: int | None = None
    stage_names: Sequence[str] | None = None
    partition: Sequence[int] | None = None
    max_context: int | None = None
    max_sequences: int = 8
    steps_in_flight: int | None = None
    chunk_tokens: int = 256
    kv_budget_bytes: int | None = None
    dtype: str | None = None
    wait_for_stages_s: float = 30.0
    token_timeout_s: float | None = None
    text: bool = False

    def __post_init__(self) -> None:
        for name in ("stages", "max_context", "steps_in_flight", "kv_budget_bytes"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("max_sequences", "chunk_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        check_dtype(self.dtype)
        if not self.wait_for_stages_s > 0:
            raise ConfigError(f"wait_for_stages_s must be > 0, got {self.wait_for_stages_s}")
        if self.token_timeout_s is not None and not self.token_timeout_s > 0:
            raise ConfigError(f"token_timeout_s must be > 0, got {self.token_timeout_s}")
        if self.stages is None and self.stage_names is None and self.partition is None:
            raise ConfigError("say which stages generate: stages, stage_names or partition")

    @classmethod
    def from_keywords(
        cls, options: GenerateOptions | None, keywords: Mapping[str, Any]
    ) -> GenerateOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(keywords) - known)
        if unknown:
            raise ConfigError(f"unknown generate settings {unknown}; known: {sorted(known)}")
        if options is None:
            return cls(**keywords)
        return replace(options, **keywords)

    @property
    def stage_count(self) -> int:
        if self.partition is not None:
            return len(self.partition)
        if self.stage_names is not None:
            return len(self.stage_names)
        assert self.stages is not None  # __post_init__ requires one of the three
        return self.stages


def params_for(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    """One SamplingParams per sequence: the same for all, or one each."""
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    listed = list(params)
    if len(listed) != count or not all(isinstance(p, SamplingParams) for p in listed):
        raise ConfigError(f"give one SamplingParams, or one for each of the {count} prompts")
    return listed


@dataclass
class _Sent:
    """A sequence this client submitted: what it takes to send it again after a
    re-plan (its prompt, its settings, the tokens received so far)."""

    prompt: tuple[int, ...]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    over: bool = False  # finished, refused or cancelled: never sent again


class GenerationRun:
    """One generation run of one client: set up, sequences submitted, events read."""

    def __init__(
        self, connection: ClientConnection, model: ModelSpec, options: GenerateOptions
    ) -> None:
        if model.family != FAMILY:
            raise ConfigError(f"generate needs a {FAMILY!r} model, got {model.family!r}")
        self.connection = connection
        self.model = model
        self.options = options
        self.config = read_causal_lm_config(model.config)
        self.ready: GenRunReady | None = None
        self._push: zmq.asyncio.Socket | None = None
        self._closed = False
        self._sent: dict[int, _Sent] = {}
        # events received (a step's come in one message) and not yet handed out; each
        # counted in its sequence's tokens when received, so a re-plan sends them on
        self._pending: deque[TokenEvent] = deque()
        # each re-plan this run went through: the dead stage, the new stages, times
        self.recoveries: list[dict[str, Any]] = []

    @property
    def run(self) -> int:
        assert self.ready is not None, "start() the run first"
        return self.ready.run

    async def start(self) -> GenRunReady:
        opts, timeouts = self.options, self.connection.timeouts
        request = GenRunRequest(
            model=self.model.to_dict(),
            sink_endpoint=self.connection.sink_endpoint,
            max_context=opts.max_context or self.config.max_positions,
            max_sequences=opts.max_sequences,
            steps_in_flight=opts.steps_in_flight or opts.stage_count,
            chunk_tokens=opts.chunk_tokens,
            wait_for_stages_s=opts.wait_for_stages_s,
            stages=opts.stages,
            stage_names=None if opts.stage_names is None else list(opts.stage_names),
            partition=None if opts.partition is None else list(opts.partition),
            kv_budget_bytes=opts.kv_budget_bytes,
            dtype=opts.dtype,
            text=True if opts.text else None,
        )
        answer = await self.connection.control.ask(
            request,
            expect=(GenRunReady, RunFailed),
            timeout_s=opts.wait_for_stages_s + timeouts.result_s,
            awaited="gen_run_ready",
        )
        if isinstance(answer, RunFailed):
            if answer.in_flight is not None:  # another client's run: nothing was started
                raise RunRefusedError(
                    answer.in_flight, f"the generation run was not started: {answer.error}"
                )
            raise PipelineError(f"the generation run failed to start: {answer.error}")
        assert isinstance(answer, GenRunReady)
        self.ready = answer
        # ended at close(); a run the caller leaves without it is ended when the
        # connection closes, so that it does not hold the coordinator (one run at a time)
        self.connection.open_run = answer.run
        # only the first stage streams to this sink; allowed before it connects
        self.connection.allow_sink_senders([answer.first_key])
        self._push = self.connection.push_to(
            answer.first_endpoint, answer.first_key, answer.first_stage
        )
        log.debug("generation_started", run=answer.run, stages=answer.stages, bounds=answer.bounds)
        return answer

    async def _send(self, message: Any) -> None:
        assert self._push is not None and self.ready is not None, "start() the run first"
        await send(
            self._push,
            message.to_message(),
            timeout_s=self.connection.timeouts.send_s,
            peer=self.ready.first_stage,
        )

    async def submit(self, sequence: int, prompt: Sequence[int], params: SamplingParams) -> None:
        self._sent[sequence] = _Sent(tuple(prompt), params)
        await self._submit(sequence)

    async def _submit(self, sequence: int) -> None:
        """Send ``sequence`` to the first stage: its prompt and, after a re-plan, the
        tokens it already streamed (a second tensor), which the stage prefills."""
        sent = self._sent[sequence]
        tensors = [torch.tensor(sent.prompt, dtype=torch.int64)]
        if sent.tokens:
            tensors.append(torch.tensor(sent.tokens, dtype=torch.int64))
        submit = GenSubmit(
            run=self.run,
            sequence=sequence,
            src=CLIENT,
            params=params_to_map(sent.params),
            tensors=tuple(tensors),
            epoch=self._epoch,
        )
        await self._send(submit)

    async def cancel(self, sequence: int) -> None:
        if sequence in self._sent:
            self._sent[sequence].over = True
        await self._send(GenCancel(run=self.run, sequence=sequence, src=CLIENT, epoch=self._epoch))

    @property
    def _epoch(self) -> int:
        assert self.ready is not None
        return self.ready.epoch

    async def next_event(self) -> TokenEvent:
        """The run's next event from the first stage; SequenceRefused (a PipelineError)
        for a refused sequence, StageFailedError when a stage died and the run could
        not be re-planned, TransportTimeout when nothing comes within
        ``token_timeout_s`` (a re-plan's notice starts the wait again)."""
        assert self.ready is not None, "start() the run first"
        if self._pending:  # the rest of a step's events, received with its first
            return self._pending.popleft()
        timeout_s = self.options.token_timeout_s or self.connection.timeouts.result_s
        deadline = time.monotonic() + timeout_s
        while True:
            ready = self.ready
            notice = self._notice()
            if notice is not None:
                await self._on_notice(notice)
                deadline = time.monotonic() + timeout_s
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportTimeout(ready.first_stage, "a token", timeout_s)
            frames = await self._receive(left)
            if frames is None:
                continue  # a notice came first
            try:
                message = self.connection.decode_sink_typed(frames)
            except ProtocolError as exc:
                log.warning("dropped_message", peer="sink", error=str(exc))
                continue
            current = message.epoch == ready.epoch and getattr(message, "run", None) == ready.run
            match message:
                case GenTokenBatch() if current and message.src == ready.first_stage:
                    self._pending.extend(
                        e for e in events_from_wire(message.events) if self._received(e)
                    )
                    if self._pending:
                        return self._pending.popleft()
                    continue
                case GenToken() if current and message.src == ready.first_stage:
                    event = TokenEvent(
                        message.sequence,
                        message.index,
                        message.token,
                        message.text or "",
                        finish_from_wire(message.finish, "gen_token"),
                    )
                    if self._received(event):
                        return event
                    continue
                case GenRefused() if current:
                    if message.sequence in self._sent:
                        self._sent[message.sequence].over = True
                    raise SequenceRefused(
                        message.sequence, message.error, kind=kind_from_wire(message.kind)
                    )
            # an earlier plan's events (the tokens a re-plan makes again) are dropped
            log.debug("dropped_message", peer="sink", kind=message.KIND, error="not this run's")

    def _received(self, event: TokenEvent) -> bool:
        """Whether ``event`` is the next of its sequence (a sequence this run did not
        submit passes as it is)."""
        sent = self._sent.get(event.sequence)
        if sent is None:
            return True
        expected = len(sent.tokens)
        if event.index < expected:  # already streamed: never twice
            log.warning("duplicate_token_dropped", sequence=event.sequence, index=event.index)
            return False
        if event.index > expected:
            raise ProtocolError(
                f"sequence {event.sequence}: token {event.index} came, {expected} was next"
            )
        sent.tokens.append(event.token)
        sent.over = event.finish_reason is not None
        return True

    def _notice(self) -> StageFailed | RunReplanned | None:
        """The next notice of the coordinator about this run, if one is waiting."""
        failures = self.connection.control.failures
        while not failures.empty():
            notice = failures.get_nowait()
            if notice.run == self.run:
                return notice
            log.warning("notice_ignored", run=self.run, kind=notice.KIND, of_run=notice.run)
        return None

    async def _receive(self, timeout_s: float) -> list[Any] | None:
        """The sink's next message, or None when a notice of the coordinator comes
        first (it stays queued for :meth:`_notice`)."""
        assert self.ready is not None
        failures = self.connection.control.failures
        with self.connection.reading_sink() as sink:
            receiving = asyncio.ensure_future(
                recv_frames(
                    sink, timeout_s=timeout_s, peer=self.ready.first_stage, awaited="a token"
                )
            )
            noticed = asyncio.ensure_future(_wait_not_empty(failures))
            try:
                done, _ = await asyncio.wait(
                    {receiving, noticed}, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                for task in (receiving, noticed):
                    if not task.done():
                        task.cancel()
                # a receive cancelled in flight is waited out, so no frame is half-taken
                await asyncio.gather(receiving, noticed, return_exceptions=True)
        if receiving.done() and not receiving.cancelled():
            if receiving.exception() is not None and noticed in done:
                return None  # timed out as the notice came: the notice decides
            return receiving.result()
        return None

    async def _on_notice(self, notice: StageFailed | RunReplanned) -> None:
        ready = self.ready
        assert ready is not None
        match notice:
            case StageFailed():
                raise stage_failed_error(notice)
            case RunReplanned() if notice.epoch > ready.epoch:
                await self._replanned(notice)
            case _:
                log.debug("notice_ignored", run=self.run, kind=notice.KIND, epoch=notice.epoch)

    async def _replanned(self, notice: RunReplanned) -> None:
        """The run goes on over the survivors: send every unfinished sequence to the
        new first stage again, with the tokens it already streamed."""
        ready = self.ready
        assert ready is not None
        plan = Plan.from_dict(notice.plan)
        self.ready = replace(
            ready,
            stages=plan.devices,
            bounds=[[s.start, s.end] for s in plan.stages],
            first_endpoint=notice.first_endpoint,
            first_stage=notice.first_stage,
            first_key=notice.first_key,
            epoch=notice.epoch,
        )
        self.connection.allow_sink_senders([notice.first_key])
        if self._push is not None:
            self._push.close(linger=0)  # what still waits for the old first stage is moot
        self._push = self.connection.push_to(
            notice.first_endpoint, notice.first_key, notice.first_stage
        )
        again = [seq for seq, sent in sorted(self._sent.items()) if not sent.over]
        self.recoveries.append(
            {
                "dead": notice.dead,
                "stages": plan.devices,
                "detected_s": notice.detected_s,
                "recovered_s": notice.recovered_s,
                "sequences": len(again),
            }
        )
        log.info(
            "generation_replanned",
            run=self.run,
            dead=notice.dead,
            stages=plan.devices,
            epoch=notice.epoch,
            sequences=again,
        )
        for sequence in again:
            await self._submit(sequence)

    async def close(self) -> None:
        """End the run: every stage frees its caches. Once; safe when never started."""
        if self._closed or self.ready is None:
            return
        self._closed = True
        try:
            await self._send(GenClose(run=self.run, src=CLIENT, epoch=self._epoch))
        except TransportTimeout as exc:  # a gone first stage frees nothing anyway
            log.warning("generation_close_not_sent", run=self.run, error=str(exc))
        finally:
            if self._push is not None:
                # a moment for the close to leave; LINGER bounds it
                self._push.close(linger=1000)
                self._push = None
        try:  # the coordinator stops watching the run's stages for it
            await self.connection.control.ask(
                RunEnd(run=self.run),
                expect=(RunReport, RunFailed),
                timeout_s=self.connection.timeouts.reply_s,
                awaited="run_report",
            )
        except ZpipeError as exc:
            log.warning("generation_end_not_acknowledged", run=self.run, error=str(exc))
        if self.connection.open_run == self.run:
            self.connection.open_run = None


async def _wait_not_empty(queue: asyncio.Queue[Any]) -> None:
    """Until ``queue`` holds an item (left in it)."""
    while queue.empty():
        item = await queue.get()
        queue.put_nowait(item)  # at once, with no await between: it is the only item


async def generate(
    connection: ClientConnection,
    model: ModelSpec,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] | None,
    options: GenerateOptions,
) -> AsyncIterator[TokenEvent]:
    """Run ``prompts`` (sequence ``i`` is ``prompts[i]``) and yield every event as it
    comes, until each sequence has finished; the run is closed however it ends."""
    each = params_for(params, len(prompts))
    if not prompts:
        return
    run = GenerationRun(connection, model, options)
    try:
        await run.start()
        for sequence, (prompt, p) in enumerate(zip(prompts, each, strict=True)):
            await run.submit(sequence, prompt, p)
        open_ = set(range(len(prompts)))
        while open_:
            event = await run.next_event()
            if event.sequence not in open_:
                continue
            if event.finish_reason is not None:
                open_.discard(event.sequence)
            yield event
    finally:
        await run.close()
