"""Models as sequences of partitioning units that pipeline stages build separately.

    spec = ModelSpec.preset("vit-base")
    sequence = load_layer_sequence(spec)         # validates, builds nothing
    units = sequence.build_units(10, 20)         # only units 10..19, eval mode
    outputs = run_units(units, inputs)           # tuple[Tensor, ...]

Causal language models and their per-stage KV cache are in
zpipe.models.causal_lm (family "causal_lm").

A unit receives the previous unit's outputs as positional arguments. Weights
files use the names of `build_full_model(spec).state_dict()`: "units.<i>.<name>".
"""

from __future__ import annotations

from zpipe.models.presets import available_presets
from zpipe.models.registry import (
    FAMILIES,
    USER_CODE_FAMILIES,
    build_full_model,
    count_units,
    declared_units,
    load_layer_sequence,
)
from zpipe.models.sequence import FullModel, LayerSequence, run_units, unit_param_bytes
from zpipe.models.spec import ModelSpec
from zpipe.models.trust import (
    FactoryAllowList,
    allow_peer_factories,
    peer_factories,
    peer_factories_allowed,
)
from zpipe.models.weights import load_unit_weights, save_weights

__all__ = [
    "FAMILIES",
    "USER_CODE_FAMILIES",
    "FactoryAllowList",
    "FullModel",
    "LayerSequence",
    "ModelSpec",
    "allow_peer_factories",
    "available_presets",
    "build_full_model",
    "count_units",
    "declared_units",
    "load_layer_sequence",
    "load_unit_weights",
    "peer_factories",
    "peer_factories_allowed",
    "run_units",
    "save_weights",
    "unit_param_bytes",
]
