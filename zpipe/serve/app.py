"""The HTTP application: OpenAI's ``/v1/models``, ``/v1/completions`` and
``/v1/chat/completions`` over a :class:`~zpipe.serve.backend.GenerationBackend`.

Every wait on the backend has a deadline (``token_timeout``): a backend that
produces no next token in time ends a stream with an error event, or answers
504 before a stream starts, and its sequence is cancelled; nothing hangs. A
streamed response starts only once the first token is there, so a request the
backend refuses still gets a proper status. When the HTTP client goes away
mid-generation (streamed or not), the backend's generator is closed, which
cancels the sequence in the backend.

Starlette is imported here, so this module is only imported when serving.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from zpipe._errors import ConfigError
from zpipe.generation import FinishReason, TokenEvent
from zpipe.log import get_logger
from zpipe.serve.backend import GenerationBackend
from zpipe.serve.chat import chat_prompt_ids
from zpipe.serve.errors import ApiError, backend_timeout, context_length_exceeded, unknown_model
from zpipe.serve.requests import Endpoint, GenerationRequest, parse_request
from zpipe.serve.responses import DONE, ResponseHead, Usage, model_card, model_list, sse

log = get_logger("zpipe.serve")

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
DEFAULT_TOKEN_TIMEOUT_S = 120.0
BODY_TIMEOUT_S = 30.0  # a client that takes longer to send its request is dropped
MAX_BODY_BYTES = 8 * 2**20  # a prompt is text: 8 MiB is far past any context
CLOSE_TIMEOUT_S = 30.0  # a backend cancelling a sequence (its clean-up), at most


def build_app(
    backend: GenerationBackend, *, token_timeout: float = DEFAULT_TOKEN_TIMEOUT_S
) -> Starlette:
    """The ASGI application serving ``backend`` (run it with uvicorn)."""
    if not token_timeout > 0:
        raise ConfigError(f"token_timeout must be > 0 s, got {token_timeout!r}")
    api = _Api(backend, token_timeout)
    routes = [
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
    ]
    return Starlette(
        routes=routes,
        exception_handlers={HTTPException: _http_error, ApiError: _api_error},
        lifespan=_lifespan(backend),
    )


def _lifespan(
    backend: GenerationBackend,
) -> Callable[[Starlette], AbstractAsyncContextManager[None]]:
    """A backend with ``start()`` and ``aclose()`` (the cluster's: its generation run
    and client live in the server's event loop) starts with the application and
    closes with it; any other backend has nothing to do."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        start = getattr(backend, "start", None)
        aclose = getattr(backend, "aclose", None)
        if start is not None:
            await start()
        try:
            yield
        finally:
            if aclose is not None:
                await aclose()

    return lifespan


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 and 405 (no such path, wrong method) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    elif exc.status_code == 404:
        message = f"no such endpoint: {request.method} {request.url.path}"
    else:
        message = str(exc.detail)
    error = ApiError(message, status=exc.status_code, code=f"http_{exc.status_code}")
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)


