"""Foreign checkpoints mapped onto zpipe's built-in transformers.

``python -m zpipe import KIND SRC DEST`` (zpipe.cli.import_checkpoint) reads a timm or
Hugging Face checkpoint, infers the model's config from its tensors' shapes
(plus the head count, which no shape gives: from the checkpoint's
``config.json`` or ``--heads``), and writes the weights in zpipe's layout
("units.<i>.<name>") and the spec that builds the model. A ``.safetensors``
DEST lets every stage read only its own units' tensors.

    timm-vit  timm VisionTransformer (class token): qkv is already one tensor
    hf-vit    transformers ViTModel / ViTForImageClassification: query, key and
              value are concatenated into zpipe's qkv projection
    hf-bert   transformers BertModel / BertForSequenceClassification onto the
              post-LN kind "bert-post" (attention mask, token types)

Without a classifier in the checkpoint, the spec gets ``num_classes: 0`` and the
head returns the features (ViT: the normalised class token, as
``last_hidden_state[:, 0]``; BERT: ``pooler_output``). Keys the model has no
place for (a ViT pooler, BERT's pre-training heads) are listed, not loaded.
Nothing here imports timm or transformers: a checkpoint is only tensors.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zpipe._errors import ModelSpecError
from zpipe.models.spec import ModelSpec
from zpipe.models.transformer import PARTS_PER_BLOCK
from zpipe.models.weights import SAFETENSORS_SUFFIXES, TORCH_SUFFIXES, unit_key

# In a directory, the files transformers writes (the first found is read).
_CHECKPOINT_NAMES = ("model.safetensors", "pytorch_model.bin")
_CONFIG_NAME = "config.json"


@dataclass
class Imported:
    """A converted checkpoint: zpipe's state dict, the config that fits it, and the
    source keys that had no place in the model."""

    config: dict[str, Any]
    state: dict[str, torch.Tensor]
    dropped: list[str] = field(default_factory=list)

    def spec(self, *, weights: str | None = None, seed: int = 0) -> ModelSpec:
        return ModelSpec("transformer", dict(self.config), seed=seed, weights=weights)


class _Source:
    """The checkpoint's tensors, each taken once; what is never taken is dropped."""

    def __init__(self, state: Mapping[str, torch.Tensor], prefix: str) -> None:
        self.state = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
        self.outside = sorted(k for k in state if not k.startswith(prefix))
        self.taken: set[str] = set()

    def has(self, key: str) -> bool:
        return key in self.state

    def take(self, key: str) -> torch.Tensor:
        if key not in self.state:
            raise ModelSpecError(
                f"the checkpoint has no {key!r}; is it the kind of model the importer expects?"
            )
        self.taken.add(key)
        return self.state[key]

    def count_layers(self, pattern: str) -> int:
        found = {int(m.group(1)) for k in self.state if (m := re.match(pattern, k))}
        if found != set(range(len(found))):
            raise ModelSpecError(
                f"the checkpoint's layers are not numbered 0..n-1: {sorted(found)}"
            )
        return len(found)

    def dropped(self) -> list[str]:
        return self.outside + sorted(set(self.state) - self.taken)


def _prefix(state: Mapping[str, torch.Tensor], marker: str, wrapper: str) -> str:
    """A task model (``ViTForImageClassification``) keeps the base model under
    ``wrapper.``; a base model's keys start with ``marker`` itself."""
    if any(k.startswith(f"{wrapper}.{marker}") for k in state):
        return f"{wrapper}."
    if any(k.startswith(marker) for k in state):
        return ""
    raise ModelSpecError(
        f"the checkpoint has no {marker!r} keys (nor {wrapper}.{marker}); "
        "is it the kind of model the importer expects?"
    )


def _required_heads(heads: int | None, hidden: int, what: str) -> int:
    if heads is None:
        raise ModelSpecError(
            f"{what}: the number of attention heads is not in the tensors' shapes: "
            "give --heads N (or a config.json beside the checkpoint)"
        )
    if heads < 1 or hidden % heads:
        raise ModelSpecError(f"{what}: hidden={hidden} is not divisible by heads={heads}")
    return heads


def _check_activation(config: Mapping[str, Any]) -> None:
    act = config.get("hidden_act", "gelu")
    if act != "gelu":
        raise ModelSpecError(
            f"the checkpoint's hidden_act is {act!r}; zpipe's transformers use exact 'gelu'"
        )


