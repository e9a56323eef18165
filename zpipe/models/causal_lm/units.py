"""The units of a causal LM: the embedding, one unit per decoder block, the final
norm with the LM head.

Parameter names inside each unit are those of the Hugging Face module they
stand for (``attn.c_attn.weight`` in a GPT-2 block, ``self_attn.q_proj.weight``
in a Llama block), so a checkpoint maps onto units by a prefix alone
(zpipe.models.causal_lm.checkpoint). The arithmetic follows transformers' so
that logits agree to float rounding.

Every unit runs two ways: ``unit(x)`` on a whole sequence with nothing cached
(a LayerSequence, as every other family runs), or ``unit(x, context)`` for one
step of a stage with its KV cache (zpipe.models.causal_lm.stage).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zpipe.models.causal_lm.config import GPT2, CausalLmConfig
from zpipe.models.causal_lm.context import StepContext
from zpipe.models.causal_lm.rope import Rotary, apply_rotary


def _normal_(weight: torch.Tensor, std: float) -> None:
    nn.init.normal_(weight, mean=0.0, std=std)


def _gelu(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "gelu":
        return F.gelu(x)
    # gelu_new and gelu_pytorch_tanh: the tanh approximation, written as transformers does
    return (
        0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    )


class Conv1D(nn.Module):
    """GPT-2's linear layer: weight [in, out], ``x @ W + b`` (transformers' Conv1D)."""

    def __init__(self, out_features: int, in_features: int, std: float) -> None:
        super().__init__()
        self.nf = out_features
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features))
        _normal_(self.weight, std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = (*x.size()[:-1], self.nf)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden.to(input_dtype)


def _linear(in_features: int, out_features: int, *, bias: bool, std: float) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=bias)
    _normal_(layer.weight, std)
    if layer.bias is not None:
        nn.init.zeros_(layer.bias)
    return layer


def _attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    context: StepContext,
    *,
    scale: float,
) -> torch.Tensor:
    """[B, heads, N, D] queries over [B, kv heads, T, D] keys -> [B, N, heads * D]."""
    # Grouped-query attention: key/value head h serves query heads h*g .. h*g+g-1,
    # as transformers' repeat_kv, without materialising the repeats.
    grouped = query.shape[1] != keys.shape[1]
    out = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=context.mask, scale=scale, enable_gqa=grouped
    )
    batch, heads, length, dim = out.shape
    return out.transpose(1, 2).reshape(batch, length, heads * dim)


class TokenEmbedding(nn.Module):
    """Unit 0: token ids [B, N] -> hidden [B, N, H] (GPT-2 adds learned positions)."""

    def __init__(self, cfg: CausalLmConfig, std: float = 0.02) -> None:
        super().__init__()
        self.arch = cfg.arch
        if cfg.arch == GPT2:
            self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden)
            self.wpe = nn.Embedding(cfg.max_positions, cfg.hidden)
            _normal_(self.wte.weight, std)
            _normal_(self.wpe.weight, std)
        else:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden)
            _normal_(self.embed_tokens.weight, std)

    @property
    def token_weight(self) -> nn.Parameter:
        module = self.wte if self.arch == GPT2 else self.embed_tokens
        weight = module.weight
        assert isinstance(weight, nn.Parameter)
        return weight

    def forward(self, input_ids: torch.Tensor, context: StepContext | None = None) -> torch.Tensor:
        if input_ids.dim() != 2 or input_ids.is_floating_point():
            raise ValueError(
                f"a causal LM's embedding takes integer token ids [B, N], got "
                f"{input_ids.dtype} {tuple(input_ids.shape)}"
            )
        if self.arch != GPT2:
            return self.embed_tokens(input_ids)
        if context is None:
            batch, length = input_ids.shape
            context = StepContext.causal(batch, length, input_ids.device)
        return self.wte(input_ids) + self.wpe(context.positions)


class Gpt2Attention(nn.Module):
    def __init__(self, cfg: CausalLmConfig, layer: int, std: float) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.scale = cfg.attention_scale(layer)
        self.c_attn = Conv1D(3 * cfg.hidden, cfg.hidden, std)
        self.c_proj = Conv1D(cfg.hidden, cfg.hidden, std)

    def forward(self, hidden: torch.Tensor, context: StepContext) -> torch.Tensor:
        batch, length, width = hidden.shape
        query, key, value = self.c_attn(hidden).split(width, dim=2)
        shape = (batch, length, self.heads, self.head_dim)
        query, key, value = (t.view(shape).transpose(1, 2) for t in (query, key, value))
        keys, values = context.keys_values(self.layer, key, value)
        return self.c_proj(_attend(query, keys, values, context, scale=self.scale))


class Gpt2Mlp(nn.Module):
    def __init__(self, cfg: CausalLmConfig, std: float) -> None:
        super().__init__()
        self.activation = cfg.activation
        self.c_fc = Conv1D(cfg.intermediate, cfg.hidden, std)
        self.c_proj = Conv1D(cfg.hidden, cfg.intermediate, std)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.c_proj(_gelu(self.activation, self.c_fc(hidden)))


class Gpt2Block(nn.Module):
    """A GPT-2 decoder block: pre-LN attention and MLP, each with its residual."""

    def __init__(self, cfg: CausalLmConfig, layer: int, std: float = 0.02) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attn = Gpt2Attention(cfg, layer, std)
        self.ln_2 = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.mlp = Gpt2Mlp(cfg, std)

    def forward(self, hidden: torch.Tensor, context: StepContext | None = None) -> torch.Tensor:
        if context is None:
            context = StepContext.causal(hidden.shape[0], hidden.shape[1], hidden.device)
        hidden = hidden + self.attn(self.ln_1(hidden), context)
        return hidden + self.mlp(self.ln_2(hidden))


class LlamaAttention(nn.Module):
    def __init__(self, cfg: CausalLmConfig, layer: int, std: float) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.attention_scale(layer)
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = _linear(cfg.hidden, q, bias=cfg.qkv_bias, std=std)
        self.k_proj = _linear(cfg.hidden, kv, bias=cfg.qkv_bias, std=std)
        self.v_proj = _linear(cfg.hidden, kv, bias=cfg.qkv_bias, std=std)
        self.o_proj = _linear(q, cfg.hidden, bias=cfg.out_bias, std=std)
        assert cfg.rope is not None
        # Plain data, not a buffer: nothing to save or load, the same on every stage.
        self.rotary = Rotary(cfg.rope, cfg.head_dim)

    def forward(self, hidden: torch.Tensor, context: StepContext) -> torch.Tensor:
        batch, length, _ = hidden.shape
        query = self.q_proj(hidden).view(batch, length, -1, self.head_dim).transpose(1, 2)
        key = self.k_proj(hidden).view(batch, length, -1, self.head_dim).transpose(1, 2)
        value = self.v_proj(hidden).view(batch, length, -1, self.head_dim).transpose(1, 2)
        cos, sin = context.cos_sin(self.rotary, hidden.dtype)
        query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
        keys, values = context.keys_values(self.layer, key, value)
        return self.o_proj(_attend(query, keys, values, context, scale=self.scale))


class LlamaMlp(nn.Module):
    def __init__(self, cfg: CausalLmConfig, std: float) -> None:
        super().__init__()
        self.gate_proj = _linear(cfg.hidden, cfg.intermediate, bias=cfg.mlp_bias, std=std)
        self.up_proj = _linear(cfg.hidden, cfg.intermediate, bias=cfg.mlp_bias, std=std)
        self.down_proj = _linear(cfg.intermediate, cfg.hidden, bias=cfg.mlp_bias, std=std)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(hidden)) * self.up_proj(hidden))


class LlamaBlock(nn.Module):
    """A Llama/Qwen2 decoder block: RMSNorm, rotary GQA attention, SwiGLU MLP."""

    def __init__(self, cfg: CausalLmConfig, layer: int, std: float = 0.02) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg, layer, std)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = LlamaMlp(cfg, std)

    def forward(self, hidden: torch.Tensor, context: StepContext | None = None) -> torch.Tensor:
        if context is None:
            context = StepContext.causal(hidden.shape[0], hidden.shape[1], hidden.device)
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), context)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LmHead(nn.Module):
    """The last unit: the final norm and the LM head, hidden [..., H] -> logits [..., V]."""

    def __init__(self, cfg: CausalLmConfig, std: float = 0.02) -> None:
        super().__init__()
        self.arch = cfg.arch
        if cfg.arch == GPT2:
            self.ln_f = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        else:
            self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head = _linear(cfg.hidden, cfg.vocab_size, bias=False, std=std)

    def forward(self, hidden: torch.Tensor, context: StepContext | None = None) -> torch.Tensor:
        normed = self.ln_f(hidden) if self.arch == GPT2 else self.norm(hidden)
        logits: torch.Tensor = self.lm_head(normed)
        return logits


def make_unit(cfg: CausalLmConfig, index: int) -> nn.Module:
    """Unit `index` with fresh random weights (normal, std ``cfg.init_std``; biases 0)."""
    std = cfg.init_std
    if index == 0:
        return TokenEmbedding(cfg, std)
    if index == cfg.num_units - 1:
        return LmHead(cfg, std)
    block = Gpt2Block if cfg.arch == GPT2 else LlamaBlock
    return block(cfg, index - 1, std)
