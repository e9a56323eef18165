"""The generation executor's routing, fed messages in one process (no sockets): what
each stage accepts from whom, what it sends where, and what it counts and drops."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import pytest
import torch

from zpipe._errors import ProtocolError, TransportTimeout
from zpipe.generation.params import SamplingParams, TokenEvent
from zpipe.generation.wire import events_from_wire, params_to_map
from zpipe.models import ModelSpec
from zpipe.protocol import REGISTRY, WireMessage
from zpipe.protocol.generation import (
    GenClose,
    GenReady,
    GenRefused,
    GenSetup,
    GenStep,
    GenStepFailed,
    GenSubmit,
    GenTokenBatch,
    GenTokens,
)
from zpipe.stage.executors import generation as module
from zpipe.stage.executors.generation import RECEIVE_TASK, GenerationExecutor
from zpipe.stage.supervision import TaskSupervisor
from zpipe.transport.codec import Message

SPEC = ModelSpec.preset("gpt2-tiny")  # 4 units
EPOCH = 3
GREEDY = params_to_map(SamplingParams(max_tokens=2, stop_at_eos=False))


class _Socket:
    def close(self, linger: int | None = None) -> None:
        pass


class _Port:
    def getsockopt(self, option: int) -> int:
        return -1  # no limit: nothing to reopen


class _Ring:
    """One executor of a ring of stages s0..s{n-1}, its sends recorded by peer."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        index: int,
        n: int,
        spec: ModelSpec = SPEC,
        *,
        text: bool = False,
    ) -> None:
        self.control: list[Message] = []
        self.sent: list[tuple[str, WireMessage]] = []
        self.unreachable: set[str] = set()

        async def send_control(message: Message) -> None:
            self.control.append(message)

        async def nothing(*_: Any) -> None:
            return None

        async def send(sock: Any, message: Message, *, timeout_s: float, peer: str) -> int:
            if peer in self.unreachable:
                raise TransportTimeout(peer, "room in its queue", timeout_s)
            self.sent.append((peer, REGISTRY.parse(message)))
            return 0

        monkeypatch.setattr(module, "send", send)
        self.executor = GenerationExecutor(
            name=f"s{index}",
            data_in=lambda: _Port(),  # type: ignore[arg-type,return-value]
            data_allow=None,
            connector=lambda endpoint, key, peer: _Socket(),  # type: ignore[arg-type,return-value]
            compute=ThreadPoolExecutor(max_workers=1),
            supervisor=TaskSupervisor(f"s{index}", lambda name, error: None),
            send_control=send_control,
            stop_data=nothing,
            apply_limits=nothing,
            max_message_bytes=1 << 20,
            send_timeout_s=1.0,
        )
        bounds = [(0, 2), (2, 4)] if n == 2 else [(0, 1), (1, 3), (3, 4)]
        self.setup = GenSetup(
            run=9,
            model=spec.to_dict(),
            start=bounds[index][0],
            end=bounds[index][1],
            index=index,
            num_stages=n,
            upstream=f"s{(index - 1) % n}",
            downstream=f"s{(index + 1) % n}",
            downstream_endpoint="tcp://next:1",
            max_context=32,
            max_sequences=4,
            steps_in_flight=n,
            chunk_tokens=8,
            sink_endpoint="tcp://client:9" if index == 0 else None,
            text=text or None,
            epoch=EPOCH,
        )

    async def start(self) -> None:
        await self.executor.on_control(self.setup)
        # no socket to receive on here: the test hands messages to _on_data itself
        await self.executor._supervisor.stop([RECEIVE_TASK])
        (ready,) = self.control
        assert GenReady.from_message(ready).error == ""

    async def settle(self) -> None:
        """Until every item handed to the stage's work queue is carried out."""
        state = self.executor.state
        assert state is not None
        await asyncio.wait_for(state.queue.join(), timeout=60.0)

    def to(self, peer: str, kind: type[WireMessage]) -> list[Any]:
        return [m for p, m in self.sent if p == peer and isinstance(m, kind)]

    def events(self) -> list[TokenEvent]:
        """Every token event streamed to the client, in order (a step's in one batch)."""
        return [e for m in self.to("client", GenTokenBatch) for e in events_from_wire(m.events)]


