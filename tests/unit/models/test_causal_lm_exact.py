"""Causal LMs on 1-4 in-process stages against transformers itself: greedy tokens
identical to its generate, logits close to its forward."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._support.causal_lm import (
    SPLITS,
    VOCAB,
    build_stages,
    hf_greedy,
    hf_model,
    write_checkpoint,
    zpipe_greedy,
)
from zpipe._errors import ModelSpecError
from zpipe.models.causal_lm import SequenceChunk, causal_lm_spec, chain_forward
from zpipe.models.causal_lm.checkpoint import HfCheckpoint

pytest.importorskip("transformers")

PROMPTS = [[5, 17, 3], [9, 1, 44, 60, 2, 8, 30, 71, 11], [4] * 2 + list(range(20, 32))]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    out = {}
    for kind in ("gpt2", "llama", "qwen2"):
        model = hf_model(kind)
        out[kind] = (model, write_checkpoint(model, tmp_path_factory.mktemp(kind)))
    return out


@pytest.fixture(scope="module")
def hf_tokens(checkpoints: dict[str, tuple[Any, Path]]) -> dict[str, list[list[int]]]:
    return {
        kind: [hf_greedy(model, prompt, NEW_TOKENS) for prompt in PROMPTS]
        for kind, (model, _) in checkpoints.items()
    }


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2"])
def test_greedy_tokens_equal_transformers_for_a_batch_of_prompts(
    checkpoints: dict[str, tuple[Any, Path]],
    hf_tokens: dict[str, list[list[int]]],
    kind: str,
    num_stages: int,
) -> None:
    stages = build_stages(checkpoints[kind][1], SPLITS[num_stages])
    got = zpipe_greedy(stages, PROMPTS, NEW_TOKENS, prefill_chunk=4)
    assert got == hf_tokens[kind]
    # the tokens are not all one repeated token: the comparison can tell models apart
    assert len({t for tokens in got for t in tokens}) > 3


@pytest.mark.parametrize("prefill_chunk", [1, 64], ids=["token-by-token", "whole-prompt"])
@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2"])
def test_greedy_one_sequence_at_a_time(
    checkpoints: dict[str, tuple[Any, Path]],
    hf_tokens: dict[str, list[list[int]]],
    kind: str,
    prefill_chunk: int,
) -> None:
    stages = build_stages(checkpoints[kind][1], SPLITS[2])
    for prompt, expected in zip(PROMPTS, hf_tokens[kind], strict=True):
        got = zpipe_greedy(stages, [prompt], NEW_TOKENS, prefill_chunk=prefill_chunk)
        assert got == [expected]


def _hf_logits(model: Any, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = model(torch.tensor([prompt])).logits[0]
    return logits


@pytest.mark.parametrize("num_stages", [1, 3])
@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2"])
def test_logits_of_every_token_are_close_to_transformers_forward(
    checkpoints: dict[str, tuple[Any, Path]], kind: str, num_stages: int
) -> None:
    model, directory = checkpoints[kind]
    stages = build_stages(directory, SPLITS[num_stages])
    chunks, tokens = [], []
    for sequence_id, prompt in enumerate(PROMPTS):
        for stage in stages:
            stage.open_sequence(sequence_id, len(prompt))
        chunks.append(SequenceChunk(sequence_id, 0, len(prompt)))
        tokens.extend(prompt)
    logits = chain_forward(stages, chunks, torch.tensor(tokens), all_logits=True)
    assert logits.shape == (len(tokens), VOCAB)
    for part, prompt in zip(logits.split([len(p) for p in PROMPTS]), PROMPTS, strict=True):
        torch.testing.assert_close(part, _hf_logits(model, prompt), atol=1e-5, rtol=1e-5)


def test_batched_decode_rows_equal_each_sequence_alone(
    checkpoints: dict[str, tuple[Any, Path]],
) -> None:
    """Sequences with 3, 9 and 14 cached tokens decode in one step; each row is the
    logits that sequence gets when it steps alone (the mask hides the others' and
    the padding's keys)."""
    directory = checkpoints["llama"][1]
    together, alone = build_stages(directory, SPLITS[2]), build_stages(directory, SPLITS[2])
    for sequence_id, prompt in enumerate(PROMPTS):
        for stages in (together, alone):
            for stage in stages:
                stage.open_sequence(sequence_id, len(prompt) + 1)
            chain_forward(
                stages, [SequenceChunk(sequence_id, 0, len(prompt))], torch.tensor(prompt)
            )
    steps = [SequenceChunk(i, len(p), 1) for i, p in enumerate(PROMPTS)]
    next_tokens = torch.tensor([7, 8, 9])
    batched = chain_forward(together, steps, next_tokens)
    for row, chunk in enumerate(steps):
        solo = chain_forward(alone, [chunk], next_tokens[row : row + 1])
        # BLAS may sum in another order for another batch size: float rounding only
        torch.testing.assert_close(batched[row : row + 1], solo, atol=1e-5, rtol=1e-5)
        assert int(batched[row].argmax()) == int(solo[0].argmax())


ROPE_SCALINGS = [
    {"rope_type": "linear", "factor": 2.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
]


@pytest.mark.parametrize("scaling", ROPE_SCALINGS, ids=lambda s: s["rope_type"])
def test_rope_scaling_kinds_match_transformers(tmp_path: Path, scaling: dict[str, Any]) -> None:
    model = hf_model("llama", rope_parameters={"rope_theta": 500.0, **scaling})
    stages = build_stages(write_checkpoint(model, tmp_path), SPLITS[2])
    prompt = list(range(1, 40))
    for stage in stages:
        stage.open_sequence(0, len(prompt))
    logits = chain_forward(
        stages, [SequenceChunk(0, 0, len(prompt))], torch.tensor(prompt), all_logits=True
    )
    torch.testing.assert_close(logits, _hf_logits(model, prompt), atol=1e-5, rtol=1e-5)


def test_a_rope_kind_that_changes_with_the_length_is_refused(tmp_path: Path) -> None:
    model = hf_model(
        "llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    )
    with pytest.raises(ModelSpecError, match="rope type 'dynamic' is not supported"):
        causal_lm_spec(write_checkpoint(model, tmp_path))


def test_sliding_window_attention_is_refused(tmp_path: Path) -> None:
    model = hf_model("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    with pytest.raises(ModelSpecError, match="sliding"):
        causal_lm_spec(write_checkpoint(model, tmp_path))


def test_a_stage_reads_its_checkpoint_one_unit_at_a_time(
    checkpoints: dict[str, tuple[Any, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading must not hold every unit's tensors beside the built units (that doubled
    a stage's memory at load, past what the capacity check planned): each read is of
    one unit's tensors, each tensor is read once; the exactness tests above show the
    weights land where they belong."""
    directory = checkpoints["llama"][1]
    reads: list[list[str]] = []
    original = HfCheckpoint.read

    def spying_read(self: HfCheckpoint, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        wanted = list(keys)
        reads.append(wanted)
        return original(self, wanted)

    monkeypatch.setattr(HfCheckpoint, "read", spying_read)
    ((start, end),) = SPLITS[1]
    build_stages(directory, SPLITS[1])

    def unit_of(key: str) -> str:
        # "model.layers.2.mlp.up_proj.weight" -> "layers.2"; embeddings, norm, head by name
        parts = key.split(".")
        return ".".join(parts[1:3]) if parts[1] == "layers" else "head" if parts[-2] in (
            "norm", "lm_head") else parts[-2]  # fmt: skip

    assert len(reads) == end - start
    assert all(len({unit_of(key) for key in read}) == 1 for read in reads), reads
    every = [key for read in reads for key in read]
    assert len(every) == len(set(every))