def import_timm_vit(
    state: Mapping[str, torch.Tensor], *, heads: int | None = None, eps: float = 1e-6
) -> Imported:
    """A timm ``VisionTransformer`` with a class token (``vit_*_patch*``): its keys
    map one to one (``blocks.N.attn.qkv`` is already concatenated)."""
    if any(k in state for k in ("fc_norm.weight", "reg_token", "attn_pool.latent")):
        raise ModelSpecError(
            "this timm ViT pools without its class token (fc_norm, registers or "
            "attention pooling); zpipe's ViT head reads the class token"
        )
    src = _Source(state, "")
    weight = src.take("patch_embed.proj.weight")
    hidden, channels, patch = weight.shape[0], weight.shape[1], weight.shape[2]
    layers = src.count_layers(r"blocks\.(\d+)\.")
    out: dict[str, torch.Tensor] = {
        unit_key(0, "proj.weight"): weight,
        unit_key(0, "proj.bias"): src.take("patch_embed.proj.bias"),
        unit_key(0, "cls_token"): src.take("cls_token"),
        unit_key(0, "pos_embed"): src.take("pos_embed"),
    }
    mlp = src.state["blocks.0.mlp.fc1.weight"].shape[0] if layers else 4 * hidden
    names = {
        0: {"norm": "norm1", "qkv": "attn.qkv"},
        1: {"proj": "attn.proj"},
        2: {"norm": "norm2", "fc1": "mlp.fc1"},
        3: {"fc2": "mlp.fc2"},
    }
    for block in range(layers):
        for part, mapping in names.items():
            unit = 1 + PARTS_PER_BLOCK * block + part
            for ours, theirs in mapping.items():
                for leaf in ("weight", "bias"):
                    out[unit_key(unit, f"{ours}.{leaf}")] = src.take(
                        f"blocks.{block}.{theirs}.{leaf}"
                    )
    head = 1 + PARTS_PER_BLOCK * layers
    out[unit_key(head, "norm.weight")] = src.take("norm.weight")
    out[unit_key(head, "norm.bias")] = src.take("norm.bias")
    classes = 0
    if src.has("head.weight"):
        classes = src.state["head.weight"].shape[0]
        out[unit_key(head, "classifier.weight")] = src.take("head.weight")
        out[unit_key(head, "classifier.bias")] = src.take("head.bias")
    config = _vit_config(out, layers=layers, hidden=hidden, channels=channels, patch=patch)
    config.update(
        heads=_required_heads(heads, hidden, "timm-vit"),
        mlp=mlp,
        num_classes=classes,
        layer_norm_eps=eps,
    )
    return Imported(config, out, src.dropped())


def _vit_config(
    out: Mapping[str, torch.Tensor], *, layers: int, hidden: int, channels: int, patch: int
) -> dict[str, Any]:
    positions = out[unit_key(0, "pos_embed")].shape[1] - 1
    side = math.isqrt(positions)
    if side * side != positions:
        raise ModelSpecError(f"{positions} patch positions do not form a square image")
    return {
        "kind": "vit",
        "num_layers": layers,
        "hidden": hidden,
        "image_size": side * patch,
        "patch": patch,
        "channels": channels,
    }


def _cat_qkv(src: _Source, prefix: str, parts: tuple[str, str, str], leaf: str) -> torch.Tensor:
    """zpipe's qkv projection: query, key and value stacked along the output rows,
    the order in which its attention splits them."""
    return torch.cat([src.take(f"{prefix}.{part}.{leaf}") for part in parts])


@dataclass(frozen=True)
class _VitLayout:
    """Where a Hugging Face ViT layer keeps its tensors: transformers 4 wrote
    ``encoder.layer.N.attention.attention.query``, transformers 5 writes
    ``layers.N.attention.q_proj``."""

    layers: str
    attention: str
    qkv: tuple[str, str, str]
    out: str
    fc1: str
    fc2: str


_HF_VIT_LAYOUTS = (
    _VitLayout(
        "encoder.layer",
        "attention.attention",
        ("query", "key", "value"),
        "attention.output.dense",
        "intermediate.dense",
        "output.dense",
    ),
    _VitLayout(
        "layers",
        "attention",
        ("q_proj", "k_proj", "v_proj"),
        "attention.o_proj",
        "mlp.fc1",
        "mlp.fc2",
    ),
)


