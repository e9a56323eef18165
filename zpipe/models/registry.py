"""From a spec to its LayerSequence: dispatch on the family name."""

from __future__ import annotations

from collections.abc import Callable

from zpipe._errors import ModelSpecError
from zpipe.models.adapters import SequentialSequence, TracedSequence
from zpipe.models.cnn import CnnSequence
from zpipe.models.mlp import MlpSequence
from zpipe.models.sequence import FullModel, LayerSequence
from zpipe.models.spec import ModelSpec
from zpipe.models.transformer import TransformerSequence

FAMILIES: dict[str, Callable[[ModelSpec], LayerSequence]] = {
    "transformer": TransformerSequence,
    "mlp": MlpSequence,
    "cnn": CnnSequence,
    "sequential": SequentialSequence,
    "traced": TracedSequence,
}


def load_layer_sequence(spec: ModelSpec) -> LayerSequence:
    """The model described by `spec`; validates the config but builds no units."""
    if not isinstance(spec, ModelSpec):
        raise ModelSpecError(
            f"expected a ModelSpec, got {type(spec).__name__}; use ModelSpec.from_dict(...)"
        )
    try:
        family = FAMILIES[spec.family]
    except KeyError:
        raise ModelSpecError(
            f"unknown model family {spec.family!r}; use one of {sorted(FAMILIES)}"
        ) from None
    return family(spec)


def build_full_model(spec: ModelSpec) -> FullModel:
    """Every unit in one module: forward(*inputs) -> tuple of Tensors, like run_units."""
    sequence = load_layer_sequence(spec)
    return FullModel(sequence.build_units(0, sequence.num_units))
