"""ModelSpec: the plain-data description of a model that travels to every stage.

A spec is small and safe to send: the family name, a config of plain values
(msgpack-able, no pickling) and a seed. Every stage rebuilds its own units from
it, so two stages that build overlapping units get identical weights.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zpipe._errors import ModelSpecError

# msgpack carries integers of at most 64 bits.
_INT_MIN = -(2**63)
_INT_MAX = 2**64 - 1
SEED_LIMIT = 2**63
_SPEC_KEYS = ("family", "config", "seed", "weights")


def plain_copy(value: Any, *, where: str) -> Any:
    """A deep copy of `value` made of dict/list/str/int/float/bool/None only.

    Tuples become lists so that a spec equals itself after a msgpack round trip.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if not _INT_MIN <= value <= _INT_MAX:
            raise ModelSpecError(f"{where} = {value} does not fit in 64 bits")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ModelSpecError(f"{where} = {value} is not a finite number")
        return value
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ModelSpecError(f"{where} has a non-string key {key!r}; use strings")
            out[key] = plain_copy(item, where=f"{where}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [plain_copy(item, where=f"{where}[{i}]") for i, item in enumerate(value)]
    raise ModelSpecError(
        f"{where} is a {type(value).__name__}; a spec may hold only "
        "str/int/float/bool/None/list/dict so that it can be sent as msgpack"
    )


@dataclass(frozen=True)
class ModelSpec:
    """What to build: a family, its config, a seed and optionally a weights file.

    `weights` is a path on the machine that builds the units (each stage reads
    its own copy); keys are those of `build_full_model(spec).state_dict()`,
    i.e. ``"units.<index>.<name inside the unit>"``.
    """

    family: str
    config: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0
    weights: str | None = None
    # True for a spec read with from_dict (every spec off the wire): a factory it
    # names loads only if this process's operator allowed it (zpipe.models.trust).
    # Not part of the spec's value: equal specs stay equal, to_dict is unchanged.
    from_peer: bool = field(default=False, compare=False, repr=False, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.family, str) or not self.family:
            raise ModelSpecError(f"model family must be a non-empty string, got {self.family!r}")
        if not isinstance(self.config, Mapping):
            raise ModelSpecError(f"model config must be a mapping, got {self.config!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ModelSpecError(f"model seed must be an integer, got {self.seed!r}")
        if not 0 <= self.seed < SEED_LIMIT:
            raise ModelSpecError(f"model seed must be in [0, 2**63), got {self.seed}")
        if self.weights is not None and not isinstance(self.weights, str):
            raise ModelSpecError(f"weights must be a path string or None, got {self.weights!r}")
        if not isinstance(self.from_peer, bool):
            raise ModelSpecError(f"from_peer must be True or False, got {self.from_peer!r}")
        # A private copy: later changes to the caller's dict cannot change the spec.
        object.__setattr__(self, "config", plain_copy(self.config, where="config"))

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    def to_dict(self) -> dict[str, Any]:
        """Plain data for msgpack/JSON; `from_dict` turns it back into an equal spec."""
        return {
            "family": self.family,
            "config": plain_copy(self.config, where="config"),
            "seed": self.seed,
            "weights": self.weights,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, from_peer: bool = True) -> ModelSpec:
        """Validate a dict (e.g. received from a peer) and build a spec from it.

        The spec counts as a peer's (see zpipe.models.trust) unless `from_peer` is
        False, which a process passes only for a spec its own operator wrote.
        """
        if not isinstance(data, Mapping):
            raise ModelSpecError(f"a model spec must be a mapping, got {type(data).__name__}")
        unknown = sorted(str(key) for key in data if key not in _SPEC_KEYS)
        if unknown:
            raise ModelSpecError(f"unknown model spec keys {unknown}; allowed are {_SPEC_KEYS}")
        if "family" not in data:
            raise ModelSpecError("a model spec needs a 'family'")
        return cls(
            family=data["family"],
            config=data.get("config", {}),
            seed=data.get("seed", 0),
            weights=data.get("weights"),
            from_peer=from_peer,
        )

    @classmethod
    def preset(
        cls, name: str, *, seed: int = 0, weights: str | None = None, **overrides: Any
    ) -> ModelSpec:
        """A named model (see `available_presets()`), with config keys overridden.

        Example: `ModelSpec.preset("vit-base", num_layers=2, image_size=32)`.
        """
        # Imported here: the presets and the families themselves import this module.
        from zpipe.models.presets import PRESETS, available_presets
        from zpipe.models.registry import load_layer_sequence

        if name not in PRESETS:
            raise ModelSpecError(
                f"unknown model preset {name!r}; available: {', '.join(available_presets())}"
            )
        family, config = PRESETS[name]
        spec = cls(family=family, config={**config, **overrides}, seed=seed, weights=weights)
        load_layer_sequence(spec)  # raises ModelSpecError for overrides that make no sense
        return spec