def import_hf_vit(
    state: Mapping[str, torch.Tensor],
    *,
    config: Mapping[str, Any] | None = None,
    heads: int | None = None,
) -> Imported:
    """Hugging Face ``ViTModel`` or ``ViTForImageClassification`` (``vit.`` prefix)."""
    config = dict(config or {})
    _check_activation(config)
    src = _Source(state, _prefix(state, "embeddings.", "vit"))
    weight = src.take("embeddings.patch_embeddings.projection.weight")
    hidden, channels, patch = weight.shape[0], weight.shape[1], weight.shape[2]
    layout = next(
        (lay for lay in _HF_VIT_LAYOUTS if any(k.startswith(f"{lay.layers}.") for k in src.state)),
        _HF_VIT_LAYOUTS[0],
    )
    layers = src.count_layers(rf"{re.escape(layout.layers)}\.(\d+)\.")
    out: dict[str, torch.Tensor] = {
        unit_key(0, "proj.weight"): weight,
        unit_key(0, "proj.bias"): src.take("embeddings.patch_embeddings.projection.bias"),
        unit_key(0, "cls_token"): src.take("embeddings.cls_token"),
        unit_key(0, "pos_embed"): src.take("embeddings.position_embeddings"),
    }
    for block in range(layers):
        layer = f"{layout.layers}.{block}"
        unit = 1 + PARTS_PER_BLOCK * block
        for leaf in ("weight", "bias"):
            out[unit_key(unit, f"norm.{leaf}")] = src.take(f"{layer}.layernorm_before.{leaf}")
            out[unit_key(unit, f"qkv.{leaf}")] = _cat_qkv(
                src, f"{layer}.{layout.attention}", layout.qkv, leaf
            )
            out[unit_key(unit + 1, f"proj.{leaf}")] = src.take(f"{layer}.{layout.out}.{leaf}")
            out[unit_key(unit + 2, f"norm.{leaf}")] = src.take(f"{layer}.layernorm_after.{leaf}")
            out[unit_key(unit + 2, f"fc1.{leaf}")] = src.take(f"{layer}.{layout.fc1}.{leaf}")
            out[unit_key(unit + 3, f"fc2.{leaf}")] = src.take(f"{layer}.{layout.fc2}.{leaf}")
    mlp = out[unit_key(3, "fc1.weight")].shape[0] if layers else 4 * hidden
    head = 1 + PARTS_PER_BLOCK * layers
    out[unit_key(head, "norm.weight")] = src.take("layernorm.weight")
    out[unit_key(head, "norm.bias")] = src.take("layernorm.bias")
    classes = 0
    if "classifier.weight" in state:  # outside the "vit." prefix
        classes = state["classifier.weight"].shape[0]
        out[unit_key(head, "classifier.weight")] = state["classifier.weight"]
        out[unit_key(head, "classifier.bias")] = state["classifier.bias"]
        src.outside = [k for k in src.outside if not k.startswith("classifier.")]
    zpipe_config = _vit_config(out, layers=layers, hidden=hidden, channels=channels, patch=patch)
    zpipe_config.update(
        heads=_required_heads(heads or config.get("num_attention_heads"), hidden, "hf-vit"),
        mlp=mlp,
        num_classes=classes,
        layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
    )
    return Imported(zpipe_config, out, src.dropped())


