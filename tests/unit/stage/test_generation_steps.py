"""A generation run's compute path in one process: the first stage's scheduler, each
stage's GenerationStage, every message through the codec, against transformers."""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._support.causal_lm import SPLITS, hf_greedy, hf_model, write_checkpoint
from zpipe._errors import ProtocolError
from zpipe.generation.params import SamplingParams, TokenEvent
from zpipe.generation.sequences import (
    FreeCache,
    RunStep,
    SchedulerLimits,
    SequenceScheduler,
    StreamToken,
)
from zpipe.models.causal_lm import causal_lm_spec
from zpipe.protocol import REGISTRY, WireMessage
from zpipe.protocol.generation import GenSetup, GenStep, GenTokens
from zpipe.stage.executors.generation_steps import (
    GenerationStage,
    after_failed_step,
    first_step,
)
from zpipe.transport.codec import decode, encode

pytest.importorskip("transformers")

PROMPTS = [[5, 17, 3], [9, 1, 44, 60, 2, 8, 30, 71, 11], [4] * 2 + list(range(20, 32))]
NEW_TOKENS = 6


def _wire(message: WireMessage) -> Any:
    """``message`` as a peer receives it: encoded, framed bytes, decoded, parsed."""
    frames = [bytes(f) for f in encode(message.to_message())]
    return REGISTRY.parse(decode(frames))


def _setup(directory: Path, start: int, end: int, index: int, n: int) -> GenSetup:
    return GenSetup(
        run=1,
        model=causal_lm_spec(directory).to_dict(),
        start=start,
        end=end,
        index=index,
        num_stages=n,
        upstream="",
        downstream="",
        max_context=64,
        max_sequences=8,
        steps_in_flight=n,
        chunk_tokens=4,
    )


def _run_ring(
    directory: Path,
    split: list[tuple[int, int]],
    *,
    fail: tuple[int, int] | None = None,
    refused: list[int] | None = None,
) -> dict[int, list[TokenEvent]]:
    """Every sequence's events, through stages chained by messages; steps in flight go
    round one after another (the ring's order), as the stages carry them. ``fail``:
    (step, stage) where a step fails, its sequences then added to ``refused``."""
    n = len(split)
    stages = [
        GenerationStage.build(_setup(directory, s, e, i, n)) for i, (s, e) in enumerate(split)
    ]
    scheduler = SequenceScheduler(SchedulerLimits(steps_in_flight=n, chunk_tokens=4))
    greedy = SamplingParams(max_tokens=NEW_TOKENS, stop_at_eos=False)
    pending: deque[Any] = deque()

    def take(commands: list[Any]) -> None:
        # a step's message is made when the scheduler says so, as the first stage does
        for command in commands:
            if isinstance(command, RunStep):
                params, _ = scheduler.sampling(command.step)
                command = _wire(first_step(1, command, params, src="s0", epoch=0))
            pending.append(command)

    for sequence, prompt in enumerate(PROMPTS):
        take(scheduler.submit(sequence, prompt, greedy))
    events: dict[int, list[TokenEvent]] = {i: [] for i in range(len(PROMPTS))}
    while pending:
        command = pending.popleft()
        if isinstance(command, StreamToken):
            events[command.event.sequence].append(command.event)
        elif isinstance(command, FreeCache):
            for stage in stages:
                stage.free([command.sequence])
        else:
            assert isinstance(command, GenStep)
            message = command
            failed = False
            for index, stage in enumerate(stages):
                if (command.step, index) == fail:
                    failed = True
                    break
                out = stage.step(message)
                if out.values is not None:
                    message = _wire(
                        GenStep(
                            run=1,
                            step=message.step,
                            src="s",
                            rows=message.rows,
                            sampling=message.sampling,
                            tensors=(out.values,),
                        )
                    )
            if failed:
                assert refused is not None
                sequences = [row[0] for row in command.rows]
                refused.extend(sequences)
                take(after_failed_step(scheduler, sequences))
                continue
            tokens = _wire(GenTokens(run=1, step=command.step, src="last", tokens=list(out.tokens)))
            take(scheduler.step_done(tokens.step, tokens.tokens))
    assert scheduler.idle
    for stage in stages:  # every cache was freed when its sequence ended
        assert stage.free_all() == 0
    return events


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    out = {}
    for kind in ("gpt2", "llama"):
        model = hf_model(kind)
        out[kind] = (model, write_checkpoint(model, tmp_path_factory.mktemp(kind)))
    return out


@pytest.mark.parametrize("num_stages", [1, 2, 3])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_ring_of_messages_generates_what_transformers_generates(
    checkpoints: dict[str, tuple[Any, Path]], kind: str, num_stages: int
) -> None:
    model, directory = checkpoints[kind]
    events = _run_ring(directory, SPLITS[num_stages])
    for sequence, prompt in enumerate(PROMPTS):
        got = events[sequence]
        assert [e.token for e in got] == hf_greedy(model, prompt, NEW_TOKENS)
        assert [e.index for e in got] == list(range(NEW_TOKENS))
        assert [e.finish_reason for e in got] == [None] * (NEW_TOKENS - 1) + ["length"]


def test_a_step_whose_sampling_does_not_fit_its_rows_is_refused(
    checkpoints: dict[str, tuple[Any, Path]],
) -> None:
    _, directory = checkpoints["gpt2"]
    stage = GenerationStage.build(_setup(directory, 0, 5, 0, 1))
    step = GenStep(
        run=1,
        step=0,
        src="s",
        rows=[[1, 0, 3, 0, 10]],
        sampling=[],
        tensors=(torch.tensor([1, 2, 3]),),
    )
    with pytest.raises(ProtocolError, match="sampling must list 1"):
        stage.step(step)
    # nothing was opened: the same sequence starts cleanly afterwards
    good = GenStep(
        run=1,
        step=0,
        src="s",
        rows=[[1, 0, 3, 0, 10]],
        sampling=[[0.0, 0, 1.0, 0]],
        tensors=(torch.tensor([1, 2, 3]),),
    )
    assert len(stage.step(good).tokens) == 1


@pytest.mark.parametrize("where", [0, 1, 2])
def test_after_a_step_fails_its_sequences_end_and_the_others_stay_exact(
    checkpoints: dict[str, tuple[Any, Path]], where: int
) -> None:
    model, directory = checkpoints["llama"]
    refused: list[int] = []
    # step 3 is mid-prefill of the long prompts, while another step is on the ring
    events = _run_ring(directory, SPLITS[3], fail=(3, where), refused=refused)
    assert refused  # the failed step's sequences, which end without a last event
    for sequence, prompt in enumerate(PROMPTS):
        got = [e.token for e in events[sequence]]
        expected = hf_greedy(model, prompt, NEW_TOKENS)
        if sequence in refused:
            assert got == expected[: len(got)] and len(got) < NEW_TOKENS
        else:
            assert got == expected
