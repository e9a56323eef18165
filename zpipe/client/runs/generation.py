"""The embedded API of a pipelined generation run: sequences in, token events out.

::

    async with PipelineClient(coordinator) as client:
        async for event in client.generate(spec, [[5, 17, 3], [9, 1]], stages=3):
            print(event.sequence, event.index, event.token, event.finish_reason)

The client asks the coordinator for the run (``gen_run_request``; the
coordinator sets up the stages, :mod:`zpipe.coordinator.runs.generation`), then
talks to the first stage only: each sequence goes there (``gen_submit``), and the
first stage, which runs the scheduler, streams each sequence's events to this
client's sink (``gen_token``; ``gen_refused`` for one it cannot take). At the end
(or when the caller stops iterating) the client closes the run (``gen_close``),
and every stage frees its caches.

Every wait has a deadline: the coordinator's answer (``result_s``) and each next
event of the run (``token_timeout_s``), so a stage that died mid-run fails the
stream with :class:`~zpipe._errors.TransportTimeout` (recovery comes later).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import zmq.asyncio

from zpipe._errors import ConfigError, PipelineError, ProtocolError, TransportTimeout
from zpipe.client.connection import ClientConnection
from zpipe.generation.params import SamplingParams, TokenEvent
from zpipe.generation.wire import check_dtype, params_to_map
from zpipe.log import get_logger
from zpipe.models import ModelSpec
from zpipe.models.causal_lm import FAMILY, read_causal_lm_config
from zpipe.protocol import REGISTRY
from zpipe.protocol.client_control import RunFailed
from zpipe.protocol.generation import (
    GenCancel,
    GenClose,
    GenRefused,
    GenRunReady,
    GenRunRequest,
    GenSubmit,
    GenToken,
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
            raise PipelineError(f"the generation run failed to start: {answer.error}")
        assert isinstance(answer, GenRunReady)
        self.ready = answer
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
        ids = torch.tensor(list(prompt), dtype=torch.int64)
        submit = GenSubmit(
            run=self.run,
            sequence=sequence,
            src=CLIENT,
            params=params_to_map(params),
            tensors=(ids,),
            epoch=self._epoch,
        )
        await self._send(submit)

    async def cancel(self, sequence: int) -> None:
        await self._send(GenCancel(run=self.run, sequence=sequence, src=CLIENT, epoch=self._epoch))

    @property
    def _epoch(self) -> int:
        assert self.ready is not None
        return self.ready.epoch

    async def next_event(self) -> TokenEvent:
        """The run's next event from the first stage; PipelineError for a refused
        sequence, TransportTimeout when none comes within ``token_timeout_s``."""
        ready = self.ready
        assert ready is not None, "start() the run first"
        timeout_s = self.options.token_timeout_s or self.connection.timeouts.result_s
        while True:
            with self.connection.reading_sink() as sink:
                frames = await recv_frames(
                    sink, timeout_s=timeout_s, peer=ready.first_stage, awaited="a token"
                )
            try:
                message = REGISTRY.parse(self.connection.decode_sink_message(frames))
            except ProtocolError as exc:
                log.warning("dropped_message", peer="sink", error=str(exc))
                continue
            match message:
                case GenToken() if message.run == ready.run and message.src == ready.first_stage:
                    return TokenEvent(
                        message.sequence,
                        message.index,
                        message.token,
                        message.text or "",
                        _finish(message.finish),
                    )
                case GenRefused() if message.run == ready.run:
                    raise PipelineError(f"sequence {message.sequence} was refused: {message.error}")
            log.debug("dropped_message", peer="sink", kind=message.KIND, error="not this run's")

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


def _finish(reason: str | None) -> Any:
    if reason not in (None, "length", "eos", "stop", "cancelled"):
        raise ProtocolError(f"gen_token: unknown finish reason {reason!r}")
    return reason


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
