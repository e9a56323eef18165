"""The cluster backend against a scripted generation run (no sockets): each event
reaches its own request, refusals and a lost run become the API's errors, a
request closed early cancels its sequence, a lost run is replaced by the next
request; and the pure mappings (the first stage's refusals, prompt checks)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from zpipe._errors import ConfigError, PipelineError, SequenceRefused, TransportTimeout
from zpipe.client.runs.generation import GenerateOptions
from zpipe.config import Timeouts
from zpipe.generation import SamplingParams, TokenEvent
from zpipe.models import ModelSpec
from zpipe.serve import cluster_backend
from zpipe.serve.cluster_backend import ClusterBackend, check_prompt, cluster_app
from zpipe.serve.errors import ApiError, cluster_timeout, cluster_unavailable, sequence_refused

GREEDY = SamplingParams(max_tokens=4)


@dataclass
class _Ready:
    run: int
    stages: list[str] = field(default_factory=lambda: ["s0", "s1", "s2"])
    bounds: list[list[int]] = field(default_factory=lambda: [[0, 1], [1, 2], [2, 5]])


class FakeRun:
    """A GenerationRun whose events the test puts in ``events`` (an exception is
    raised from next_event); records what the backend sends."""

    made: list[FakeRun] = []
    fail_start: Exception | None = None

    def __init__(self, connection: Any, model: ModelSpec, options: GenerateOptions) -> None:
        self.options = options
        self.events: asyncio.Queue[Any] = asyncio.Queue()
        self.submitted: list[tuple[int, list[int], SamplingParams]] = []
        self.cancelled: list[int] = []
        self.closed = False
        self.ready: _Ready | None = None
        FakeRun.made.append(self)

    @property
    def run(self) -> int:
        assert self.ready is not None
        return self.ready.run

    async def start(self) -> _Ready:
        if FakeRun.fail_start is not None:
            raise FakeRun.fail_start
        self.ready = _Ready(len(FakeRun.made))
        return self.ready

    async def submit(self, sequence: int, prompt: list[int], params: SamplingParams) -> None:
        self.submitted.append((sequence, prompt, params))

    async def cancel(self, sequence: int) -> None:
        self.cancelled.append(sequence)

    async def next_event(self) -> TokenEvent:
        timeout = self.options.token_timeout_s
        try:
            item = await asyncio.wait_for(self.events.get(), timeout)
        except asyncio.TimeoutError:
            raise TransportTimeout("s0", "a token", timeout or 0) from None
        if isinstance(item, Exception):
            raise item
        return item  # type: ignore[no-any-return]

    async def close(self) -> None:
        self.closed = True


class FakeClient:
    def __init__(self) -> None:
        self.timeouts = Timeouts(send_s=1.0, result_s=5.0)
        self.opened = self.closed = 0

    @property
    def connection(self) -> Any:
        if self.opened == self.closed:
            raise PipelineError("open() the client first")
        return object()

    async def open(self) -> None:
        self.opened += 1

    async def close(self) -> None:
        self.closed += 1


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[FakeRun]:
    monkeypatch.setattr(cluster_backend, "GenerationRun", FakeRun)
    monkeypatch.setattr(FakeRun, "made", [])
    monkeypatch.setattr(FakeRun, "fail_start", None)
    return FakeRun.made


def _backend(token_timeout_s: float = 5.0, tokenizer: Any = None) -> ClusterBackend:
    options = GenerateOptions(stages=3, token_timeout_s=token_timeout_s)
    return ClusterBackend(
        FakeClient(),  # type: ignore[arg-type]
        ModelSpec.preset("gpt2-tiny"),
        tokenizer,
        model_id="tiny",
        options=options,
    )


async def _until(condition: Any, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.001)


def test_each_request_gets_its_own_events_from_one_run(runs: list[FakeRun]) -> None:
    async def scenario() -> tuple[list[TokenEvent], list[TokenEvent]]:
        async with _backend() as backend:
            a = backend.generate([1, 2], GREEDY)
            b = backend.generate([3], GREEDY)
            first_a = asyncio.ensure_future(anext(a))
            first_b = asyncio.ensure_future(anext(b))
            run = runs[0]
            await _until(lambda: len(run.submitted) == 2)
            seq = {tuple(p): s for s, p, _ in run.submitted}
            sa, sb = seq[(1, 2)], seq[(3,)]
            # interleaved, as the first stage streams them
            for event in (
                TokenEvent(sb, 0, 7, "x"),
                TokenEvent(sa, 0, 5, "he"),
                TokenEvent(sa, 1, 6, "llo", "length"),
                TokenEvent(sb, 1, 8, "y", "eos"),
            ):
                run.events.put_nowait(event)
            got_a = [await first_a] + [e async for e in a]
            got_b = [await first_b] + [e async for e in b]
            assert backend.runs_started == 1 and backend.live_sequences == 0
            assert run.cancelled == []  # both finished: nothing to cancel
            return got_a, got_b

    got_a, got_b = asyncio.run(scenario())
    assert [e.text for e in got_a] == ["he", "llo"]
    assert [e.text for e in got_b] == ["x", "y"]
    assert runs[0].closed  # the backend's close closed the run


def test_closing_a_request_early_cancels_its_sequence_on_the_cluster(
    runs: list[FakeRun],
) -> None:
    async def scenario() -> None:
        async with _backend() as backend:
            events = backend.generate([1, 2, 3], GREEDY)
            first = asyncio.ensure_future(anext(events))
            run = runs[0]
            await _until(lambda: run.submitted)
            sequence = run.submitted[0][0]
            run.events.put_nowait(TokenEvent(sequence, 0, 5, "he"))
            assert (await first).text == "he"
            await events.aclose()  # what the endpoint does when its client leaves
            assert run.cancelled == [sequence]
            assert backend.cancelled == 1 and backend.live_sequences == 0
            # its tokens still in flight reach nobody, and the run serves on
            run.events.put_nowait(TokenEvent(sequence, 1, 6, "llo"))
            again = backend.generate([4], GREEDY)
            nxt = asyncio.ensure_future(anext(again))
            await _until(lambda: len(run.submitted) == 2)
            run.events.put_nowait(TokenEvent(run.submitted[1][0], 0, 9, "z", "length"))
            assert (await nxt).text == "z"
            assert backend.runs_started == 1

    asyncio.run(scenario())


def test_a_refused_sequence_gets_the_api_error_and_the_run_serves_on(
    runs: list[FakeRun],
) -> None:
    async def scenario() -> ApiError:
        async with _backend() as backend:
            events = backend.generate([1, 2], SamplingParams(max_tokens=50))
            first = asyncio.ensure_future(anext(events))
            run = runs[0]
            await _until(lambda: run.submitted)
            detail = (
                f"sequence {run.submitted[0][0]}: prompt of 2 tokens + max_tokens 50 = 52 "
                "tokens do not fit the KV cache (40 tokens); shorten the prompt"
            )
            run.events.put_nowait(SequenceRefused(run.submitted[0][0], detail, kind="capacity"))
            with pytest.raises(ApiError) as refused:
                await first
            assert run.cancelled == []  # the stage has nothing of it
            assert backend._live is not None and backend._live.failure is None
            return refused.value

    error = asyncio.run(scenario())
    assert (error.status, error.code, error.param) == (400, "capacity_exceeded", "max_tokens")


def test_a_run_that_stalls_fails_its_requests_and_the_next_request_starts_a_new_run(
    runs: list[FakeRun],
) -> None:
    async def scenario() -> tuple[ApiError, ClusterBackend]:
        async with _backend(token_timeout_s=0.2) as backend:
            events = backend.generate([1], GREEDY)
            with pytest.raises(ApiError) as stalled:
                await anext(events)
            # the run streamed nothing for the deadline while a request waited: lost
            await _until(lambda: backend._live is not None and backend._live.failure is not None)
            assert len(runs) == 1
            again = backend.generate([2], GREEDY)
            first = asyncio.ensure_future(anext(again))
            await _until(lambda: len(runs) == 2 and runs[1].submitted)
            assert runs[0].closed  # the lost run was closed before the new one
            runs[1].events.put_nowait(TokenEvent(runs[1].submitted[0][0], 0, 3, "ok", "length"))
            assert (await first).text == "ok"
            return stalled.value, backend

    error, backend = asyncio.run(scenario())
    assert (error.status, error.code) == (504, "cluster_timeout")
    assert backend.runs_started == 2


def test_a_run_that_cannot_start_is_a_503_and_closing_fails_waiting_requests(
    runs: list[FakeRun],
) -> None:
    async def scenario() -> tuple[ApiError, ApiError]:
        backend = _backend()
        FakeRun.fail_start = PipelineError("the generation run failed to start: 2 stages, 1 up")
        with pytest.raises(ApiError) as unavailable:
            await backend.start()
        FakeRun.fail_start = None
        events = backend.generate([1], GREEDY)
        first = asyncio.ensure_future(anext(events))
        await _until(lambda: len(runs) == 2 and runs[1].submitted)
        await backend.aclose()  # the server shuts down with a request waiting
        with pytest.raises(ApiError) as shutting:
            await first
        assert runs[1].closed
        assert backend._client.closed == 1  # type: ignore[attr-defined]
        return unavailable.value, shutting.value

    unavailable, shutting = asyncio.run(scenario())
    assert (unavailable.status, unavailable.code) == (503, "cluster_unavailable")
    assert "1 up" in unavailable.message
    assert shutting.status == 503


def test_a_tokenizer_makes_the_run_stream_text() -> None:
    assert _backend(tokenizer=object())._options.text is True
    assert _backend()._options.text is False
    assert _backend().max_context == 64  # the preset's positions


def test_the_first_stages_refusals_map_to_the_api_errors_by_kind() -> None:
    step = sequence_refused("step 12 failed at stage s1: RuntimeError: boom", "stage_failed")
    assert (step.status, step.type, step.code) == (500, "server_error", "stage_failed")
    context = sequence_refused(
        "sequence 3: prompt of 60 tokens + max_tokens 10 exceed the model's context of 64 tokens",
        "context_length",
    )
    assert (context.status, context.code) == (400, "context_length_exceeded")
    capacity = sequence_refused("sequence 3 needs more than the cache holds", "capacity")
    assert (capacity.status, capacity.code, capacity.param) == (
        400,
        "capacity_exceeded",
        "max_tokens",
    )
    other = sequence_refused("token ids must be below the vocabulary's 100", "bad_request")
    assert (other.status, other.type, other.code) == (
        400,
        "invalid_request_error",
        "sequence_refused",
    )
    assert "vocabulary" in other.message
    # the kind decides, not the words: a stage's text that reads like another kind's
    # (or a refusal without a kind, from an older first stage) stays the request's 400
    for kind in ("bad_request", None):
        worded = sequence_refused("step 4 failed at stage s1: do not fit the KV cache", kind)
        assert (worded.status, worded.code) == (400, "sequence_refused")
    assert cluster_unavailable("gone").body()["error"]["code"] == "cluster_unavailable"
    assert cluster_timeout(2.5).status == 504 and "2.5 s" in cluster_timeout(2.5).message


def test_check_prompt_refuses_what_the_run_would() -> None:
    check_prompt([1, 2], GREEDY, max_context=8, vocab_size=10)
    with pytest.raises(ConfigError, match="empty"):
        check_prompt([], GREEDY, max_context=8, vocab_size=10)
    with pytest.raises(ConfigError, match="context length 8"):
        check_prompt([1] * 5, GREEDY, max_context=8, vocab_size=10)
    with pytest.raises(ConfigError, match=r"0\.\.9"):
        check_prompt([10], GREEDY, max_context=8, vocab_size=10)


class EchoRun(FakeRun):
    """Streams "ab" for each of a sequence's tokens as soon as it is submitted."""

    async def submit(self, sequence: int, prompt: list[int], params: SamplingParams) -> None:
        await super().submit(sequence, prompt, params)
        last = params.max_tokens - 1
        for i in range(params.max_tokens):
            self.events.put_nowait(
                TokenEvent(sequence, i, 5, "ab", "length" if i == last else None)
            )


def test_cluster_app_starts_the_run_with_the_application_and_closes_it_after(
    runs: list[FakeRun], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("starlette")
    pytest.importorskip("transformers")
    from starlette.testclient import TestClient

    from zpipe.testing.tiny_lm import save_tiny_lm

    monkeypatch.setattr(cluster_backend, "GenerationRun", EchoRun)
    checkpoint = save_tiny_lm(tmp_path / "tiny-lm", max_context=64)
    client = FakeClient()
    app = cluster_app(
        checkpoint, "tcp://unused:1", client=client, model_id="tiny", stages=3, max_sequences=2
    )
    with TestClient(app) as http:  # its lifespan starts the backend's run
        assert len(runs) == 1 and runs[0].ready is not None
        options = runs[0].options
        assert (options.stages, options.max_sequences, options.text) == (3, 2, True)
        reply = http.post(
            "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3}
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == "ababab"
        assert runs[0].submitted[0][2].max_tokens == 3
    assert runs[0].closed and client.closed == 1  # closed with the application
