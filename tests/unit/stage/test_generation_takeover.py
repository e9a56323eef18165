"""Recovery's compute path in one process: a run stops mid-generation (its stages
gone), new stages cut differently take over, and the client's ``gen_submit`` sent
again with the tokens each sequence streamed makes a fresh first-stage scheduler
prefill prompt + generated tokens: the streams go on at the next index with
transformers' greedy tokens."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._support.causal_lm import SPLITS, hf_greedy, hf_model, write_checkpoint
from zpipe._errors import ConfigError, ProtocolError
from zpipe.generation.params import SamplingParams, TokenEvent
from zpipe.generation.sequences import (
    FreeCache,
    RunStep,
    SchedulerLimits,
    SequenceScheduler,
    StreamToken,
)
from zpipe.generation.wire import params_from_map, params_to_map
from zpipe.models.causal_lm import causal_lm_spec
from zpipe.protocol import REGISTRY, WireMessage
from zpipe.protocol.generation import GenSetup, GenStep, GenSubmit
from zpipe.stage.executors.generation_steps import GenerationStage, first_step, submitted_tokens
from zpipe.transport.codec import decode, encode

pytest.importorskip("transformers")

PROMPTS = [[5, 17, 3], [9, 1, 44, 60, 2, 8, 30, 71, 11], [4] * 2 + list(range(20, 32))]
NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, stop_at_eos=False)
VOCAB = 97


def _wire(message: WireMessage) -> Any:
    frames = [bytes(f) for f in encode(message.to_message())]
    return REGISTRY.parse(decode(frames))


def _stages(directory: Path, split: list[tuple[int, int]], epoch: int) -> list[GenerationStage]:
    n = len(split)
    return [
        GenerationStage.build(
            GenSetup(
                run=1,
                model=causal_lm_spec(directory).to_dict(),
                start=s,
                end=e,
                index=i,
                num_stages=n,
                upstream="",
                downstream="",
                max_context=64,
                max_sequences=8,
                steps_in_flight=n,
                chunk_tokens=4,
                epoch=epoch,
            )
        )
        for i, (s, e) in enumerate(split)
    ]


def _drive(
    stages: list[GenerationStage],
    scheduler: SequenceScheduler,
    commands: list[Any],
    events: list[TokenEvent],
    stop: Callable[[], bool] = lambda: False,
) -> None:
    """Carry the scheduler's commands round the ring until it is idle, or until
    ``stop()`` (then whatever is in flight is lost, as with a dead stage)."""
    pending: deque[Any] = deque(commands)
    while pending and not stop():
        command = pending.popleft()
        if isinstance(command, StreamToken):
            events.append(command.event)
        elif isinstance(command, FreeCache):
            for stage in stages:
                stage.free([command.sequence])
        else:
            assert isinstance(command, RunStep)
            params, _ = scheduler.sampling(command.step)
            message = _wire(first_step(1, command, params, src="s0", epoch=0))
            for stage in stages:
                out = stage.step(message)
                if out.values is not None:
                    message = GenStep(
                        run=1,
                        step=message.step,
                        src="s",
                        rows=message.rows,
                        sampling=message.sampling,
                        tensors=(out.values,),
                    )
            pending.extend(scheduler.step_done(command.step, list(out.tokens)))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize(("before", "after"), [(3, 2), (4, 3), (2, 1)])
def test_new_stages_that_prefill_the_streamed_tokens_go_on_as_if_nothing_happened(
    tmp_path: Path, kind: str, before: int, after: int
) -> None:
    model = hf_model(kind)
    directory = write_checkpoint(model, tmp_path)
    limits = SchedulerLimits(steps_in_flight=before, chunk_tokens=4)
    scheduler = SequenceScheduler(limits)
    events: list[TokenEvent] = []
    commands = [c for i, p in enumerate(PROMPTS) for c in scheduler.submit(i, p, GREEDY)]

    def every_sequence_streamed_three() -> bool:
        return all(sum(e.sequence == i for e in events) >= 3 for i in range(len(PROMPTS)))

    _drive(_stages(directory, SPLITS[before], 1), scheduler, commands, events,
           stop=every_sequence_streamed_three)  # fmt: skip
    streamed = {i: [e.token for e in events if e.sequence == i] for i in range(len(PROMPTS))}
    assert all(0 < len(t) < NEW_TOKENS for t in streamed.values())
    # what the client sends the new first stage: prompt and streamed tokens, on the wire
    fresh = SequenceScheduler(SchedulerLimits(steps_in_flight=after, chunk_tokens=4))
    commands = []
    for sequence, prompt in enumerate(PROMPTS):
        message = _wire(
            GenSubmit(
                run=1,
                sequence=sequence,
                src="client",
                params=params_to_map(GREEDY),
                tensors=(torch.tensor(prompt), torch.tensor(streamed[sequence])),
                epoch=2,
            )
        )
        ids, generated = submitted_tokens(message, VOCAB)
        assert (ids, generated) == (prompt, streamed[sequence])
        params = params_from_map(message.params)
        commands += fresh.submit(sequence, ids, params, generated=generated)
    _drive(_stages(directory, SPLITS[after], 2), fresh, commands, events)
    assert fresh.idle
    for sequence, prompt in enumerate(PROMPTS):
        mine = [e for e in events if e.sequence == sequence]
        assert [e.index for e in mine] == list(range(NEW_TOKENS))  # none twice, none missing
        assert [e.token for e in mine] == hf_greedy(model, prompt, NEW_TOKENS)


def _submit(*tensors: torch.Tensor) -> GenSubmit:
    return GenSubmit(run=1, sequence=0, src="client", params={}, tensors=tensors)


def test_a_submit_carries_a_prompt_and_at_most_the_tokens_streamed() -> None:
    assert submitted_tokens(_submit(torch.tensor([1, 2])), VOCAB) == ([1, 2], [])
    with pytest.raises(ProtocolError, match="3 tensors, not 1 or 2"):
        submitted_tokens(_submit(*[torch.tensor([1])] * 3), VOCAB)
    with pytest.raises(ProtocolError, match="generated tokens must be int64"):
        submitted_tokens(_submit(torch.tensor([1]), torch.tensor([0.5])), VOCAB)
    with pytest.raises(ConfigError, match="below the vocabulary's 97"):
        submitted_tokens(_submit(torch.tensor([1]), torch.tensor([97])), VOCAB)
