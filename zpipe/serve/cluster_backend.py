"""A zpipe cluster's pipelined generation run as a :class:`GenerationBackend`.

The endpoint stays the same; the model runs across a cluster's stages. The
tokenizer and chat template come from the checkpoint directory here (the
endpoint renders prompts); the first stage reads the same directory's tokenizer
for the text it streams and the stop strings it honours, and applies every rule
of the request's :class:`~zpipe.generation.SamplingParams` with the generation
core (:class:`~zpipe.generation.SequenceScheduler`,
:class:`~zpipe.generation.StopChecker`), as the single-process backend does in
its own loop.

**One long-lived run serves every request.** The backend starts one generation
run (:class:`~zpipe.client.runs.generation.GenerationRun`) and submits each
request's prompt to it as a new sequence; the first stage's scheduler lets it
join between two steps, so concurrent requests share the pipeline's steps (their
decode rows batched, the ring kept full) instead of taking turns. A run per
request would not work: setting a run up loads the model on every stage (seconds),
and a stage holds one generation run at a time, so a second request's run would
end the first's. One reader task takes the run's events from the client's sink
and hands each to its request's queue.

Failures, in the API's shape (:mod:`zpipe.serve.errors`):

- a sequence the first stage refuses, by the refusal's kind (``gen_refused``'s,
  :mod:`zpipe.generation.refusals`): a prompt too long for the run's context or a
  reservation the KV cache can never hold, 400 with the stage's reason; a step a
  stage could not compute, 500;
- a run that cannot start (too few stages, the coordinator gone): 503;
- a run that streams nothing for ``token_timeout_s`` while requests wait (a
  stage died or stalled, or another run took the stages): every waiting request
  gets 504 (or an error event mid-stream) and the next request starts a new run;
- an HTTP client that goes away: the endpoint closes the request's generator,
  which sends ``gen_cancel``; the first stage drops the sequence and every stage
  frees its cache.

Every wait has a deadline: the run's start (the coordinator's answer), each send
to the first stage (the client's send timeout), each next event of a request
(``token_timeout_s``).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zpipe._errors import (
    ConfigError,
    PipelineError,
    SequenceRefused,
    TransportTimeout,
    ZpipeError,
)
from zpipe.client import PipelineClient
from zpipe.client.runs.generation import GenerateOptions, GenerationRun
from zpipe.generation import SamplingParams, TokenEvent
from zpipe.log import get_logger
from zpipe.models import ModelSpec
from zpipe.models.causal_lm import FAMILY, causal_lm_spec, read_causal_lm_config
from zpipe.serve.errors import (
    ApiError,
    cluster_timeout,
    cluster_unavailable,
    sequence_refused,
)

if TYPE_CHECKING:
    from starlette.applications import Starlette

log = get_logger("zpipe.serve")

DEFAULT_TOKEN_TIMEOUT_S = 120.0

_Item = TokenEvent | ApiError  # what the reader hands a request


@dataclass
class _Live:
    """The run serving requests now."""

    run: GenerationRun
    streams: dict[int, asyncio.Queue[_Item]] = field(default_factory=dict)
    ids: Iterator[int] = field(default_factory=itertools.count)
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    progress_at: float = field(default_factory=time.monotonic)  # the last event or submit
    reader: asyncio.Task[None] | None = None
    failure: ApiError | None = None  # set once the run is lost: every request gets it
    late: int = 0  # events of sequences no request waits for (cancelled ones in flight)


class ClusterBackend:
    """Serve ``model`` (a ``causal_lm`` spec of a checkpoint directory) through the
    generation run ``client`` starts on its cluster; ``options`` say which stages
    and how many sequences at once (see the module docstring).

    ``start()`` opens ``client`` if it is not open (then ``aclose()`` closes it)
    and starts the run; ``generate`` starts it too when it is not running (the
    first request, or the next one after the run was lost). Use it as an async
    context manager, or let :func:`~zpipe.serve.app.build_app`'s lifespan start
    and close it."""

    def __init__(
        self,
        client: PipelineClient,
        model: ModelSpec,
        tokenizer: Any | None,
        *,
        model_id: str,
        options: GenerateOptions,
    ) -> None:
        if model.family != FAMILY:
            raise ConfigError(f"a cluster backend serves a {FAMILY!r} model, not {model.family!r}")
        config = read_causal_lm_config(model.config)
        self._client = client
        self._model = model
        self._tokenizer = tokenizer
        self._model_id = model_id
        # with a tokenizer the first stage streams text and honours stop strings
        self._options = replace(options, text=tokenizer is not None)
        self._max_context = options.max_context or config.max_positions
        self._vocab = config.vocab_size
        self._token_timeout_s = options.token_timeout_s or client.timeouts.result_s
        self._live: _Live | None = None
        self._start_lock = asyncio.Lock()
        self._owns_client = False
        self._closed = False
        self.runs_started = 0
        self.live_sequences = 0  # generators started and not yet ended or closed
        self.cancelled = 0  # sequences cancelled on the cluster (their client left)

    @classmethod
    def from_checkpoint(
        cls,
        directory: str | Path,
        client: PipelineClient,
        *,
        model_id: str | None = None,
        options: GenerateOptions | None = None,
        **keywords: Any,
    ) -> ClusterBackend:
        """The backend of a Hugging Face checkpoint directory, which every stage
        reads at the same path; its tokenizer (when it has one) is loaded here.
        The run's settings are ``options`` or :class:`GenerateOptions`' keywords
        (``stages``, ``stage_names``, ``max_sequences``, ``token_timeout_s``...)."""
        path = Path(directory)
        if not path.is_dir():
            raise ConfigError(f"--model {directory}: not a directory")
        settings = GenerateOptions.from_keywords(options, keywords)
        return cls(
            client,
            causal_lm_spec(path),
            load_tokenizer(path),
            model_id=model_id or path.resolve().name,
            options=settings,
        )

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def tokenizer(self) -> Any | None:
        return self._tokenizer

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def run(self) -> int | None:
        """The id of the run serving requests now (None before it starts)."""
        live = self._live
        return None if live is None or live.run.ready is None else live.run.run

    # ---------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> ClusterBackend:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Open the client and start the run; ApiError (503) when it cannot start."""
        await self._ensure_run()

    async def aclose(self) -> None:
        """Close the run (every stage frees its caches) and the client if this opened
        it; requests still waiting get a 503. Once; later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        async with self._start_lock:
            live, self._live = self._live, None
            if live is not None:
                self._fail(live, cluster_unavailable("the server is shutting down"))
                await self._retire(live)
            if self._owns_client:
                await self._client.close()

    # ---------------------------------------------------------------- serving

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        prompt = [int(t) for t in prompt_ids]
        check_prompt(prompt, params, max_context=self._max_context, vocab_size=self._vocab)
        live = await self._ensure_run()
        sequence = next(live.ids)
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        live.streams[sequence] = queue
        self.live_sequences += 1
        over = False  # the cluster has nothing more of this sequence: nothing to cancel
        try:
            await self._submit(live, sequence, prompt, params)
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), self._token_timeout_s)
                except asyncio.TimeoutError:
                    raise cluster_timeout(self._token_timeout_s) from None
                if isinstance(item, ApiError):
                    over = True
                    raise item
                over = item.finish_reason is not None
                yield item
                if over:
                    return
        finally:
            live.streams.pop(sequence, None)
            self.live_sequences -= 1
            if not over:
                await self._cancel(live, sequence)

    async def _submit(
        self, live: _Live, sequence: int, prompt: list[int], params: SamplingParams
    ) -> None:
        if live.failure is not None:
            raise live.failure
        try:
            await self._send(live, lambda: live.run.submit(sequence, prompt, params))
        except (asyncio.TimeoutError, TransportTimeout) as exc:  # the first stage is unreachable
            error = cluster_unavailable(exc)
            self._fail(live, error)
            raise error from exc
        live.progress_at = time.monotonic()

    async def _cancel(self, live: _Live, sequence: int) -> None:
        """Tell the first stage to drop ``sequence`` (its client went away)."""
        if live.failure is not None or live is not self._live:
            return  # a lost or closed run holds nothing to free
        self.cancelled += 1
        try:
            await self._send(live, lambda: live.run.cancel(sequence))
        except (asyncio.TimeoutError, TransportTimeout) as exc:
            log.warning("serve.cancel_not_sent", sequence=sequence, error=str(exc))
            return
        log.info("serve.sequence_cancelled", run=live.run.run, sequence=sequence)

    async def _send(self, live: _Live, send: Callable[[], Awaitable[None]]) -> None:
        """One message to the first stage: one at a time (requests send from their
        own tasks), waiting for the others within the client's send timeout."""

        async def locked() -> None:
            async with live.send_lock:
                await send()

        await asyncio.wait_for(locked(), self._client.timeouts.send_s)

    # ---------------------------------------------------------------- the run

    async def _ensure_run(self) -> _Live:
        """The run serving requests: the current one, or a new one in place of a
        lost one (one start at a time)."""
        async with self._start_lock:
            if self._closed:
                raise cluster_unavailable("the server is shutting down")
            live = self._live
            if live is not None and live.failure is None:
                return live
            if live is not None:
                self._live = None
                await self._retire(live)
            await self._open_client()
            run = GenerationRun(self._client.connection, self._model, self._options)
            try:
                ready = await run.start()
            except (ZpipeError, OSError) as exc:
                log.warning("serve.cluster_run_failed", error=str(exc))
                raise cluster_unavailable(exc) from exc
            live = _Live(run)
            live.reader = asyncio.ensure_future(self._read(live))
            self._live = live
            self.runs_started += 1
            log.info(
                "serve.cluster_run_started", run=ready.run, stages=ready.stages, bounds=ready.bounds
            )
            return live

    async def _open_client(self) -> None:
        try:
            self._client.connection  # noqa: B018 -- raises PipelineError when not open
        except PipelineError:
            await self._client.open()
            self._owns_client = True

    async def _read(self, live: _Live) -> None:
        """Hand each of the run's events to its request, until the run is lost."""
        try:
            while True:
                try:
                    event = await live.run.next_event()
                except SequenceRefused as exc:
                    live.progress_at = time.monotonic()
                    self._deliver(live, exc.sequence, sequence_refused(exc.error, exc.kind))
                    continue
                except TransportTimeout:
                    # quiet with nobody waiting is fine; quiet while requests wait
                    # for the whole deadline means a stage died or stalled
                    stalled = time.monotonic() - live.progress_at >= self._token_timeout_s
                    if live.streams and stalled:
                        log.warning("serve.cluster_run_stalled", run=live.run.run)
                        self._fail(live, cluster_timeout(self._token_timeout_s))
                        return
                    continue
                live.progress_at = time.monotonic()
                self._deliver(live, event.sequence, event)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the run cannot go on: every waiting request hears it
            log.error("serve.cluster_run_lost", run=live.run.run, error=repr(exc))
            self._fail(live, cluster_unavailable(exc))

    @staticmethod
    def _deliver(live: _Live, sequence: int, item: _Item) -> None:
        queue = live.streams.get(sequence)
        if queue is None:  # a cancelled sequence's events still in flight
            live.late += 1
            return
        queue.put_nowait(item)

    @staticmethod
    def _fail(live: _Live, error: ApiError) -> None:
        if live.failure is None:
            live.failure = error
        for queue in live.streams.values():
            queue.put_nowait(error)

    async def _retire(self, live: _Live) -> None:
        """Stop the run's reader and close the run (each send bounded)."""
        if live.reader is not None:
            live.reader.cancel()
            await asyncio.gather(live.reader, return_exceptions=True)
        await live.run.close()
        log.info("serve.cluster_run_closed", run=live.run.run, late_events=live.late)