def import_hf_bert(
    state: Mapping[str, torch.Tensor],
    *,
    config: Mapping[str, Any] | None = None,
    heads: int | None = None,
) -> Imported:
    """Hugging Face ``BertModel`` or ``BertForSequenceClassification`` (``bert.``
    prefix) onto kind "bert-post"."""
    config = dict(config or {})
    _check_activation(config)
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise ModelSpecError("only absolute position embeddings map onto zpipe's BERT")
    src = _Source(state, _prefix(state, "embeddings.", "bert"))
    emb = "embeddings"
    word = src.take(f"{emb}.word_embeddings.weight")
    positions = src.take(f"{emb}.position_embeddings.weight")
    vocab, hidden = word.shape
    out: dict[str, torch.Tensor] = {
        unit_key(0, "word.weight"): word,
        unit_key(0, "position.weight"): positions,
        unit_key(0, "norm.weight"): src.take(f"{emb}.LayerNorm.weight"),
        unit_key(0, "norm.bias"): src.take(f"{emb}.LayerNorm.bias"),
    }
    types = 0
    if src.has(f"{emb}.token_type_embeddings.weight"):
        out[unit_key(0, "token_type.weight")] = src.take(f"{emb}.token_type_embeddings.weight")
        types = out[unit_key(0, "token_type.weight")].shape[0]
    layers = src.count_layers(r"encoder\.layer\.(\d+)\.")
    for block in range(layers):
        layer = f"encoder.layer.{block}"
        unit = 1 + PARTS_PER_BLOCK * block
        for leaf in ("weight", "bias"):
            out[unit_key(unit, f"qkv.{leaf}")] = _cat_qkv(
                src, f"{layer}.attention.self", ("query", "key", "value"), leaf
            )
            out[unit_key(unit + 1, f"proj.{leaf}")] = src.take(
                f"{layer}.attention.output.dense.{leaf}"
            )
            out[unit_key(unit + 1, f"norm.{leaf}")] = src.take(
                f"{layer}.attention.output.LayerNorm.{leaf}"
            )
            out[unit_key(unit + 2, f"fc1.{leaf}")] = src.take(f"{layer}.intermediate.dense.{leaf}")
            out[unit_key(unit + 3, f"fc2.{leaf}")] = src.take(f"{layer}.output.dense.{leaf}")
            out[unit_key(unit + 3, f"norm.{leaf}")] = src.take(f"{layer}.output.LayerNorm.{leaf}")
    mlp = out[unit_key(3, "fc1.weight")].shape[0] if layers else 4 * hidden
    head = 1 + PARTS_PER_BLOCK * layers
    out[unit_key(head, "pooler.weight")] = src.take("pooler.dense.weight")
    out[unit_key(head, "pooler.bias")] = src.take("pooler.dense.bias")
    classes = 0
    if "classifier.weight" in state:
        classes = state["classifier.weight"].shape[0]
        out[unit_key(head, "classifier.weight")] = state["classifier.weight"]
        out[unit_key(head, "classifier.bias")] = state["classifier.bias"]
        src.outside = [k for k in src.outside if not k.startswith("classifier.")]
    zpipe_config = {
        "kind": "bert-post",
        "num_layers": layers,
        "hidden": hidden,
        "heads": _required_heads(heads or config.get("num_attention_heads"), hidden, "hf-bert"),
        "mlp": mlp,
        "vocab_size": vocab,
        "max_positions": positions.shape[0],
        "seq_len": positions.shape[0],
        "type_vocab_size": types,
        "num_classes": classes,
        "layer_norm_eps": float(config.get("layer_norm_eps", 1e-12)),
    }
    return Imported(zpipe_config, out, src.dropped())


Importer = Callable[..., Imported]
IMPORTERS: dict[str, Importer] = {
    "timm-vit": import_timm_vit,
    "hf-vit": import_hf_vit,
    "hf-bert": import_hf_bert,
}


def import_checkpoint(
    kind: str,
    state: Mapping[str, torch.Tensor],
    *,
    config: Mapping[str, Any] | None = None,
    heads: int | None = None,
) -> Imported:
    """Convert ``state`` (a checkpoint's tensors) with the importer ``kind``."""
    if kind not in IMPORTERS:
        raise ModelSpecError(f"unknown importer {kind!r}; known: {', '.join(IMPORTERS)}")
    if kind == "timm-vit":
        cfg = dict(config or {})
        return import_timm_vit(state, heads=heads or cfg.get("num_heads"))
    return IMPORTERS[kind](state, config=config, heads=heads)


def read_checkpoint(source: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A checkpoint file's tensors, and the ``config.json`` beside it (or in the
    directory given), if any. Torch files load with ``weights_only`` (no code runs)."""
    path = Path(source)
    folder = path if path.is_dir() else path.parent
    if path.is_dir():
        found = [path / name for name in _CHECKPOINT_NAMES if (path / name).is_file()]
        if not found:
            raise ModelSpecError(f"{path} holds none of {', '.join(_CHECKPOINT_NAMES)}")
        path = found[0]
    if not path.is_file():
        raise ModelSpecError(f"checkpoint {path} does not exist")
    state: Any
    if path.suffix in SAFETENSORS_SUFFIXES:
        from safetensors.torch import load_file

        state = load_file(str(path))
    elif path.suffix in TORCH_SUFFIXES:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ModelSpecError(f"cannot read {path} as a state dict: {exc}") from exc
        if isinstance(state, Mapping) and isinstance(state.get("state_dict"), Mapping):
            state = state["state_dict"]
        if not isinstance(state, Mapping):
            raise ModelSpecError(f"{path} does not hold a state dict")
    else:
        raise ModelSpecError(f"checkpoint {path}: unknown suffix {path.suffix!r}")
    config: dict[str, Any] = {}
    config_file = folder / _CONFIG_NAME
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except (OSError, ValueError) as exc:
            raise ModelSpecError(f"cannot read {config_file}: {exc}") from exc
    tensors = {str(k): v for k, v in state.items() if isinstance(v, torch.Tensor)}
    return tensors, config
