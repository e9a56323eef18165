"""Named models: the sizes of the papers (ViT, BERT) plus tiny ones for tests."""

from __future__ import annotations

from typing import Any

# name -> (family, config). Sizes follow ViT (Dosovitskiy et al., Table 1) and
# BERT (Devlin et al.): layers, hidden size, heads, MLP size.
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "vit-tiny": (
        "transformer",
        {
            "kind": "vit",
            "num_layers": 2,
            "hidden": 32,
            "heads": 2,
            "mlp": 64,
            "image_size": 32,
            "patch": 8,
            "num_classes": 10,
        },
    ),
    "vit-base": (
        "transformer",
        {
            "kind": "vit",
            "num_layers": 12,
            "hidden": 768,
            "heads": 12,
            "mlp": 3072,
            "image_size": 224,
            "patch": 16,
            "num_classes": 1000,
        },
    ),
    "vit-large": (
        "transformer",
        {
            "kind": "vit",
            "num_layers": 24,
            "hidden": 1024,
            "heads": 16,
            "mlp": 4096,
            "image_size": 224,
            "patch": 16,
            "num_classes": 1000,
        },
    ),
    "vit-huge": (
        "transformer",
        {
            "kind": "vit",
            "num_layers": 32,
            "hidden": 1280,
            "heads": 16,
            "mlp": 5120,
            "image_size": 224,
            "patch": 14,
            "num_classes": 1000,
        },
    ),
    "bert-tiny": (
        "transformer",
        {
            "kind": "bert",
            "num_layers": 2,
            "hidden": 32,
            "heads": 2,
            "mlp": 64,
            "vocab_size": 100,
            "seq_len": 16,
            "max_positions": 16,
            "num_classes": 2,
        },
    ),
    "bert-base": (
        "transformer",
        {
            "kind": "bert",
            "num_layers": 12,
            "hidden": 768,
            "heads": 12,
            "mlp": 3072,
            "vocab_size": 30522,
            "seq_len": 512,
            "max_positions": 512,
            "num_classes": 2,
        },
    ),
    "bert-large": (
        "transformer",
        {
            "kind": "bert",
            "num_layers": 24,
            "hidden": 1024,
            "heads": 16,
            "mlp": 4096,
            "vocab_size": 30522,
            "seq_len": 512,
            "max_positions": 512,
            "num_classes": 2,
        },
    ),
    # BERT's own post-LN layout, with attention mask and token types: Hugging Face
    # BertModel checkpoints map onto it (python -m zpipe import hf-bert).
    "bert-post-tiny": (
        "transformer",
        {
            "kind": "bert-post",
            "num_layers": 2,
            "hidden": 32,
            "heads": 2,
            "mlp": 64,
            "vocab_size": 100,
            "seq_len": 16,
            "max_positions": 16,
            "num_classes": 2,
        },
    ),
    "bert-post-base": (
        "transformer",
        {
            "kind": "bert-post",
            "num_layers": 12,
            "hidden": 768,
            "heads": 12,
            "mlp": 3072,
            "vocab_size": 30522,
            "seq_len": 512,
            "max_positions": 512,
            "num_classes": 2,
        },
    ),
    "mlp-small": (
        "mlp",
        {"dims": [784, 512, 256, 128, 10], "activation": "relu"},
    ),
    "cnn-small": (
        "cnn",
        {"channels": [32, 64, 128, 128], "image_size": 32, "in_channels": 3, "num_classes": 10},
    ),
}


def available_presets() -> list[str]:
    return sorted(PRESETS)
