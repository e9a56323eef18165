"""Reading a causal LM's config.json: both transformers 4 and 5 layouts, refusals
that name the key, and sizes from the config alone."""

from __future__ import annotations

from typing import Any

import pytest

from tests._support.causal_lm import hf_model
from zpipe._errors import ModelSpecError
from zpipe.models.causal_lm import kv_bytes_per_token_per_block, read_causal_lm_config
from zpipe.models.causal_lm.config import parameter_elements

# Shaped like a transformers 4 Llama 3.1 config.json (rope_theta beside rope_scaling)
LLAMA31_V4: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "vocab_size": 128256,
    "torch_dtype": "bfloat16",
}
# Shaped like Qwen2.5-0.5B's: sliding window named but switched off, tied head
QWEN25_V4: dict[str, Any] = {
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
}


def test_a_llama31_config_reads_its_rope_scaling() -> None:
    config = read_causal_lm_config(LLAMA31_V4)
    assert (config.arch, config.num_kv_heads, config.head_dim) == ("llama", 8, 128)
    assert config.rope is not None
    assert (config.rope.kind, config.rope.theta, config.rope.factor) == ("llama3", 500000.0, 8.0)
    assert config.rope.original_max_positions == 8192
    # 8 KV heads x 128 x (key + value) x 4 bytes (float32) = 8 KiB a token and block
    assert kv_bytes_per_token_per_block(config) == 8192
    assert kv_bytes_per_token_per_block(config, element_bytes=2) == 4096


def test_a_qwen25_config_has_qkv_biases_and_a_tied_head() -> None:
    config = read_causal_lm_config(QWEN25_V4)
    assert (config.qkv_bias, config.out_bias, config.mlp_bias) == (True, False, False)
    assert config.tie_word_embeddings and config.head_dim == 64
    assert config.rope is not None and config.rope.kind == "default"
    assert config.rope.theta == 1e6


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope type 'longrope'"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
        ({"rope_scaling": {"rope_type": "linear"}}, "needs a 'factor'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"num_key_value_heads": 5}, "num_key_value_heads=5"),
        ({"layer_types": ["sliding_attention"] * 24}, "layer_types"),
        ({"model_type": "mistral"}, "model_type 'mistral'"),
        ({"hidden_size": "896"}, "'hidden_size'"),
    ],
)
def test_what_would_compute_something_else_is_refused(change: dict[str, Any], match: str) -> None:
    with pytest.raises(ModelSpecError, match=match):
        read_causal_lm_config({**QWEN25_V4, **change})


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"activation_function": "relu"}, "activation_function 'relu'"),
        ({"add_cross_attention": True}, "cross_attention"),
        ({"n_head": 5}, "not divisible"),
    ],
)
def test_gpt2_refusals(change: dict[str, Any], match: str) -> None:
    with pytest.raises(ModelSpecError, match=match):
        read_causal_lm_config({"model_type": "gpt2", "n_embd": 32, "n_head": 4, **change})


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2"])
def test_parameter_count_from_the_config_is_transformers_count(kind: str) -> None:
    pytest.importorskip("transformers")
    model = hf_model(kind)
    config = read_causal_lm_config(model.config.to_dict())
    counted = parameter_elements(config, 0, config.num_units)
    # a tied head counts its own copy (a stage holding only the head holds one)
    if config.tie_word_embeddings:
        counted -= config.vocab_size * config.hidden
    assert counted == model.num_parameters()