OnData = Callable[[Any], Awaitable[None]]
Scenario = Callable[["_Ring", OnData], Awaitable[None]]


def _run_ring(
    monkeypatch: pytest.MonkeyPatch,
    scenario: Scenario,
    index: int = 0,
    n: int = 2,
    spec: ModelSpec = SPEC,
    *,
    text: bool = False,
    **setup: Any,
) -> None:
    """Run ``scenario(ring, on_data)`` against one started stage of a ring, then close it.

    ``setup`` changes the stage's ``GenSetup`` before it starts."""

    async def main() -> None:
        ring = _Ring(monkeypatch, index, n, spec, text=text)
        if setup:
            ring.setup = replace(ring.setup, **setup)
        await ring.start()
        try:
            await scenario(ring, ring.executor._on_data)
        finally:
            await ring.executor.close()

    asyncio.run(main())


def _submit(sequence: int, *, src: str = "client", run: int = 9, **params: Any) -> GenSubmit:
    return GenSubmit(
        run=run,
        sequence=sequence,
        src=src,
        params={**GREEDY, **params},
        tensors=(torch.tensor([5, 17, 3]),),
        epoch=EPOCH,
    )


def test_the_first_stage_schedules_sends_steps_and_streams_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def scenario(ring: _Ring, on: OnData) -> None:
        await on(_submit(4))
        await ring.settle()
        (step,) = ring.to("s1", GenStep)
        assert step.rows == [[4, 0, 3, 0, 5]]  # prompt of 3, 2 new tokens reserved
        assert step.tensors[0].shape == (3, SPEC.config["n_embd"])  # hidden states
        await on(GenTokens(run=9, step=step.step, src="s1", tokens=[42], epoch=EPOCH))
        await ring.settle()
        (token,) = ring.events()
        assert token == TokenEvent(4, 0, 42, "", None)
        decode = ring.to("s1", GenStep)[-1]
        assert decode.rows == [[4, 3, 1, 1, 5]]  # the token goes round again
        await on(GenTokens(run=9, step=decode.step, src="s1", tokens=[7], epoch=EPOCH))
        await on(GenClose(run=9, src="client", epoch=EPOCH))
        await ring.settle()
        last = ring.events()[-1]
        assert (last.index, last.token, last.finish_reason) == (1, 7, "length")
        assert ring.to("s1", GenClose)  # passed down the stages
        await on(_submit(6))  # the run is over here: counted stale, not scheduled
        assert ring.executor.stale == 1 and ring.executor.state is None

    _run_ring(monkeypatch, scenario)


def test_the_first_stage_refuses_bad_sequences_and_drops_impostors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def scenario(ring: _Ring, on: OnData) -> None:
        await on(_submit(1, top_p=3.0))
        await on(_submit(2, max_tokens=40))  # 3 + 40 tokens exceed the context of 32
        await on(_submit(3, max_tokens=20))
        await on(_submit(3, max_tokens=20))  # the same id again
        refused = ring.to("client", GenRefused)
        assert [(r.sequence, "top_p" in r.error) for r in refused] == [
            (1, True),
            (2, False),
            (3, False),
        ]
        assert "context" in refused[1].error
        # the kind says why, for a program: serve maps it to the API's error
        assert [r.kind for r in refused] == ["bad_request", "context_length", "bad_request"]
        with pytest.raises(ProtocolError, match="must come from 'client'"):
            await on(_submit(7, src="s1"))
        with pytest.raises(ProtocolError, match="must come from 's1'"):
            await on(GenTokens(run=9, step=0, src="client", tokens=[1], epoch=EPOCH))
        await on(_submit(5, run=8))  # another run's: counted, not computed
        assert ring.executor.stale == 1
        assert not ring.to("s1", GenStep)

    _run_ring(monkeypatch, scenario)


