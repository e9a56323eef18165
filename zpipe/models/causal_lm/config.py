"""A causal LM's shape, read from a Hugging Face ``config.json`` (as plain data).

Two architectures, named by the config's ``model_type``:

    gpt2          learned positions, LayerNorm, GELU (tanh) MLP, Conv1D projections
    llama, qwen2  RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP
                  (qwen2: biases on the q/k/v projections)

Whatever would change the arithmetic and is not implemented (a rope scaling
kind, sliding-window attention, another activation) is refused with a
ModelSpecError that names the key, rather than computed differently from the
model the checkpoint was trained as. Nothing here imports transformers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zpipe._errors import ModelSpecError

GPT2 = "gpt2"
LLAMA = "llama"
MODEL_TYPES = {"gpt2": GPT2, "llama": LLAMA, "qwen2": LLAMA}
ROPE_KINDS = ("default", "linear", "llama3", "yarn")
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu")
LLAMA_ACTIVATIONS = ("silu",)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary positions: a kind, its base and its scaling parameters (HF's
    ``rope_parameters``, or the older ``rope_theta`` + ``rope_scaling``)."""

    kind: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 0
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class CausalLmConfig:
    arch: str
    model_type: str
    vocab_size: int
    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    norm_eps: float
    max_positions: int
    tie_word_embeddings: bool
    activation: str
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    rope: RopeConfig | None = None
    # the standard deviation of random initial weights (HF's initializer_range)
    init_std: float = 0.02
    # GPT-2's attention scaling switches
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False

    @property
    def num_units(self) -> int:
        """The embedding, one unit per decoder block, the final norm with the LM head."""
        return self.num_layers + 2

    def attention_scale(self, layer: int) -> float:
        scale = self.head_dim**-0.5 if (self.arch == LLAMA or self.scale_attn_weights) else 1.0
        if self.arch == GPT2 and self.scale_attn_by_inverse_layer_idx:
            scale /= float(layer + 1)
        return scale


