"""From a spec to its LayerSequence: dispatch on the family name.

Families that import user code (USER_CODE_FAMILIES) load a factory only if the
policy allows it (zpipe.models.trust): `factories=` when given, else the
process's peer allow-list for a spec received from a peer, else the caller's
own choice. `count_units` answers a spec's unit count without running any user
code, for processes (the coordinator) that must never import a peer's factory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zpipe._errors import ModelSpecError
from zpipe.models.adapters import SequentialSequence, TracedSequence
from zpipe.models.causal_lm.family import CausalLmSequence
from zpipe.models.cnn import CnnSequence
from zpipe.models.mlp import MlpSequence
from zpipe.models.sequence import FullModel, LayerSequence
from zpipe.models.size import DEFAULT_PEER_MODEL_BYTES, check_model_size
from zpipe.models.spec import ModelSpec
from zpipe.models.transformer import TransformerSequence
from zpipe.models.trust import FactoryPolicy

# Each is called as family(spec); a user-code family also takes factories=.
FAMILIES: dict[str, Callable[..., LayerSequence]] = {
    "transformer": TransformerSequence,
    "mlp": MlpSequence,
    "cnn": CnnSequence,
    "sequential": SequentialSequence,
    "traced": TracedSequence,
    "causal_lm": CausalLmSequence,
}
# A peer's declared count sizes the planner's tables: bound it.
MAX_DECLARED_UNITS = 100_000
# Families whose config names a factory to import ("package.module:callable").
USER_CODE_FAMILIES = frozenset({"sequential", "traced"})


def load_layer_sequence(
    spec: ModelSpec, *, factories: FactoryPolicy | None = None
) -> LayerSequence:
    """The model described by `spec`; validates the config but builds no units.

    A user-code family imports its factory here, after `factories` (or the default
    policy, see zpipe.models.trust) allowed it; else UntrustedCodeError.
    """
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
    if spec.family in USER_CODE_FAMILIES:
        return family(spec, factories=factories)
    return family(spec)


def build_full_model(spec: ModelSpec, *, factories: FactoryPolicy | None = None) -> FullModel:
    """Every unit in one module: forward(*inputs) -> tuple of Tensors, like run_units."""
    sequence = load_layer_sequence(spec, factories=factories)
    return FullModel(sequence.build_units(0, sequence.num_units))


def count_units(spec: ModelSpec, *, declared: Any = None) -> int:
    """How many units `spec` has, without importing or running any user code.

    Built-in families compute it from their config (and a `declared` count must
    agree). A user-code family's count is only known by building the user's
    module, so it must be `declared` by a process that may build it (the client
    computes `load_layer_sequence(spec).num_units` and sends it with its request);
    a stage that builds the units refuses a range outside the real count.
    A peer's built-in model is also bounded (units, and parameters counted from
    its config, see zpipe.models.size) before anything is planned for it.
    """
    if declared is not None and (
        isinstance(declared, bool)
        or not isinstance(declared, int)
        or not 1 <= declared <= MAX_DECLARED_UNITS
    ):
        raise ModelSpecError(
            f"a declared unit count must be an integer in [1, {MAX_DECLARED_UNITS}], "
            f"got {declared!r}"
        )
    if spec.family in USER_CODE_FAMILIES:
        if declared is None:
            raise ModelSpecError(
                f"a {spec.family!r} model's unit count is only known by running its factory, "
                "which this process does not do: the client must send num_units with the "
                "request (load_layer_sequence(spec).num_units on the client)"
            )
        return int(declared)
    sequence = load_layer_sequence(spec)
    counted = sequence.num_units
    if spec.from_peer:
        # A peer's config can name any size; the planner sizes its tables by units.
        if counted > MAX_DECLARED_UNITS:
            raise ModelSpecError(
                f"the model has {counted} units, more than {MAX_DECLARED_UNITS} that a "
                "peer may ask for"
            )
        check_model_size(sequence, limit_bytes=DEFAULT_PEER_MODEL_BYTES, what="any device")
    if declared is not None and declared != counted:
        raise ModelSpecError(f"the request declares {declared} units, but the model has {counted}")
    return counted


def declared_units(spec: ModelSpec) -> int | None:
    """What a client sends as run_request's ``num_units``: the unit count of a
    user-code model, built here, in the process that named its factory (so that the
    coordinator never has to run it); None for a built-in family, which the
    coordinator counts from its config."""
    if spec.family not in USER_CODE_FAMILIES:
        return None
    return load_layer_sequence(spec).num_units
