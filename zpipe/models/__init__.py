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

import importlib
from typing import TYPE_CHECKING, Any

from zpipe.models.presets import available_presets
from zpipe.models.spec import ModelSpec
from zpipe.models.trust import (
    FactoryAllowList,
    allow_peer_factories,
    peer_factories,
    peer_factories_allowed,
)

if TYPE_CHECKING:
    from zpipe.models.registry import (
        FAMILIES,
        USER_CODE_FAMILIES,
        build_full_model,
        count_units,
        declared_units,
        load_layer_sequence,
    )
    from zpipe.models.sequence import FullModel, LayerSequence, run_units, unit_param_bytes
    from zpipe.models.weights import load_unit_weights, save_weights

# What builds or loads layers needs torch: imported at its first use (PEP 562), so
# that a process which only reads specs and trust settings (the coordinator while it
# serves membership) does not import torch with them.
_NEEDS_TORCH = {
    "FAMILIES": "registry",
    "USER_CODE_FAMILIES": "registry",
    "build_full_model": "registry",
    "count_units": "registry",
    "declared_units": "registry",
    "load_layer_sequence": "registry",
    "FullModel": "sequence",
    "LayerSequence": "sequence",
    "run_units": "sequence",
    "unit_param_bytes": "sequence",
    "load_unit_weights": "weights",
    "save_weights": "weights",
}


def __getattr__(name: str) -> Any:
    module = _NEEDS_TORCH.get(name)
    if module is None:
        raise AttributeError(f"module 'zpipe.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"zpipe.models.{module}"), name)
    globals()[name] = value  # bound once: later look-ups skip this function
    return value


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