def _get(config: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = config.get(key, default)
    if value is None and default is None:
        return None
    if isinstance(value, bool) and kind is not bool:
        raise ModelSpecError(f"causal LM config key {key!r}: expected {kind}, got {value!r}")
    if not isinstance(value, kind):
        raise ModelSpecError(f"causal LM config key {key!r}: expected {kind}, got {value!r}")
    return value


def _positive_int(config: Mapping[str, Any], key: str, default: Any = None) -> int:
    value = _get(config, key, int, default)
    if value is None:
        raise ModelSpecError(f"causal LM config needs the key {key!r}")
    if value < 1:
        raise ModelSpecError(f"causal LM config key {key!r} must be at least 1, got {value}")
    return int(value)


def _number(config: Mapping[str, Any], key: str, default: float) -> float:
    value = _get(config, key, (int, float), default)
    if not math.isfinite(value) or value <= 0:
        raise ModelSpecError(f"causal LM config key {key!r} must be a positive number")
    return float(value)


def read_causal_lm_config(config: Mapping[str, Any]) -> CausalLmConfig:
    """Validate a ``config.json`` mapping into a CausalLmConfig, or ModelSpecError."""
    if not isinstance(config, Mapping):
        raise ModelSpecError(f"a causal LM config must be a mapping, got {type(config).__name__}")
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ModelSpecError(
            f"causal LM config has model_type {model_type!r}; supported are "
            f"{sorted(MODEL_TYPES)} (GPT-2 style and Llama/Qwen2 style decoders)"
        )
    if MODEL_TYPES[model_type] == GPT2:
        return _read_gpt2(config)
    return _read_llama(config, model_type)


def _read_gpt2(config: Mapping[str, Any]) -> CausalLmConfig:
    hidden = _positive_int(config, "n_embd", 768)
    heads = _positive_int(config, "n_head", 12)
    if hidden % heads:
        raise ModelSpecError(f"gpt2 config: n_embd={hidden} is not divisible by n_head={heads}")
    inner = _get(config, "n_inner", int, None)
    activation = _get(config, "activation_function", str, "gelu_new")
    if activation not in GPT2_ACTIVATIONS:
        raise ModelSpecError(
            f"gpt2 config: activation_function {activation!r} is not supported; "
            f"use one of {list(GPT2_ACTIVATIONS)}"
        )
    if config.get("add_cross_attention"):
        raise ModelSpecError("gpt2 config: add_cross_attention is not supported (decoder only)")
    return CausalLmConfig(
        arch=GPT2,
        model_type="gpt2",
        vocab_size=_positive_int(config, "vocab_size", 50257),
        hidden=hidden,
        num_layers=_positive_int(config, "n_layer", 12),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate=inner if inner is not None and inner > 0 else 4 * hidden,
        norm_eps=_number(config, "layer_norm_epsilon", 1e-5),
        max_positions=_positive_int(config, "n_positions", 1024),
        # GPT-2 ties its LM head to the token embedding unless told otherwise.
        tie_word_embeddings=_get(config, "tie_word_embeddings", bool, True),
        activation=activation,
        qkv_bias=True,
        out_bias=True,
        mlp_bias=True,
        init_std=_number(config, "initializer_range", 0.02),
        scale_attn_weights=_get(config, "scale_attn_weights", bool, True),
        scale_attn_by_inverse_layer_idx=_get(
            config, "scale_attn_by_inverse_layer_idx", bool, False
        ),
    )


def _read_llama(config: Mapping[str, Any], model_type: str) -> CausalLmConfig:
    hidden = _positive_int(config, "hidden_size", 4096)
    heads = _positive_int(config, "num_attention_heads", 32)
    kv_heads = _positive_int(config, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise ModelSpecError(
            f"{model_type} config: num_attention_heads={heads} is not a multiple of "
            f"num_key_value_heads={kv_heads}"
        )
    head_dim = _get(config, "head_dim", int, None)
    if head_dim is None:
        if hidden % heads:
            raise ModelSpecError(
                f"{model_type} config: hidden_size={hidden} is not divisible by "
                f"num_attention_heads={heads}; give head_dim"
            )
        head_dim = hidden // heads
    if head_dim < 2 or head_dim % 2:
        raise ModelSpecError(f"{model_type} config: head_dim must be even, got {head_dim}")
    activation = _get(config, "hidden_act", str, "silu")
    if activation not in LLAMA_ACTIVATIONS:
        raise ModelSpecError(
            f"{model_type} config: hidden_act {activation!r} is not supported; use 'silu'"
        )
    if config.get("use_sliding_window"):
        raise ModelSpecError(
            f"{model_type} config: use_sliding_window is not supported (full attention only)"
        )
    layer_types = config.get("layer_types")
    if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
        raise ModelSpecError(
            f"{model_type} config: layer_types other than 'full_attention' are not supported"
        )
    if config.get("pretraining_tp", 1) not in (1, None):
        raise ModelSpecError(f"{model_type} config: pretraining_tp other than 1 is not supported")
    max_positions = _positive_int(config, "max_position_embeddings", 2048)
    is_qwen2 = model_type == "qwen2"
    attention_bias = _get(config, "attention_bias", bool, False)
    return CausalLmConfig(
        arch=LLAMA,
        model_type=model_type,
        vocab_size=_positive_int(config, "vocab_size", 32000),
        hidden=hidden,
        num_layers=_positive_int(config, "num_hidden_layers", 32),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=_positive_int(config, "intermediate_size", 11008),
        norm_eps=_number(config, "rms_norm_eps", 1e-6),
        max_positions=max_positions,
        tie_word_embeddings=_get(config, "tie_word_embeddings", bool, False),
        activation=activation,
        # Qwen2 always has q/k/v biases and no output bias; Llama's attention_bias
        # switches all four.
        qkv_bias=True if is_qwen2 else attention_bias,
        out_bias=False if is_qwen2 else attention_bias,
        mlp_bias=False if is_qwen2 else _get(config, "mlp_bias", bool, False),
        rope=read_rope(config, max_positions=max_positions),
        init_std=_number(config, "initializer_range", 0.02),
    )


def read_rope(config: Mapping[str, Any], *, max_positions: int) -> RopeConfig:
    """HF's ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (4)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ModelSpecError(f"causal LM config: rope parameters must be a mapping, got {params!r}")
    if any(isinstance(value, Mapping) for value in params.values()):
        raise ModelSpecError("causal LM config: per-layer-type rope parameters are not supported")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_KINDS:
        raise ModelSpecError(
            f"causal LM config: rope type {kind!r} is not supported; supported are "
            f"{list(ROPE_KINDS)} (dynamic and longrope change with the sequence length)"
        )
    if params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelSpecError(
            "causal LM config: partial_rotary_factor other than 1 is not supported"
        )
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    original = params.get(
        "original_max_position_embeddings",
        config.get("original_max_position_embeddings", max_positions),
    )

    def number(key: str, default: float | None) -> float | None:
        value = params.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ModelSpecError(f"causal LM config: rope {key!r} must be a number, got {value!r}")
        return float(value)

    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ModelSpecError(
            f"causal LM config: rope_theta must be a positive number, got {theta!r}"
        )
    if kind != "default" and params.get("factor") is None:
        raise ModelSpecError(f"causal LM config: rope type {kind!r} needs a 'factor'")
    factor = number("factor", 1.0) or 1.0
    if kind == "llama3" and ("low_freq_factor" not in params or "high_freq_factor" not in params):
        raise ModelSpecError("causal LM config: rope type 'llama3' needs low/high_freq_factor")
    return RopeConfig(
        kind=kind,
        theta=float(theta),
        factor=factor,
        low_freq_factor=number("low_freq_factor", 1.0) or 1.0,
        high_freq_factor=number("high_freq_factor", 4.0) or 4.0,
        original_max_positions=int(original),
        attention_factor=number("attention_factor", None),
        # HF treats a 0 or missing beta as its default.
        beta_fast=number("beta_fast", None) or 32.0,
        beta_slow=number("beta_slow", None) or 1.0,
        mscale=number("mscale", None),
        mscale_all_dim=number("mscale_all_dim", None),
        truncate=bool(params.get("truncate", True)),
    )


def kv_bytes_per_token_per_block(config: CausalLmConfig, *, element_bytes: int = 4) -> int:
    """Bytes the KV cache keeps per token for one decoder block: a key and a value
    of ``num_kv_heads * head_dim`` elements each. From the config alone."""
    return 2 * config.num_kv_heads * config.head_dim * element_bytes


def parameter_elements(config: CausalLmConfig, start: int, end: int) -> int:
    """Elements of units ``[start, end)``'s parameters, from the config alone.

    A tied LM head counts its own copy: a stage holding only the head holds one.
    """
    h, v, n = config.hidden, config.vocab_size, config.num_units
    total = 0
    if start <= 0 < end:
        total += v * h + (config.max_positions * h if config.arch == GPT2 else 0)
    if start <= n - 1 < end:
        total += v * h + (2 * h if config.arch == GPT2 else h)
    blocks = max(0, min(end, n - 1) - max(start, 1))
    total += blocks * block_parameter_elements(config)
    return total


def block_parameter_elements(config: CausalLmConfig) -> int:
    h, i = config.hidden, config.intermediate
    if config.arch == GPT2:
        return 2 * 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h)
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    attention = h * (q + 2 * kv) + q * h
    if config.qkv_bias:
        attention += q + 2 * kv
    if config.out_bias:
        attention += h
    mlp = 3 * h * i + (2 * i + h if config.mlp_bias else 0)
    return 2 * h + attention + mlp