def test_a_middle_stage_passes_steps_and_failures_on_and_takes_them_from_upstream_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def scenario(ring: _Ring, on: OnData) -> None:
        hidden = torch.randn(3, SPEC.config["n_embd"])
        step = GenStep(
            run=9,
            step=0,
            src="s0",
            rows=[[4, 0, 3, 0, 5]],
            sampling=[[0.0, 0, 1.0, 0]],
            tensors=(hidden,),
            epoch=EPOCH,
        )
        with pytest.raises(ProtocolError, match="must come from 's0'"):
            await on(
                GenStep(
                    run=9,
                    step=0,
                    src="s2",
                    rows=step.rows,
                    sampling=step.sampling,
                    tensors=(hidden,),
                    epoch=EPOCH,
                )
            )
        with pytest.raises(ProtocolError, match="does not belong"):
            await on(_submit(1))
        await on(step)
        # a step that does not continue its sequence's cache fails here and goes on
        await on(
            GenStep(
                run=9,
                step=1,
                src="s0",
                rows=[[4, 9, 1, 0, 12]],
                sampling=[[0.0, 0, 1.0, 0]],
                tensors=(hidden[:1],),
                epoch=EPOCH,
            )
        )
        await ring.settle()
        (forwarded,) = ring.to("s2", GenStep)
        assert forwarded.src == "s1" and forwarded.rows == step.rows
        (failed,) = ring.to("s2", GenStepFailed)
        assert (failed.step, failed.stage, failed.sequences) == (1, "s1", [4])

    _run_ring(monkeypatch, scenario, 1, 3)


def test_a_client_whose_sink_stays_full_closes_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(ring: _Ring, on: OnData) -> None:
        await on(_submit(4))
        await ring.settle()
        (step,) = ring.to("s1", GenStep)
        ring.unreachable.add("client")
        await on(GenTokens(run=9, step=step.step, src="s1", tokens=[42], epoch=EPOCH))
        await ring.settle()
        assert ring.to("s1", GenClose)  # every stage frees its caches
        assert ring.executor.state is None

    _run_ring(monkeypatch, scenario)


def test_a_sequence_stops_at_the_models_end_of_sequence_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = ModelSpec(SPEC.family, {**SPEC.config, "eos_token_id": 42}, seed=SPEC.seed)

    async def scenario(ring: _Ring, on: OnData) -> None:
        await on(_submit(4, max_tokens=5, stop_at_eos=True))
        await on(_submit(5, max_tokens=5, stop_at_eos=False))
        await ring.settle()
        steps = ring.to("s1", GenStep)
        for step in steps:  # each sequence's first token is the end-of-sequence id
            tokens = [42] * sum(row[3] is not None for row in step.rows)
            await on(GenTokens(run=9, step=step.step, src="s1", tokens=tokens, epoch=EPOCH))
        await ring.settle()
        finish = {t.sequence: t.finish_reason for t in ring.events()}
        assert finish == {4: "eos", 5: None}

    _run_ring(monkeypatch, scenario, spec=spec)


