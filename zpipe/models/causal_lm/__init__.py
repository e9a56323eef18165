"""Decoder-only causal language models (GPT-2 style, Llama/Qwen2 style) and the
per-stage KV cache that generation runs on.

    spec = causal_lm_spec("/models/tiny-llama")            # or ModelSpec.preset("llama-tiny")
    stage = CausalLmStage.build(spec, 0, 3, kv_budget_bytes=256 << 20)
    stage.open_sequence(1, max_tokens=64)
    hidden = stage.forward([SequenceChunk(1, 0, 5)], token_ids)    # packed [5, hidden]

The planner sizes a cache from the config alone with
`kv_bytes_per_token_per_block(read_causal_lm_config(spec.config))`.
"""

from __future__ import annotations

from zpipe.models.causal_lm.checkpoint import HfCheckpoint, load_checkpoint_units
from zpipe.models.causal_lm.config import (
    CausalLmConfig,
    RopeConfig,
    kv_bytes_per_token_per_block,
    read_causal_lm_config,
)
from zpipe.models.causal_lm.family import FAMILY, CausalLmSequence, causal_lm_spec
from zpipe.models.causal_lm.kv_cache import KvCache, SequenceChunk
from zpipe.models.causal_lm.stage import CausalLmStage, chain_forward

__all__ = [
    "FAMILY",
    "CausalLmConfig",
    "CausalLmSequence",
    "CausalLmStage",
    "HfCheckpoint",
    "KvCache",
    "RopeConfig",
    "SequenceChunk",
    "causal_lm_spec",
    "chain_forward",
    "kv_bytes_per_token_per_block",
    "load_checkpoint_units",
    "read_causal_lm_config",
]