class _Api:
    def __init__(self, backend: GenerationBackend, token_timeout: float) -> None:
        self.backend = backend
        self.token_timeout = token_timeout
        self.created = int(time.time())

    async def models(self, request: Request) -> Response:
        return JSONResponse(model_list(self.backend.model_id, self.created))

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name != self.backend.model_id:
            raise unknown_model(name)
        return JSONResponse(model_card(name, self.created))

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completions")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def _generate(self, request: Request, endpoint: Endpoint) -> Response:
        raw = await _read_body(request)
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ApiError(f"We could not parse the JSON body of your request: {exc}") from exc
        parsed = parse_request(body, endpoint)
        if parsed.model != self.backend.model_id:
            raise unknown_model(parsed.model)
        if parsed.stop and self.backend.tokenizer is None:
            raise ApiError(
                "stop sequences need text, and this model has no tokenizer",
                param="stop",
                code="no_tokenizer",
            )
        prompt_ids = self._prompt_ids(parsed)
        params = parsed.params(self._budget(parsed, len(prompt_ids)), secrets.randbelow(2**31))
        prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
        head = ResponseHead(
            endpoint, f"{prefix}-{uuid.uuid4().hex}", int(time.time()), self.backend.model_id
        )
        events = self.backend.generate(prompt_ids, params)
        if parsed.stream:
            first = await self._first(events)
            stream = self._stream(head, events, first, len(prompt_ids), parsed.include_usage)
            return StreamingResponse(
                stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        return await self._whole(request, head, events, len(prompt_ids))

    # ------------------------------------------------------------------ prompt

    def _prompt_ids(self, parsed: GenerationRequest) -> list[int]:
        tokenizer = self.backend.tokenizer
        if parsed.endpoint == "chat":
            ids = chat_prompt_ids(tokenizer, parsed.messages)
        elif isinstance(parsed.prompt, str):
            if tokenizer is None:
                raise ApiError(
                    "this model has no tokenizer: give the prompt as a list of token ids",
                    param="prompt",
                    code="no_tokenizer",
                )
            ids = list(tokenizer(parsed.prompt)["input_ids"])
        else:
            ids = list(parsed.prompt or ())
            if tokenizer is not None and any(t >= len(tokenizer) for t in ids):
                raise ApiError(
                    f"a token id is outside the vocabulary (0..{len(tokenizer) - 1})",
                    param="prompt",
                )
        if not ids:
            raise ApiError("the prompt is empty after tokenization", param="prompt")
        return ids

    def _budget(self, parsed: GenerationRequest, prompt_tokens: int) -> int:
        """max_tokens as asked, or the default; refused past the context length."""
        limit = self.backend.max_context
        param = "messages" if parsed.endpoint == "chat" else "prompt"
        if parsed.max_tokens is not None:
            wanted = parsed.max_tokens
        elif parsed.endpoint == "chat":  # chat's default: whatever the context leaves
            wanted = max(1, limit - prompt_tokens)
        else:
            wanted = DEFAULT_COMPLETION_TOKENS
        if prompt_tokens + wanted > limit:
            raise context_length_exceeded(param, prompt_tokens, wanted, limit)
        return wanted

    # ------------------------------------------------------------------ waiting

    async def _next(self, events: AsyncIterator[TokenEvent]) -> TokenEvent | None:
        """The backend's next event within the deadline; None at the end."""
        try:
            return await asyncio.wait_for(anext(events), self.token_timeout)
        except StopAsyncIteration:
            return None
        except asyncio.TimeoutError as exc:
            log.warning("serve.backend_timeout", timeout_s=self.token_timeout)
            raise backend_timeout(self.token_timeout) from exc
        except ApiError:
            raise
        except ConfigError as exc:  # the backend refused the request (a bad value)
            raise ApiError(str(exc)) from exc
        except Exception as exc:
            log.error("serve.backend_failed", error=repr(exc), exc_info=exc)
            raise ApiError(
                f"the model failed: {type(exc).__name__}: {exc}",
                status=500,
                type="server_error",
                code="backend_error",
            ) from exc

    async def _first(self, events: AsyncIterator[TokenEvent]) -> TokenEvent | None:
        try:
            return await self._next(events)
        except BaseException:
            await _close(events)
            raise

    async def _whole(
        self,
        request: Request,
        head: ResponseHead,
        events: AsyncIterator[TokenEvent],
        prompt_tokens: int,
    ) -> Response:
        """Collect the whole completion, cancelling it if the client goes away."""
        collect = asyncio.ensure_future(self._collect(events))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client went away: cancel the sequence
                collect.cancel()
            await asyncio.gather(collect, gone, return_exceptions=True)
        if collect.cancelled():  # nobody is there to read a response
            return Response(status_code=499)
        pieces, finish, count = collect.result()
        usage = Usage(prompt_tokens, count)
        return JSONResponse(head.response("".join(pieces), finish, usage))

    async def _collect(
        self, events: AsyncIterator[TokenEvent]
    ) -> tuple[list[str], FinishReason | None, int]:
        pieces: list[str] = []
        finish: FinishReason | None = None
        count = 0
        try:
            while (event := await self._next(events)) is not None:
                count += 1
                pieces.append(event.text)
                finish = event.finish_reason or finish
        finally:
            await _close(events)
        return pieces, finish, count

    async def _stream(
        self,
        head: ResponseHead,
        events: AsyncIterator[TokenEvent],
        first: TokenEvent | None,
        prompt_tokens: int,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        """The server-sent events of a streamed response, ending with ``[DONE]``;
        an error mid-stream is an error event (OpenAI's shape) before it."""
        count = 0
        finish: FinishReason | None = None
        try:
            if head.endpoint == "chat":
                yield sse(head.chunk("", first=True))
            event = first
            while event is not None:
                count += 1
                finish = event.finish_reason or finish
                if event.text:
                    yield sse(head.chunk(event.text))
                event = await self._next(events)
            yield sse(head.chunk(None if head.endpoint == "chat" else "", finish or "length"))
            if include_usage:
                yield sse(head.usage_chunk(Usage(prompt_tokens, count)))
        except ApiError as exc:
            yield sse(exc.body())
        finally:
            # a client that went away cancels this generator here: close the
            # backend's stream so that the sequence is cancelled there too
            await _close(events)
        yield DONE


async def _read_body(request: Request) -> bytes:
    """The request's body, at most MAX_BODY_BYTES, within BODY_TIMEOUT_S."""

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise ApiError(
                    f"the request body is larger than {MAX_BODY_BYTES} bytes",
                    status=413,
                    code="request_too_large",
                )
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), BODY_TIMEOUT_S)
    except asyncio.TimeoutError as exc:
        raise ApiError(
            f"the request body did not arrive within {BODY_TIMEOUT_S:g} s",
            status=408,
            code="request_timeout",
        ) from exc


async def _close(events: AsyncIterator[Any]) -> None:
    """Close the backend's stream (cancelling its sequence), within CLOSE_TIMEOUT_S.

    The close runs in a task of its own and is shielded: when the request itself
    is being cancelled (its client went away), the backend's clean-up still runs
    to its end instead of being cut off at its first await."""
    aclose = getattr(events, "aclose", None)
    if aclose is None:
        return
    task = asyncio.ensure_future(asyncio.wait_for(aclose(), CLOSE_TIMEOUT_S))
    _closing.add(task)
    task.add_done_callback(_closed)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        raise
    except Exception:  # reported by _closed; nothing more to do here
        pass


_closing: set[asyncio.Future[Any]] = set()  # closes in flight (a task needs a reference)


def _closed(task: asyncio.Future[Any]) -> None:
    _closing.discard(task)
    if task.cancelled() or task.exception() is None:
        return
    error = task.exception()
    if isinstance(error, RuntimeError) and "already running" in str(error):
        # a cancelled wait left its anext() running in a task of its own (anyio
        # cancels a request's task again and again, and wait_for then stops
        # waiting for its inner task): that task unwinds the generator, clean-up
        # included, so there is nothing to close here
        log.debug("serve.backend_closing_in_its_task")
        return
    log.warning("serve.backend_close_failed", error=repr(error))


async def _disconnected(request: Request) -> None:
    """Returns once the HTTP client has gone away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
