"""The generation client's event stream, fed typed messages in one process (no
sockets): a step's events come in one ``gen_token_batch`` and leave one at a time,
in order; a refusal carries its kind; an older first stage's ``gen_token`` still
reads."""

from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace
from typing import Any

import pytest

from zpipe._errors import ProtocolError, SequenceRefused
from zpipe.client.runs.generation import GenerateOptions, GenerationRun, _Sent
from zpipe.generation.params import SamplingParams, TokenEvent
from zpipe.generation.wire import events_to_wire
from zpipe.models import ModelSpec
from zpipe.protocol import REGISTRY, WireMessage
from zpipe.protocol.generation import GenRefused, GenRunReady, GenToken, GenTokenBatch

SPEC = ModelSpec.preset("gpt2-tiny")
EPOCH = 2


def _run(messages: list[WireMessage]) -> GenerationRun:
    """A run whose sink yields ``messages`` in order (then nothing: a timeout)."""
    connection: Any = SimpleNamespace(
        control=SimpleNamespace(failures=asyncio.Queue()),
        timeouts=SimpleNamespace(result_s=5.0, send_s=1.0),
        decode_sink_typed=REGISTRY.parse,  # the sink's messages are Messages here
    )
    run = GenerationRun(connection, SPEC, GenerateOptions(stages=2, token_timeout_s=0.2))
    run.ready = GenRunReady(
        run=7,
        stages=["s0", "s1"],
        bounds=[[0, 2], [2, 4]],
        first_endpoint="tcp://s0:1",
        first_stage="s0",
        epoch=EPOCH,
    )
    queue = deque(m.to_message() for m in messages)
    received: list[int] = []

    async def receive(timeout_s: float) -> Any:
        received.append(1)
        if not queue:
            await asyncio.sleep(timeout_s)
            return None
        return queue.popleft()

    run._receive = receive  # type: ignore[method-assign]
    run.frames_read = received  # type: ignore[attr-defined]
    for sequence in (0, 1, 2):  # as submitted (no send here)
        run._sent[sequence] = _Sent((1, 2, 3), SamplingParams(max_tokens=3))
    return run


def _batch(*events: TokenEvent, epoch: int = EPOCH) -> GenTokenBatch:
    return GenTokenBatch(run=7, src="s0", events=events_to_wire(events), epoch=epoch)


def _read(run: GenerationRun, count: int) -> list[TokenEvent]:
    async def go() -> list[TokenEvent]:
        return [await run.next_event() for _ in range(count)]

    return asyncio.run(go())


def test_a_steps_batch_is_handed_out_one_event_at_a_time_in_order() -> None:
    step0 = [TokenEvent(2, 0, 11), TokenEvent(0, 0, 12), TokenEvent(1, 0, 13)]
    step1 = [TokenEvent(0, 1, 21, "x", None), TokenEvent(2, 1, 22, "", "eos")]
    run = _run([_batch(*step0), _batch(*step1)])
    got = _read(run, 5)
    assert got == [*step0, *step1]
    assert len(run.frames_read) == 2  # type: ignore[attr-defined]  # two messages, five events
    # each event counted in its sequence's tokens as it came (what a re-plan resends)
    assert [run._sent[s].tokens for s in (0, 1, 2)] == [[12, 21], [13], [11, 22]]
    assert run._sent[2].over and not run._sent[0].over


def test_an_old_plans_batch_and_a_repeated_event_are_dropped_and_a_gap_refused() -> None:
    old = _batch(TokenEvent(0, 0, 99), epoch=EPOCH - 1)
    run = _run([old, _batch(TokenEvent(0, 0, 5), TokenEvent(0, 0, 5), TokenEvent(1, 0, 6))])
    assert _read(run, 2) == [TokenEvent(0, 0, 5), TokenEvent(1, 0, 6)]
    gap = _run([_batch(TokenEvent(0, 1, 5))])
    with pytest.raises(ProtocolError, match="token 1 came, 0 was next"):
        _read(gap, 1)


def test_a_refusal_carries_its_kind_and_an_older_first_stages_token_still_reads() -> None:
    single = GenToken(run=7, sequence=1, index=0, token=4, src="s0", finish="length", epoch=EPOCH)
    refused = GenRefused(
        run=7, sequence=0, src="s0", error="too long", kind="context_length", epoch=EPOCH
    )
    unknown = GenRefused(run=7, sequence=2, src="s0", error="why", kind="newer", epoch=EPOCH)
    run = _run([single, refused, unknown])
    assert _read(run, 1) == [TokenEvent(1, 0, 4, "", "length")]
    with pytest.raises(SequenceRefused) as info:
        _read(run, 1)
    assert (info.value.sequence, info.value.kind, info.value.error) == (
        0,
        "context_length",
        "too long",
    )
    with pytest.raises(SequenceRefused) as later:
        _read(run, 1)
    assert later.value.kind is None  # a kind this version does not know
