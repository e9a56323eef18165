"""Post-LN BERT (Devlin et al.; Hugging Face's ``BertModel``) in PipeEdge's units.

The transformer family's kind "bert-post": the layout BERT checkpoints have,
so that ``python -m zpipe import hf-bert`` maps one onto it. Unlike kind
"bert" (pre-LN), every LayerNorm follows its residual sum, the embeddings add
token types, and an attention mask hides padding. Inputs: ``input_ids`` and,
optionally, ``attention_mask`` (1 attend, 0 padding) and ``token_type_ids``,
all integer ``[B, S]``. The mask rides along every unit, as an integer
tensor, so it needs no gradient:

    embed        ids, mask, types -> (hidden, mask)
    blockN.attn  qkv projection + masked softmax(QK^T)V -> (context, residual, mask)
    blockN.proj  output projection + residual, LayerNorm -> (hidden, mask)
    blockN.fc1   first dense layer + GELU                -> (intermediate, residual, mask)
    blockN.fc2   second dense layer + residual, LayerNorm -> (hidden, mask)
    head         pooler (dense + tanh on [CLS]), classifier (none with num_classes 0)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from zpipe.models.transformer import TransformerConfig


def _mask_of(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    if attention_mask is None:
        return torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape or attention_mask.is_floating_point():
        raise ValueError(
            f"attention_mask must be integer [B, S] like input_ids {tuple(input_ids.shape)}, "
            f"got {attention_mask.dtype} {tuple(attention_mask.shape)}"
        )
    return attention_mask


class PostLnEmbedding(nn.Module):
    """Unit 0: word + position + token-type embeddings, LayerNorm; passes the mask on."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.max_positions = cfg.max_positions
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.position = nn.Embedding(cfg.max_positions, cfg.hidden)
        self.token_type = (
            nn.Embedding(cfg.type_vocab_size, cfg.hidden) if cfg.type_vocab_size else None
        )
        self.norm = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)
        for embedding in (self.word, self.position, self.token_type):
            if embedding is not None:
                nn.init.normal_(embedding.weight, std=0.02)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if input_ids.dim() != 2 or input_ids.is_floating_point():
            raise ValueError(
                f"BERT expects integer token ids [B, S], got {input_ids.dtype} "
                f"{tuple(input_ids.shape)}"
            )
        length = input_ids.shape[1]
        if length > self.max_positions:
            raise ValueError(f"sequence length {length} exceeds max_positions={self.max_positions}")
        mask = _mask_of(input_ids, attention_mask)
        positions = torch.arange(length, device=input_ids.device)
        hidden = self.word(input_ids) + self.position(positions)
        if self.token_type is not None:
            if token_type_ids is None:
                hidden = hidden + self.token_type.weight[0]
            else:
                hidden = hidden + self.token_type(token_type_ids)
        return self.norm(hidden), mask


class PostLnAttention(nn.Module):
    """Sub-layer 1: qkv projection and attention over the tokens the mask keeps."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)

    def forward(
        self, hidden: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, length, width = hidden.shape
        qkv = self.qkv(hidden)
        qkv = qkv.reshape(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        query, key, value = qkv.unbind(0)
        # An additive mask, as BERT's own: a padded key gets the dtype's lowest
        # score, so a row never becomes all -inf (which would give NaN).
        lowest = torch.finfo(hidden.dtype).min
        additive = (1.0 - mask[:, None, None, :].to(hidden.dtype)) * lowest
        context = F.scaled_dot_product_attention(query, key, value, attn_mask=additive)
        context = context.transpose(1, 2).reshape(batch, length, width)
        return context, hidden, mask


class PostLnAttentionOutput(nn.Module):
    """Sub-layer 2: output projection, residual, then LayerNorm."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.norm = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)

    def forward(
        self, context: torch.Tensor, residual: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.norm(self.proj(context) + residual), mask


class PostLnMlpIn(nn.Module):
    """Sub-layer 3: first dense layer and GELU."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, cfg.mlp)

    def forward(
        self, hidden: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return F.gelu(self.fc1(hidden)), hidden, mask


class PostLnMlpOut(nn.Module):
    """Sub-layer 4: second dense layer, residual, then LayerNorm."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.fc2 = nn.Linear(cfg.mlp, cfg.hidden)
        self.norm = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)

    def forward(
        self, intermediate: torch.Tensor, residual: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.norm(self.fc2(intermediate) + residual), mask


class PostLnBertHead(nn.Module):
    """Last unit: BERT's pooler (dense + tanh on [CLS]) and a classifier; with
    num_classes 0, the pooled output itself (``BertModel``'s ``pooler_output``)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.pooler = nn.Linear(cfg.hidden, cfg.hidden)
        self.classifier = nn.Linear(cfg.hidden, cfg.num_classes) if cfg.num_classes else None

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        del mask  # the pooler reads [CLS], which is never padding
        pooled = torch.tanh(self.pooler(hidden[:, 0]))
        return self.classifier(pooled) if self.classifier is not None else pooled


BLOCK_PARTS: tuple[type[nn.Module], ...] = (
    PostLnAttention,
    PostLnAttentionOutput,
    PostLnMlpIn,
    PostLnMlpOut,
)


def block_part_elements(cfg: TransformerConfig) -> tuple[int, int, int, int]:
    """Parameters of attn, proj, fc1 and fc2 (the LayerNorms sit in proj and fc2)."""
    h, m = cfg.hidden, cfg.mlp
    return (3 * h * h + 3 * h, h * h + h + 2 * h, h * m + m, m * h + h + 2 * h)


def head_elements(cfg: TransformerConfig) -> int:
    h, c = cfg.hidden, cfg.num_classes
    return h * h + h + h * c + c


def example_input(
    cfg: TransformerConfig, batch_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, ...]:
    """Token ids, a padding mask (every sequence keeps at least its [CLS]) and
    token types (a first and a second segment)."""
    shape = (batch_size, cfg.seq_len)
    ids = torch.randint(0, cfg.vocab_size, shape, generator=generator)
    lengths = torch.randint(1, cfg.seq_len + 1, (batch_size, 1), generator=generator)
    positions = torch.arange(cfg.seq_len).expand(shape)
    mask = (positions < lengths).to(torch.int64)
    split = torch.randint(1, cfg.seq_len + 1, (batch_size, 1), generator=generator)
    types = (positions >= split).to(torch.int64) if cfg.type_vocab_size > 1 else positions * 0
    return ids, mask, types
