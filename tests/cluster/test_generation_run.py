"""Pipelined generation on real stage processes: the coordinator sets the run up, the
client submits to the first stage, steps go stage to stage, the last stage's tokens
go round the ring, and the first stage streams every token to the client.

The session's shared cluster (three stages, tests/cluster/conftest.py) runs every
test; each checkpoint is a random-init transformers model saved to a temporary
directory, which the stages read their own tensors from.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from tests._support.causal_lm import (
    VOCAB,
    hf_greedy,
    hf_model,
    save_word_tokenizer,
    write_checkpoint,
)
from zpipe._errors import PipelineError
from zpipe.client.runs.generation import GenerateOptions, GenerationRun
from zpipe.cluster import LocalCluster
from zpipe.generation.params import SamplingParams, TokenEvent
from zpipe.models.causal_lm import causal_lm_spec
from zpipe.protocol.generation import GenSubmit

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(600)

# different lengths: prefill in chunks of 4 while other sequences decode
PROMPTS = [[5, 17, 3], [9, 1, 44, 60, 2, 8, 30, 71, 11], [4] * 2 + list(range(20, 32))]
NEW_TOKENS = 6
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, stop_at_eos=False)
STAGES = ["s0", "s1", "s2"]


@pytest.fixture(scope="module")
def checkpoints(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Path, list[list[int]]]]:
    """Each kind's checkpoint directory and transformers' greedy tokens of every prompt."""
    out = {}
    for kind in ("gpt2", "llama"):  # llama: grouped-query attention (6 heads, 2 kv heads)
        model = hf_model(kind)
        directory = write_checkpoint(model, tmp_path_factory.mktemp(f"gen-{kind}"))
        out[kind] = (directory, [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS])
    return out


@pytest.mark.parametrize("num_stages", [1, 2, 3])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_greedy_tokens_equal_transformers_generate(
    cluster: LocalCluster,
    checkpoints: dict[str, tuple[Path, list[list[int]]]],
    kind: str,
    num_stages: int,
) -> None:
    directory, expected = checkpoints[kind]
    got = cluster.generate(
        causal_lm_spec(directory),
        PROMPTS,
        GREEDY,
        stage_names=STAGES[:num_stages],
        chunk_tokens=4,
        token_timeout_s=120.0,
        wait_for_stages_s=120.0,
    )
    assert got == expected


def test_events_stream_in_order_and_a_refused_sequence_fails_the_stream(
    cluster: LocalCluster, checkpoints: dict[str, tuple[Path, list[list[int]]]]
) -> None:
    directory, expected = checkpoints["gpt2"]
    spec = causal_lm_spec(directory)

    async def stream() -> list[TokenEvent]:
        async with cluster.client() as client:
            stream = client.generate(
                spec, PROMPTS[:2], GREEDY, stage_names=STAGES[:2], token_timeout_s=120.0
            )
            return [event async for event in stream]

    events = asyncio.run(stream())
    for sequence in range(2):
        mine = [e for e in events if e.sequence == sequence]
        assert [e.index for e in mine] == list(range(NEW_TOKENS))
        assert [e.token for e in mine] == expected[sequence]
        assert mine[-1].finish_reason == "length"
        assert all(e.finish_reason is None for e in mine[:-1])
    # prompt + max_tokens beyond the run's context: the first stage refuses it, by name
    with pytest.raises(PipelineError, match=r"sequence 0 was refused.*context"):
        cluster.generate(
            spec,
            [PROMPTS[1]],
            GREEDY,
            stage_names=STAGES[:2],
            max_context=10,
            token_timeout_s=120.0,
        )
    # the cluster serves the next run as before
    assert cluster.generate(spec, PROMPTS[:1], GREEDY, stage_names=STAGES[1:]) == expected[:1]


def test_a_run_that_cannot_be_set_up_fails_before_any_sequence(
    cluster: LocalCluster, checkpoints: dict[str, tuple[Path, list[list[int]]]]
) -> None:
    directory, _ = checkpoints["llama"]
    # the model has 5 units: a partition that covers 3 is refused by the coordinator
    with pytest.raises(PipelineError, match="covers 3 units, the model has 5"):
        cluster.generate(causal_lm_spec(directory), PROMPTS, GREEDY, partition=[1, 1, 1])


def test_more_sequences_than_admitted_at_once_wait_their_turn(
    cluster: LocalCluster, checkpoints: dict[str, tuple[Path, list[list[int]]]]
) -> None:
    directory, expected = checkpoints["llama"]
    prompts = PROMPTS + PROMPTS[::-1]  # six sequences, two admitted at a time
    got = cluster.generate(
        causal_lm_spec(directory),
        prompts,
        GREEDY,
        stage_names=STAGES,
        max_sequences=2,
        steps_in_flight=2,
        chunk_tokens=4,
        token_timeout_s=120.0,
    )
    assert got == expected + expected[::-1]


def test_a_malformed_sequence_is_refused_and_the_run_serves_the_next(
    cluster: LocalCluster, checkpoints: dict[str, tuple[Path, list[list[int]]]]
) -> None:
    directory, expected = checkpoints["gpt2"]
    options = GenerateOptions(stage_names=STAGES[:2], token_timeout_s=120.0)

    async def run() -> list[int]:
        async with cluster.client() as client:
            gen = GenerationRun(client.connection, causal_lm_spec(directory), options)
            await gen.start()
            try:
                # what SamplingParams would never let through: the first stage checks it
                bad = GenSubmit(
                    run=gen.run,
                    sequence=7,
                    src="client",
                    params={"top_p": 7},
                    tensors=(torch.tensor(PROMPTS[0]),),
                    epoch=gen.ready.epoch,
                )
                await gen._send(bad)
                with pytest.raises(PipelineError, match=r"sequence 7 was refused.*top_p"):
                    await gen.next_event()
                await gen.submit(8, PROMPTS[0], GREEDY)
                tokens = []
                while True:
                    event = await gen.next_event()
                    assert event.sequence == 8
                    tokens.append(event.token)
                    if event.finish_reason is not None:
                        return tokens
            finally:
                await gen.close()

    assert asyncio.run(run()) == expected[0]


def test_a_bfloat16_run_streams_every_token(
    cluster: LocalCluster, checkpoints: dict[str, tuple[Path, list[list[int]]]]
) -> None:
    directory, _ = checkpoints["llama"]
    got = cluster.generate(
        causal_lm_spec(directory),
        PROMPTS,
        GREEDY,
        stage_names=STAGES,
        dtype="bfloat16",
        chunk_tokens=4,
        token_timeout_s=120.0,
    )
    # bfloat16 rounds differently from transformers' float32: lengths and ids only
    assert [len(tokens) for tokens in got] == [NEW_TOKENS] * len(PROMPTS)
    assert all(0 <= t < VOCAB for tokens in got for t in tokens)


def test_text_streams_with_the_checkpoints_tokenizer_and_stop_strings_end_sequences(
    cluster: LocalCluster, checkpoints: dict[str, tuple[Path, list[list[int]]]]
) -> None:
    directory, expected = checkpoints["gpt2"]
    tokenizer = save_word_tokenizer(directory)
    # sequence 1 stops once its text holds its first two words
    stop = tokenizer.decode(expected[1][:2])
    params = [GREEDY, SamplingParams(max_tokens=NEW_TOKENS, stop=(stop,), stop_at_eos=False)]

    async def stream() -> list[TokenEvent]:
        async with cluster.client() as client:
            events = client.generate(
                causal_lm_spec(directory),
                PROMPTS[:2],
                params,
                stage_names=STAGES[:2],
                text=True,
                token_timeout_s=120.0,
            )
            return [event async for event in events]

    events = asyncio.run(stream())
    first = [e for e in events if e.sequence == 0]
    assert [e.token for e in first] == expected[0]
    assert "".join(e.text for e in first) == tokenizer.decode(expected[0])
    second = [e for e in events if e.sequence == 1]
    assert [e.token for e in second] == expected[1][:2]
    assert second[-1].finish_reason == "stop"
    assert "".join(e.text for e in second) == ""  # the stop string is never streamed
