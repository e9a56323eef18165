"""The ``causal_lm`` family: a decoder-only LM as a LayerSequence.

Its spec's config is the model's Hugging Face ``config.json`` (plain JSON);
its ``weights`` is a checkpoint directory (each stage reads its own tensors),
a zpipe weights file (``units.<i>.<name>``), or None for seeded random weights.

    spec = causal_lm_spec("/models/qwen2-0.5b")             # config.json + weights
    spec = ModelSpec.preset("llama-tiny", seed=3)           # random weights
    units = load_layer_sequence(spec).build_units(3, 7)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zpipe.models._seeding import seeded, unit_seed
from zpipe.models.base import UnitwiseSequence, check_batch_size, finish_units
from zpipe.models.causal_lm.checkpoint import load_checkpoint_units, read_config_json
from zpipe.models.causal_lm.config import (
    CausalLmConfig,
    kv_bytes_per_token_per_block,
    parameter_elements,
    read_causal_lm_config,
)
from zpipe.models.causal_lm.units import LmHead, TokenEmbedding, make_unit
from zpipe.models.spec import ModelSpec

FAMILY = "causal_lm"
# Keys of config.json that say nothing about the arithmetic but can be large
# (a tokenizer's task parameters): left out of a spec that travels to every stage.
_DROPPED_KEYS = ("task_specific_params", "id2label", "label2id")


def causal_lm_spec(directory: str | os.PathLike[str], *, seed: int = 0) -> ModelSpec:
    """The spec of a Hugging Face checkpoint directory (``config.json`` + safetensors)."""
    config: dict[str, Any] = {
        key: value for key, value in read_config_json(directory).items() if key not in _DROPPED_KEYS
    }
    read_causal_lm_config(config)  # refuse what cannot be built before anything travels
    return ModelSpec(FAMILY, config, seed=seed, weights=str(Path(directory)))


class CausalLmSequence(UnitwiseSequence):
    """Units: ``embed``, ``block0`` .. ``block{n-1}``, ``head`` (final norm + LM head)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec)
        self.config: CausalLmConfig = read_causal_lm_config(spec.config)

    @property
    def num_units(self) -> int:
        return self.config.num_units

    def unit_names(self) -> list[str]:
        return ["embed", *(f"block{i}" for i in range(self.config.num_layers)), "head"]

    def make_unit(self, index: int) -> nn.Module:
        return make_unit(self.config, index)

    def build_units(self, start: int, end: int) -> list[nn.Module]:
        units = self.fresh_units(start, end)
        self._tie(units, start, end)
        weights = self.spec.weights
        if weights is not None and Path(weights).is_dir():
            load_checkpoint_units(units, start=start, config=self.config, checkpoint=weights)
            for unit in units:
                unit.eval()
            return units
        return finish_units(units, start=start, spec=self.spec)

    def _tie(self, units: list[nn.Module], start: int, end: int) -> None:
        """A tied head holds the token embedding: the same Parameter when both are on
        this stage, else a copy of the embedding's seeded initial weights."""
        last = self.num_units - 1
        if not self.config.tie_word_embeddings or not start <= last < end:
            return
        head = units[last - start]
        assert isinstance(head, LmHead)
        if start == 0:
            embedding = units[0]
        else:
            with seeded(unit_seed(self.spec.seed, 0)):
                embedding = self.make_unit(0)
        assert isinstance(embedding, TokenEmbedding)
        if start == 0:
            head.lm_head.weight = embedding.token_weight
        else:
            with torch.no_grad():
                head.lm_head.weight.copy_(embedding.token_weight)

    def example_input(self, batch_size: int, *, seed: int = 0) -> tuple[torch.Tensor, ...]:
        check_batch_size(batch_size)
        generator = torch.Generator().manual_seed(seed)
        length = min(8, self.config.max_positions)
        ids = torch.randint(0, self.config.vocab_size, (batch_size, length), generator=generator)
        return (ids,)

    def parameter_elements(self, start: int, end: int) -> int:
        return parameter_elements(self.config, start, end)

    def largest_boundary_bytes(self) -> int:
        """Per sample, over a whole context: int64 token ids, hidden states or logits."""
        cfg = self.config
        return cfg.max_positions * max(8, 4 * cfg.hidden, 4 * cfg.vocab_size)

    def kv_bytes_per_token(self, start: int, end: int, *, element_bytes: int = 4) -> int:
        """KV cache bytes per token of the decoder blocks among units ``[start, end)``."""
        blocks = max(0, min(end, self.num_units - 1) - max(start, 1))
        return blocks * kv_bytes_per_token_per_block(self.config, element_bytes=element_bytes)
