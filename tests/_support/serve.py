"""Shared pieces of the serve tests: fake and recording backends, a uvicorn server
in a thread on loopback, the tiny language model checkpoint."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zpipe.generation import SamplingParams, TokenEvent


@dataclass
class FakeBackend:
    """Streams ``pieces`` as one token each (ids 0, 1, ...); ``stall_after`` tokens
    in, it waits forever (a stalled pipeline). Records each sequence's fate."""

    pieces: Sequence[str] = ("Hel", "lo", ", ", "world")
    model_id: str = "fake"
    tokenizer: Any | None = None
    max_context: int = 64
    stall_after: int | None = None
    delay_s: float = 0.0
    started: int = 0
    closed: int = 0  # generators that ended early (aclose or cancellation)
    finished: int = 0  # generators that ran to their last event
    params: list[SamplingParams] = field(default_factory=list)
    first_token: threading.Event = field(default_factory=threading.Event)

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        self.started += 1
        self.params.append(params)
        done = False
        try:
            count = min(len(self.pieces), params.max_tokens)
            for i in range(count):
                if self.stall_after is not None and i >= self.stall_after:
                    await asyncio.Event().wait()
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                last = i == count - 1
                reason = ("eos" if count == len(self.pieces) else "length") if last else None
                yield TokenEvent(0, i, i, self.pieces[i], reason)
                self.first_token.set()
            done = True
        finally:
            if done:
                self.finished += 1
            else:
                self.closed += 1


class RecordingBackend:
    """Wraps a real backend; counts the generators that were closed early.
    ``delay_s`` slows each event down (so a test can leave mid-stream for sure)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.delay_s = 0.0
        self.closed = 0
        self.finished = 0
        self.first_token = threading.Event()

    @property
    def model_id(self) -> str:
        return str(self.inner.model_id)

    @property
    def tokenizer(self) -> Any:
        return self.inner.tokenizer

    @property
    def max_context(self) -> int:
        return int(self.inner.max_context)

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        events = self.inner.generate(prompt_ids, params)
        done = False
        try:
            async for event in events:
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                yield event
                self.first_token.set()
            done = True
        finally:
            await events.aclose()
            if done:
                self.finished += 1
            else:
                self.closed += 1


def wait_until(condition: Any, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


@contextmanager
def serving(app: Any, *, timeout: float = 30.0) -> Iterator[str]:
    """Run ``app`` with uvicorn on 127.0.0.1 (a free port) in a thread; yields the
    base URL (``http://127.0.0.1:PORT/v1``)."""
    from zpipe.serve.server import bind, url_of, uvicorn_server

    sock = bind("127.0.0.1", 0)
    server = uvicorn_server(app, log_level="warning")
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(server.serve(sockets=[sock]))
        except BaseException as exc:  # reported to the test below
            failure.append(exc)

    thread = threading.Thread(target=run, name="uvicorn", daemon=True)
    thread.start()
    try:
        # a lifespan that fails to start (a backend's run) ends the thread unstarted
        wait_until(
            lambda: server.started or failure or not thread.is_alive(),
            timeout,
            "uvicorn to start",
        )
        if failure:
            raise failure[0]
        if not server.started:
            raise AssertionError("uvicorn stopped before it started (its lifespan failed?)")
        yield url_of(sock)
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()
        assert not thread.is_alive(), "uvicorn did not stop"


def tiny_lm(directory: Path, family: str = "gpt2") -> Path:
    from zpipe.testing.tiny_lm import save_tiny_lm

    return save_tiny_lm(directory, family=family)  # type: ignore[arg-type]