def check_prompt(
    prompt: Sequence[int], params: SamplingParams, *, max_context: int, vocab_size: int
) -> None:
    """What the run would refuse, refused here first (a ConfigError: the endpoint's
    400) without a trip to the cluster."""
    if not prompt:
        raise ConfigError("the prompt is empty")
    if len(prompt) + params.max_tokens > max_context:
        raise ConfigError(
            f"{len(prompt)} prompt tokens + max_tokens {params.max_tokens} exceed "
            f"the context length {max_context}"
        )
    if any(t < 0 or t >= vocab_size for t in prompt):
        raise ConfigError(f"token ids must be in 0..{vocab_size - 1}")


def load_tokenizer(directory: Path) -> Any | None:
    """The checkpoint directory's tokenizer, or None (no tokenizer files, or no
    ``transformers``): then prompts are token ids and no stop strings apply."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    try:
        return AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError):
        return None


def cluster_app(
    directory: str | Path,
    coordinator: str,
    *,
    keys_dir: Path | None = None,
    model_id: str | None = None,
    token_timeout: float = DEFAULT_TOKEN_TIMEOUT_S,
    client: PipelineClient | None = None,
    **options: Any,
) -> Starlette:
    """The OpenAI-compatible application serving ``directory``'s model through the
    cluster of ``coordinator``, for embedding in an ASGI server::

        app = cluster_app("/models/tiny-lm", "tcp://hub:5555", stages=3)
        uvicorn.run(app, port=8000)

    The run starts with the application (its lifespan) and closes with it.
    ``options``: :class:`GenerateOptions`' keywords (``stages``, ``stage_names``,
    ``partition``, ``max_sequences``, ...); ``client``: a
    :class:`~zpipe.client.PipelineClient` of your own (then ``coordinator`` and
    ``keys_dir`` are its)."""
    from zpipe.serve.app import build_app

    options.setdefault("token_timeout_s", token_timeout)
    backend = ClusterBackend.from_checkpoint(
        directory,
        client or PipelineClient(coordinator, keys_dir=keys_dir),
        model_id=model_id,
        **options,
    )
    return build_app(backend, token_timeout=token_timeout)
