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
    # Decoder-only causal LMs (zpipe.models.causal_lm): the config is a Hugging Face
    # config.json. Tiny ones for tests; GPT-2 small's shape for planning.
    "gpt2-tiny": (
        "causal_lm",
        {
            "model_type": "gpt2",
            "vocab_size": 100,
            "n_positions": 64,
            "n_embd": 32,
            "n_layer": 2,
            "n_head": 2,
        },
    ),
    "llama-tiny": (
        "causal_lm",
        {
            "model_type": "llama",
            "vocab_size": 100,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
        },
    ),
    "gpt2-small": (
        "causal_lm",
        {
            "model_type": "gpt2",
            "vocab_size": 50257,
            "n_positions": 1024,
            "n_embd": 768,
            "n_layer": 12,
            "n_head": 12,
        },
    ),
}


def available_presets() -> list[str]:
    return sorted(PRESETS)
