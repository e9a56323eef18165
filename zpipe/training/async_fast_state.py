"""The state an asynchronous stage resumes from after a fast recovery (FTPipeHD III-F).

A fast recovery (:func:`zpipe.recovery.fast_recovery.plan_fast_recovery`) gives a
stage units of different weight versions: a survivor's own, after the updates it
had applied, and a dead stage's, from a copy taken some mini-batches earlier.
FTPipeHD restores them as they are and resumes every stage at the first
un-acknowledged mini-batch; nothing is in flight any more (the pipeline restarts
empty), so no stashed version is needed for a forward already made.

What a stage needs is one update count for all of its units and the versions the
next forwards read under vertical sync: :func:`restart_state_at` keeps each unit's
live weights and optimizer state bit for bit, drops the stashed versions, and
names the live weights every version of ``needed_versions(version, depth)``: the
first ``depth - 1`` forwards after the resume use the weights as restored (the
stage's first update makes the next version), which every stage agrees on, so
the versions of one mini-batch stay the same model version on every stage.

A unit no copy was left of (its stage died before its first copy landed) starts
again from its initial weights: :func:`initial_state` builds them from the model
spec as any stage builds its units (each unit's weights depend only on the seed
and its index, or come from the spec's weights file), exactly version 0.

Pure: tensors in, tensors out (the tensors are not copied); :func:`initial_state`
builds modules (run it off the event loop).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from zpipe._errors import ConfigError
from zpipe.models import ModelSpec, load_layer_sequence
from zpipe.models.weights import split_unit_key, unit_key
from zpipe.recovery.live_copies import state_digest
from zpipe.training.async_regroup import LIVE_VERSIONS_KEY, VERSION_KEY, needed_versions


def restart_state_at(
    state: Mapping[str, torch.Tensor], *, version: int, depth: int
) -> dict[str, torch.Tensor]:
    """``state`` (units' entries: a training state, or a copy with weight versions) with
    every unit at weight ``version``: its live weights and optimizer state, named
    every version the next ``depth - 1`` forwards read (see the module notes)."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ConfigError(f"a weight version is a whole number >= 0, got {version!r}")
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ConfigError(f"a run's depth is a whole number >= 1, got {depth!r}")
    out: dict[str, torch.Tensor] = {}
    units: set[int] = set()
    for key, tensor in state.items():
        unit = split_unit_key(key)
        if unit is None:
            raise ConfigError(f"{key!r} is not state of a unit")
        if VERSION_KEY in key or unit[1] == LIVE_VERSIONS_KEY:
            continue  # a stashed version: nothing is in flight after the resume
        out[key] = tensor
        units.add(unit[0])
    versions = torch.tensor(list(needed_versions(version, depth)), dtype=torch.int64)
    for unit_index in sorted(units):
        out[f"units.{unit_index}.{LIVE_VERSIONS_KEY}"] = versions.clone()
    return out


def initial_state(spec: ModelSpec, start: int, end: int) -> dict[str, torch.Tensor]:
    """Units ``[start, end)`` of ``spec`` at their initial weights (version 0, no
    optimizer state: none exists before a unit's first update), keyed as a stage's
    training state is."""
    units = load_layer_sequence(spec).build_units(start, end)
    out: dict[str, torch.Tensor] = {}
    for offset, unit in enumerate(units):
        for name, tensor in unit.state_dict().items():
            out[unit_key(start + offset, name)] = tensor.detach()
    return out


def unit_digests(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Each unit's digest of its live weights and optimizer state (stashed versions and
    their markers left out): what a survivor logs when it stops and again once it
    resumed, so the two can be compared bit for bit without moving the tensors."""
    by_unit: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        unit = split_unit_key(key)
        if unit is None or VERSION_KEY in key or unit[1] == LIVE_VERSIONS_KEY:
            continue
        by_unit.setdefault(unit[0], {})[key] = tensor
    return {str(u): state_digest(by_unit[u]) for u in sorted(by_unit)}


__all__ = ["initial_state", "restart_state_at", "unit_digests"]
