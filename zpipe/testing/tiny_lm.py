"""A tiny causal language model checkpoint built in code: nothing is downloaded.

:func:`save_tiny_lm` trains a byte-level BPE tokenizer on a few sentences,
wraps it in ``transformers``' ``PreTrainedTokenizerFast`` with an end-of-sequence
token and a chat template, builds a random-initialised GPT-2-style or
Llama-style model of the same vocabulary and saves both with
``save_pretrained`` (safetensors). The directory is a real Hugging Face
checkpoint, so ``python -m zpipe serve --model DIR`` and
``AutoModelForCausalLM.from_pretrained(DIR)`` read it like any other::

    python -c "from zpipe.testing.tiny_lm import save_tiny_lm; save_tiny_lm('/tmp/tiny-lm')"

Its text is gibberish (the weights are random), but it is deterministic: the same
seed gives the same weights, so greedy output can be compared token for token.
Needs ``transformers`` and ``tokenizers`` (the ``test`` extra).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

EOS = "<|endoftext|>"

# A plain role-tagged format; `add_generation_prompt` opens the assistant's turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_CORPUS = [
    "a pipeline splits one model across the devices of a home",
    "each stage keeps the cache of its own blocks for every sequence",
    "the last stage samples the next token and sends it to the first stage",
    "the planner counts weights activations and the cache of every block",
    "when a stage dies the run is planned again over the devices that survive",
    "hello world, the quick brown fox jumps over the lazy dog 0123456789",
    "<|user|> <|assistant|> <|system|> tell me a story about edge devices",
]

Family = Literal["gpt2", "llama"]


def build_tokenizer(vocab_size: int = 320, *, chat_template: str | None = CHAT_TEMPLATE) -> Any:
    """A byte-level BPE tokenizer trained here on a few sentences: every string
    encodes (bytes are the base alphabet), and words split into several tokens, so
    incremental decoding and stop strings meet real token boundaries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_CORPUS, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS, pad_token=EOS)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def build_model(
    vocab_size: int,
    eos_token_id: int,
    *,
    family: Family = "gpt2",
    max_context: int = 128,
    seed: int = 0,
) -> Any:
    """A random-initialised causal LM (two blocks, width 32) from a configuration."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    config: Any
    if family == "gpt2":
        config = GPT2Config(
            vocab_size=vocab_size,
            n_positions=max_context,
            n_embd=32,
            n_layer=2,
            n_head=2,
            # wider than GPT-2's 0.02, so that greedy output varies instead of
            # repeating one token (the tests need text that exercises stop strings)
            initializer_range=0.5,
            bos_token_id=eos_token_id,
            eos_token_id=eos_token_id,
        )
    elif family == "llama":
        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,  # grouped-query attention
            max_position_embeddings=max_context,
            bos_token_id=eos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id,
        )
    else:
        raise ValueError(f"unknown family {family!r}: gpt2 or llama")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    return model.eval()


def save_tiny_lm(
    directory: str | Path,
    *,
    family: Family = "gpt2",
    max_context: int = 128,
    seed: int = 0,
    chat_template: str | None = CHAT_TEMPLATE,
) -> Path:
    """Write a tokenizer and a random-initialised model into ``directory`` (made if
    missing) with ``save_pretrained``; returns the directory."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(chat_template=chat_template)
    model = build_model(
        len(tokenizer),
        tokenizer.eos_token_id,
        family=family,
        max_context=max_context,
        seed=seed,
    )
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    tokenizer.save_pretrained(path)
    model.save_pretrained(path, safe_serialization=True)
    return path
