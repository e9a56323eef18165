"""``python -m zpipe generate`` on a local cluster it starts (and the async cluster's
stream): token ids stream to the terminal, the same greedy tokens the model gives in
one process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests._support.causal_lm import (
    hf_greedy,
    hf_model,
    save_word_tokenizer,
    write_checkpoint,
    zpipe_greedy,
)
from zpipe.cli import generate as command
from zpipe.cluster import AsyncLocalCluster
from zpipe.generation.params import SamplingParams
from zpipe.models import ModelSpec
from zpipe.models.causal_lm import CausalLmStage

pytestmark = pytest.mark.timeout(600)

PROMPTS = [[5, 17, 3], [9, 1, 44, 60, 2, 8, 30, 71, 11]]


def test_generate_streams_the_greedy_tokens_of_each_prompt(
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = ModelSpec.preset("llama-tiny")
    whole = [CausalLmStage.build(spec, 0, 4)]  # the preset's 4 units, in one process
    expected = zpipe_greedy(whole, PROMPTS, 5, prefill_chunk=64)
    argv = ["--preset", "llama-tiny", "--max-tokens", "5", "--local", "2", "--chunk-tokens", "4"]
    for prompt in PROMPTS:
        argv += ["--prompt-ids", ",".join(map(str, prompt))]
    assert command.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    for i, tokens in enumerate(expected):
        assert f"[{i}] {' '.join(map(str, tokens))}  [finished: length]" in lines


def test_a_prompt_without_a_tokenizer_is_refused_before_any_process_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert command.main(["--preset", "gpt2-tiny", "--prompt", "hello"]) == 1
    assert "give --prompt-ids instead" in capsys.readouterr().err


def test_an_async_local_cluster_streams_the_events() -> None:
    spec = ModelSpec.preset("gpt2-tiny")
    expected = zpipe_greedy([CausalLmStage.build(spec, 0, 4)], PROMPTS, 4, prefill_chunk=64)

    async def stream() -> list[list[int]]:
        tokens: list[list[int]] = [[] for _ in PROMPTS]
        async with AsyncLocalCluster(2, log_level="warning") as cluster:
            params = SamplingParams(max_tokens=4, stop_at_eos=False)
            async for event in cluster.generate(spec, PROMPTS, params, chunk_tokens=4):
                tokens[event.sequence].append(event.token)
        return tokens

    assert asyncio.run(stream()) == expected


def test_with_a_tokenizer_text_goes_in_and_streams_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = hf_model("gpt2")
    directory = write_checkpoint(model, tmp_path / "gpt2")
    tokenizer = save_word_tokenizer(directory)
    expected = tokenizer.decode(hf_greedy(model, [5, 17, 3], 4))
    argv = ["--model", str(directory), "--prompt", "w5 w17 w3", "--max-tokens", "4"]
    assert command.main([*argv, "--local", "1"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == expected and "[finished: length]" in out