class _Letters:
    """A detokenizer of one letter per id: 0 is "a", 1 is "b", ..."""

    def decode(self, ids: Any) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_with_text_the_first_stage_streams_text_and_stops_at_a_stop_string(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(module, "load_detokenizer", lambda setup: _Letters())

    async def scenario(ring: _Ring, on: OnData) -> None:
        await on(_submit(4, max_tokens=8, stop=["c"]))
        for token in (0, 1, 2, 3):  # a, b, then the stop string
            await ring.settle()
            step = ring.to("s1", GenStep)[-1]
            await on(GenTokens(run=9, step=step.step, src="s1", tokens=[token], epoch=EPOCH))
        await ring.settle()
        events = [(t.index, t.text, t.finish_reason) for t in ring.events()]
        assert events == [(0, "a", None), (1, "b", None), (2, "", "stop")]

    _run_ring(monkeypatch, scenario, text=True)


def test_a_replan_sets_the_run_up_again_and_a_sequence_goes_on_from_its_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def scenario(ring: _Ring, on: OnData) -> None:
        await on(_submit(4))
        await ring.settle()
        (step,) = ring.to("s1", GenStep)
        assert ring.executor.state is not None
        built = ring.executor.state.work

        async def replan(**changes: Any) -> None:
            ring.control.clear()
            await ring.executor.on_control(replace(ring.setup, **changes))
            await ring.executor._supervisor.stop([RECEIVE_TASK])
            (ready,) = ring.control
            assert GenReady.from_message(ready).error == ""

        # the same units under the next epoch: kept (emptied), the old run's state gone
        await replan(epoch=EPOCH + 1)
        assert ring.executor.state is not None and ring.executor.state.work is built
        assert built.stage.free_all() == 0
        await on(GenTokens(run=9, step=step.step, src="s1", tokens=[42], epoch=EPOCH))
        assert ring.executor.stale == 1  # the old plan's token: dropped
        # the client sends the sequence again with the token it received
        again = GenSubmit(
            run=9,
            sequence=4,
            src="client",
            params=GREEDY,
            tensors=(torch.tensor([5, 17, 3]), torch.tensor([42])),
            epoch=EPOCH + 1,
        )
        await on(again)
        await ring.settle()
        prefill = ring.to("s1", GenStep)[-1]
        assert prefill.epoch == EPOCH + 1
        # prompt and token prefilled from position 0; the row samples token index 1
        assert prefill.rows == [[4, 0, 4, 1, 5]]
        await on(GenTokens(run=9, step=prefill.step, src="s1", tokens=[7], epoch=EPOCH + 1))
        await ring.settle()
        last = ring.events()[-1]
        assert (last.sequence, last.index, last.token, last.finish_reason) == (4, 1, 7, "length")
        # other units: built again
        await replan(end=3, epoch=EPOCH + 2)
        assert ring.executor.state is not None and ring.executor.state.work is not built

    _run_ring(monkeypatch, scenario)


def test_a_step_the_next_stage_does_not_take_refuses_no_sequence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def scenario(ring: _Ring, on: OnData) -> None:
        ring.unreachable.add("s1")  # dead: the coordinator's failure detector decides
        await on(_submit(4))
        await ring.settle()
        assert not ring.to("client", GenRefused) and not ring.sent
        assert ring.executor.protocol_errors == 0

    _run_ring(monkeypatch, scenario)


def test_a_steps_tokens_go_to_the_client_in_one_message_in_row_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def scenario(ring: _Ring, on: OnData) -> None:
        for sequence in (4, 6, 5):
            await on(_submit(sequence))
        answered: set[int] = set()
        sizes = []
        while True:
            await ring.settle()
            pending = [s for s in ring.to("s1", GenStep) if s.step not in answered]
            if not pending:
                break
            for step in pending:
                answered.add(step.step)
                sampled = [row[0] for row in step.rows if row[3] is not None]
                tokens = [(10 * step.step + i) % 100 for i in range(len(sampled))]
                before = len(ring.to("client", GenTokenBatch))
                await on(GenTokens(run=9, step=step.step, src="s1", tokens=tokens, epoch=EPOCH))
                batches = ring.to("client", GenTokenBatch)
                # the step's tokens: one message, its sampling rows' order
                assert len(batches) == before + 1
                events = events_from_wire(batches[-1].events)
                assert [(e.sequence, e.token) for e in events] == list(
                    zip(sampled, tokens, strict=True)
                )
                sizes.append(len(events))
        assert 3 in sizes  # the three sequences decoded in one step: one message for three
        # every sequence's stream, read one event at a time, is whole and in order
        streams: dict[int, list[int]] = {}
        for event in ring.events():
            assert event.index == len(streams.setdefault(event.sequence, []))
            streams[event.sequence].append(event.token)
        assert sorted(streams) == [4, 5, 6] and all(len(t) == 2 for t in streams.values())

    _run_ring(monkeypatch, scenario, steps_in_flight=1)
