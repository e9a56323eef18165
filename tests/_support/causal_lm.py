"""Tiny Hugging Face causal LMs written to a checkpoint directory, and a greedy
generation loop over in-process stages: the reference and the thing compared."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from zpipe.models.causal_lm import CausalLmStage, SequenceChunk, causal_lm_spec, chain_forward

VOCAB = 97

# Tiny shapes: hidden 32-48, 3 blocks (5 units), vocab 97. A wide init makes the
# greedy tokens vary instead of repeating one token.
GPT2_CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB,
    "n_positions": 64,
    "n_embd": 32,
    "n_layer": 3,
    "n_head": 4,
    "initializer_range": 0.3,
}
LLAMA_CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 48,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,  # grouped-query attention: 3 query heads per key/value head
    "max_position_embeddings": 64,
    "initializer_range": 0.3,
    "tie_word_embeddings": False,
}
QWEN2_CONFIG: dict[str, Any] = {**LLAMA_CONFIG, "tie_word_embeddings": True}

# (start, end) of each stage over 5 units, for 1 to 4 stages
SPLITS: dict[int, list[tuple[int, int]]] = {
    1: [(0, 5)],
    2: [(0, 2), (2, 5)],
    3: [(0, 1), (1, 3), (3, 5)],
    4: [(0, 1), (1, 2), (2, 4), (4, 5)],
}


def hf_model(kind: str, **overrides: Any) -> Any:
    """A seeded random-init transformers model of `kind` (gpt2, llama, qwen2), eval mode."""
    import transformers

    classes = {
        "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel, GPT2_CONFIG),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, LLAMA_CONFIG),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, QWEN2_CONFIG),
    }
    config_class, model_class, base = classes[kind]
    config = config_class(
        **{**base, **overrides}, bos_token_id=0, eos_token_id=None, pad_token_id=0
    )
    torch.manual_seed(1234)
    return model_class(config).eval()


def write_checkpoint(model: Any, directory: Path, *, max_shard_size: str | None = None) -> Path:
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    return directory


def build_stages(
    directory: Path, split: Sequence[tuple[int, int]], **kwargs: Any
) -> list[CausalLmStage]:
    spec = causal_lm_spec(directory)
    return [CausalLmStage.build(spec, start, end, **kwargs) for start, end in split]


def hf_greedy(model: Any, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generation of one sequence (its new tokens)."""
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def zpipe_greedy(
    stages: Sequence[CausalLmStage],
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    prefill_chunk: int,
    first_id: int = 100,
) -> list[list[int]]:
    """Greedy generation of all `prompts` at once through `stages`: each step holds,
    for every unfinished sequence, its next prefill chunk or its last token, so a
    step mixes prefill chunks of different lengths with decode steps."""
    ids = [first_id + i for i in range(len(prompts))]
    for sequence_id, prompt in zip(ids, prompts, strict=True):
        for stage in stages:
            stage.open_sequence(sequence_id, len(prompt) + max_new_tokens)
    fed = [0] * len(prompts)  # prompt tokens sent so far
    generated: list[list[int]] = [[] for _ in prompts]
    while any(len(g) < max_new_tokens for g in generated):
        chunks, tokens, rows = [], [], []
        for row, prompt in enumerate(prompts):
            if len(generated[row]) >= max_new_tokens:
                continue
            position = fed[row] + max(0, len(generated[row]) - 1)
            if fed[row] < len(prompt):
                new = list(prompt[fed[row] : fed[row] + prefill_chunk])
                fed[row] += len(new)
            else:
                new = [generated[row][-1]]
            chunks.append(SequenceChunk(ids[row], position, len(new)))
            tokens.extend(new)
            rows.append(row)
        logits = chain_forward(stages, chunks, torch.tensor(tokens, dtype=torch.int64))
        for out_row, row in enumerate(rows):
            if fed[row] == len(prompts[row]):  # the prompt is in: this chunk's last logits count
                generated[row].append(int(logits[out_row].argmax()))
    for sequence_id in ids:
        for stage in stages:
            assert stage.free_sequence(sequence_id)
    return generated


def save_word_tokenizer(directory: Path) -> Any:
    """A word-level tokenizer of the test vocabulary ("w0" .. "w96", one word per id)
    saved beside a checkpoint, as a Hugging Face directory has one."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words)
    tokenizer.save_pretrained(directory)
    return tokenizer
