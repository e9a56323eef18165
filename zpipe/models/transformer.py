"""Transformer encoders (ViT and BERT) cut into PipeEdge's fine-grained units.

Units: embed, then four per block (PipeEdge, Fig. 3), then head:

    blockN.attn  LayerNorm + qkv projection + softmax(QK^T)V  -> (context, residual)
    blockN.proj  attention output projection + residual       -> hidden
    blockN.fc1   LayerNorm + first dense layer + GELU          -> (intermediate, residual)
    blockN.fc2   second dense layer + residual                 -> hidden

Blocks are pre-LN (as ViT) for kinds "vit" and "bert"; so the BERT head applies
a final LayerNorm before its pooler, like the ViT head does before its classifier.
Kind "bert-post" is BERT's own post-LN layout with an attention mask and token
types (zpipe.models.bert_post), onto which BERT checkpoints map. num_classes 0
leaves the classifier out: the head returns the features (ViT: the normalised
class token; BERT: the pooled output).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from zpipe._errors import ModelSpecError
from zpipe.models import bert_post
from zpipe.models._config import ConfigReader
from zpipe.models.base import UnitwiseSequence, check_batch_size
from zpipe.models.size import count_in_phase
from zpipe.models.spec import ModelSpec

KINDS = ("vit", "bert", "bert-post")
_VIT_KEYS = ("image_size", "patch", "channels")
_BERT_KEYS = ("vocab_size", "seq_len", "max_positions", "type_vocab_size")
PARTS_PER_BLOCK = 4
_PART_NAMES = ("attn", "proj", "fc1", "fc2")


@dataclass(frozen=True)
class TransformerConfig:
    kind: str
    num_layers: int
    hidden: int
    heads: int
    mlp: int
    num_classes: int
    layer_norm_eps: float
    image_size: int = 0
    patch: int = 0
    channels: int = 0
    vocab_size: int = 0
    seq_len: int = 0
    max_positions: int = 0
    type_vocab_size: int = 0

    @classmethod
    def parse(cls, reader: ConfigReader) -> TransformerConfig:
        kind = reader.get_str("kind", choices=KINDS)
        hidden = reader.get_int("hidden", minimum=1)
        heads = reader.get_int("heads", minimum=1)
        if hidden % heads:
            raise reader.error("heads", f"hidden={hidden} must be divisible by heads={heads}")
        common = cls(
            kind=kind,
            num_layers=reader.get_int("num_layers", minimum=0),
            hidden=hidden,
            heads=heads,
            mlp=reader.get_int("mlp", default=4 * hidden, minimum=1),
            num_classes=reader.get_int(
                "num_classes", default=1000 if kind == "vit" else 2, minimum=0
            ),
            layer_norm_eps=reader.get_float(
                "layer_norm_eps", default=1e-6 if kind == "vit" else 1e-12, positive=True
            ),
        )
        if kind == "vit":
            image_size = reader.get_int("image_size", default=224, minimum=1)
            patch = reader.get_int("patch", default=16, minimum=1)
            if image_size % patch:
                raise reader.error(
                    "patch", f"image_size={image_size} must be divisible by patch={patch}"
                )
            channels = reader.get_int("channels", default=3, minimum=1)
            reader.finish(not_applicable=_BERT_KEYS, why="to kind 'vit'")
            return replace(common, image_size=image_size, patch=patch, channels=channels)
        max_positions = reader.get_int("max_positions", default=512, minimum=1)
        seq_len = reader.get_int("seq_len", default=max_positions, minimum=1)
        if seq_len > max_positions:
            raise reader.error(
                "seq_len", f"{seq_len} exceeds max_positions={max_positions}; raise max_positions"
            )
        config = replace(
            common,
            vocab_size=reader.get_int("vocab_size", default=30522, minimum=1),
            seq_len=seq_len,
            max_positions=max_positions,
            type_vocab_size=reader.get_int("type_vocab_size", default=2, minimum=0),
        )
        reader.finish(not_applicable=_VIT_KEYS, why="to kind 'bert'")
        return config


class PatchEmbedding(nn.Module):
    """ViT unit 0: images [B,C,H,W] -> patch tokens with cls token and positions."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.image_size = cfg.image_size
        self.proj = nn.Conv2d(cfg.channels, cfg.hidden, kernel_size=cfg.patch, stride=cfg.patch)
        num_patches = (cfg.image_size // cfg.patch) ** 2
        self.cls_token = nn.Parameter(torch.empty(1, 1, cfg.hidden))
        self.pos_embed = nn.Parameter(torch.empty(1, num_patches + 1, cfg.hidden))
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.dim() != 4 or tuple(images.shape[-2:]) != (self.image_size,) * 2:
            raise ValueError(
                f"ViT expects images [B, C, {self.image_size}, {self.image_size}], "
                f"got {tuple(images.shape)}; set image_size in the spec config to match"
            )
        tokens = self.proj(images).flatten(2).transpose(1, 2)
        cls = self.cls_token.expand(tokens.shape[0], -1, -1).to(tokens.dtype)
        return torch.cat([cls, tokens], dim=1) + self.pos_embed


class TokenEmbedding(nn.Module):
    """BERT unit 0: token ids [B,S] -> token + position (+ segment 0) embeddings, LayerNorm."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.max_positions = cfg.max_positions
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.position = nn.Embedding(cfg.max_positions, cfg.hidden)
        # Inputs carry no segment ids, so every token is segment 0 (as for one sentence).
        self.segment = (
            nn.Embedding(cfg.type_vocab_size, cfg.hidden) if cfg.type_vocab_size else None
        )
        self.norm = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)
        for embedding in (self.word, self.position, self.segment):
            if embedding is not None:
                nn.init.normal_(embedding.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dim() != 2 or input_ids.is_floating_point():
            raise ValueError(
                f"BERT expects integer token ids [B, S], got {input_ids.dtype} "
                f"{tuple(input_ids.shape)}"
            )
        length = input_ids.shape[1]
        if length > self.max_positions:
            raise ValueError(f"sequence length {length} exceeds max_positions={self.max_positions}")
        positions = torch.arange(length, device=input_ids.device)
        hidden = self.word(input_ids) + self.position(positions)
        if self.segment is not None:
            hidden = hidden + self.segment.weight[0]
        return self.norm(hidden)


class AttentionCore(nn.Module):
    """Sub-layer 1: LayerNorm, qkv projection, scaled dot-product attention."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.norm = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, length, width = hidden.shape
        qkv = self.qkv(self.norm(hidden))
        qkv = qkv.reshape(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        query, key, value = qkv.unbind(0)
        context = F.scaled_dot_product_attention(query, key, value)
        context = context.transpose(1, 2).reshape(batch, length, width)
        # The residual rides along so the next unit, possibly on another device, can add it.
        return context, hidden


class AttentionOutput(nn.Module):
    """Sub-layer 2: attention output projection plus the residual."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, context: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.proj(context) + residual


class MlpIn(nn.Module):
    """Sub-layer 3: LayerNorm, first dense layer, GELU."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(cfg.hidden, cfg.mlp)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.gelu(self.fc1(self.norm(hidden))), hidden


class MlpOut(nn.Module):
    """Sub-layer 4: second dense layer plus the residual."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.fc2 = nn.Linear(cfg.mlp, cfg.hidden)

    def forward(self, intermediate: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.fc2(intermediate) + residual


class VitHead(nn.Module):
    """ViT last unit: final LayerNorm and classifier on the cls token."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)
        self.classifier = nn.Linear(cfg.hidden, cfg.num_classes) if cfg.num_classes else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # LayerNorm is per token, so normalising only the cls token gives the same logits.
        features = self.norm(hidden[:, 0])
        return self.classifier(features) if self.classifier is not None else features


class BertHead(nn.Module):
    """BERT last unit: final LayerNorm (pre-LN blocks), pooler (dense + tanh), classifier."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)
        self.pooler = nn.Linear(cfg.hidden, cfg.hidden)
        self.classifier = nn.Linear(cfg.hidden, cfg.num_classes) if cfg.num_classes else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        pooled = torch.tanh(self.pooler(self.norm(hidden[:, 0])))
        return self.classifier(pooled) if self.classifier is not None else pooled


_BLOCK_PARTS: tuple[type[nn.Module], ...] = (AttentionCore, AttentionOutput, MlpIn, MlpOut)


class TransformerSequence(UnitwiseSequence):
    """ViT or BERT encoder as 1 + 4 * num_layers + 1 units."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec)
        self.config = TransformerConfig.parse(ConfigReader(spec.config, family="transformer"))

    @property
    def num_units(self) -> int:
        return PARTS_PER_BLOCK * self.config.num_layers + 2

    def unit_names(self) -> list[str]:
        blocks = [
            f"block{block}.{part}"
            for block in range(self.config.num_layers)
            for part in _PART_NAMES
        ]
        return ["embed", *blocks, "head"]

    def parameter_elements(self, start: int, end: int) -> int:
        """Parameters of units ``[start, end)``, from the config alone, in time that
        does not grow with ``num_layers`` (a peer may ask for any number)."""
        cfg, last = self.config, self.num_units - 1
        h, m, c = cfg.hidden, cfg.mlp, cfg.num_classes
        total = 0
        if start <= 0 < end:
            if cfg.kind == "vit":
                patches = (cfg.image_size // cfg.patch) ** 2
                total += cfg.channels * h * cfg.patch**2 + h + h + (patches + 1) * h
            else:
                positions = cfg.max_positions + cfg.type_vocab_size
                total += (cfg.vocab_size + positions) * h + 2 * h
        if start <= last < end and last > 0:
            if cfg.kind == "bert-post":
                total += bert_post.head_elements(cfg)
            else:
                pooler = h * h + h if cfg.kind == "bert" else 0
                total += 2 * h + pooler + h * c + c
        # attn (LayerNorm + qkv), proj, fc1 (LayerNorm + dense), fc2
        parts = (2 * h + 3 * h * h + 3 * h, h * h + h, 2 * h + h * m + m, m * h + h)
        if cfg.kind == "bert-post":
            parts = bert_post.block_part_elements(cfg)
        lo, hi = max(start, 1), min(end, last)
        for phase, size in enumerate(parts):
            total += size * count_in_phase(lo, hi, offset=1, period=PARTS_PER_BLOCK, phase=phase)
        return total

    def largest_boundary_bytes(self) -> int:
        """The largest tensor between units, per sample: the input (an image, or int64
        token ids of up to max_positions), a token's hidden or MLP width over the
        sequence, or the logits."""
        cfg = self.config
        if cfg.kind == "vit":
            tokens = (cfg.image_size // cfg.patch) ** 2 + 1
            inputs = 4 * cfg.channels * cfg.image_size**2
        else:
            tokens = cfg.max_positions
            inputs = 8 * tokens
        return max(inputs, 4 * tokens * max(cfg.hidden, cfg.mlp), 4 * cfg.num_classes)

    def make_unit(self, index: int) -> nn.Module:
        cfg = self.config
        if not 0 <= index < self.num_units:
            raise ModelSpecError(f"unit index {index} is outside [0, {self.num_units})")
        if cfg.kind == "bert-post":
            if index == 0:
                return bert_post.PostLnEmbedding(cfg)
            if index == self.num_units - 1:
                return bert_post.PostLnBertHead(cfg)
            return bert_post.BLOCK_PARTS[(index - 1) % PARTS_PER_BLOCK](cfg)
        if index == 0:
            return PatchEmbedding(cfg) if cfg.kind == "vit" else TokenEmbedding(cfg)
        if index == self.num_units - 1:
            return VitHead(cfg) if cfg.kind == "vit" else BertHead(cfg)
        return _BLOCK_PARTS[(index - 1) % PARTS_PER_BLOCK](cfg)

    def example_input(self, batch_size: int, *, seed: int = 0) -> tuple[torch.Tensor, ...]:
        check_batch_size(batch_size)
        generator = torch.Generator().manual_seed(seed)
        cfg = self.config
        if cfg.kind == "vit":
            shape = (batch_size, cfg.channels, cfg.image_size, cfg.image_size)
            return (torch.randn(shape, generator=generator),)
        if cfg.kind == "bert-post":
            return bert_post.example_input(cfg, batch_size, generator)
        ids = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len), generator=generator)
        return (ids,)
