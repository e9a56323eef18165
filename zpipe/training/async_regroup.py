"""Moving an asynchronous pipeline's units between stages at a flush: pure, no I/O.

A live re-partition (:mod:`zpipe.training.repartition`) lets every batch before
its boundary finish everywhere (the feed ends there for a moment), so no stage
holds a stashed forward; then each unit's whole state moves to the stage the new
partition gives it: live weights and buffers, the optimizer's state, and the
weight versions the next forwards (vertical sync: ``b - n + 1`` for batch ``b``)
and aggregations still read. Versions count the run's updates, which every stage
has made equally many of, so a unit continues exactly where it stopped.

- :func:`regroup_stages`: in one process (the reference), the units' modules move;
- :func:`unit_state_tensors` / :func:`unit_state_from_tensors`: the same state as
  named tensors, for a stage-to-stage transfer (nothing pickled); a version equal
  to the live weights (the newest, after a flush) is named, not sent again.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from zpipe._errors import PipelineError, ProtocolError
from zpipe.models.trust import FactoryPolicy
from zpipe.models.weights import OPTIMIZER_KEY, unit_key
from zpipe.training.async_stage import AsyncStageCompute, UnitState


def check_bounds(bounds: Sequence[int], num_units: int, num_stages: int) -> tuple[int, ...]:
    """``bounds`` as cut points of ``num_units`` units into ``num_stages`` non-empty stages."""
    out = tuple(int(b) for b in bounds)
    if len(out) != num_stages + 1 or out[0] != 0 or out[-1] != num_units:
        raise PipelineError(
            f"bounds {list(out)} do not cut {num_units} units into {num_stages} stages"
        )
    if any(a >= b for a, b in itertools.pairwise(out)):
        raise PipelineError(f"bounds {list(out)} leave a stage without units")
    return out


def regroup_stages(
    computes: Sequence[AsyncStageCompute],
    bounds: Sequence[int],
    *,
    loss: str,
    optimizer: dict[str, Any],
    lr_schedule: Mapping[str, Any] | None = None,
    policy: FactoryPolicy | None = None,
) -> list[AsyncStageCompute]:
    """The same pipeline's units cut at ``bounds`` instead, every unit's state kept;
    ``bounds`` may name fewer stages (a recovery onto the survivors)."""
    updates = {c.updates for c in computes}
    if len(updates) != 1:
        raise PipelineError(f"the stages are at different updates {sorted(updates)}: no flush")
    states = [state for c in computes for state in c.export_units()]
    n = len(bounds) - 1
    cuts = check_bounds(bounds, len(states), n)
    return [
        AsyncStageCompute.adopt(
            states[cuts[i] : cuts[i + 1]],
            updates=computes[0].updates,
            first=i == 0,
            last=i == n - 1,
            loss=loss,
            optimizer=optimizer,
            lr_schedule=lr_schedule,
            policy=policy,
        )
        for i in range(n)
    ]


def needed_versions(updates: int, num_stages: int) -> range:
    """The versions a unit must carry at a flush after ``updates`` updates: those the
    next ``n - 1`` forwards use under vertical sync and the newest ``n`` an
    aggregation may average (both lie in ``updates - n + 1 .. updates``)."""
    return range(max(0, updates - num_stages + 1), updates + 1)


VERSION_KEY = "#v"
# ``units.<unit>.#live_versions``: an int64 list of the versions that are the live
# weights bit for bit (after a flush, the newest always is). They do not cross the
# wire a second time: the receiver copies them from the live weights.
LIVE_VERSIONS_KEY = "#live_versions"
# more versions than any run keeps: a peer's list longer than this is refused
MAX_LIVE_VERSIONS = 1024


def is_versioned_state(keys: Iterable[str]) -> bool:
    """Whether a training state carries weight versions (an asynchronous run's):
    sent ones (``#v<t>``) or ones rebuilt from the live weights."""
    return any(VERSION_KEY in key or key.endswith(f".{LIVE_VERSIONS_KEY}") for key in keys)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # bit for bit, not ==: -0.0 == 0.0, and a rebuilt version must be exact
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    flat_a, flat_b = a.detach().reshape(-1).contiguous(), b.detach().reshape(-1).contiguous()
    return torch.equal(flat_a.view(torch.uint8), flat_b.view(torch.uint8))


def unit_state_tensors(
    unit: int, state: UnitState, versions: Sequence[int]
) -> dict[str, torch.Tensor]:
    """Unit ``unit``'s state under the full model's keys, as a training state names
    it (``units.<unit>.<name>``, ``...<param>#opt.<key>`` for the optimizer), and its
    weight versions as ``units.<unit>.<param>#v<t>``: what a peer fetches. A version
    equal to the live weights is only named (:data:`LIVE_VERSIONS_KEY`), not sent."""
    out = {unit_key(unit, k): t.detach() for k, t in state.module.state_dict().items()}
    params = {n: p for n, p in state.module.named_parameters() if p.requires_grad}
    live_versions = []
    for v in versions:
        kept = state.versions.get(v)
        if kept is None:
            raise PipelineError(f"weight version {v} is no longer kept: {sorted(state.versions)}")
        if kept and kept.keys() == params.keys():
            if all(_same_bits(kept[n], params[n]) for n in params):
                live_versions.append(v)
                continue
        out.update({f"{unit_key(unit, name)}{VERSION_KEY}{v}": t for name, t in kept.items()})
    if live_versions:
        out[unit_key(unit, LIVE_VERSIONS_KEY)] = torch.tensor(live_versions, dtype=torch.int64)
    for name, entries in state.optimizer.items():
        for key, value in entries.items():
            if not isinstance(value, torch.Tensor):
                raise PipelineError(f"optimizer state {name}.{key} is not a tensor: {value!r}")
            out[f"{unit_key(unit, name)}{OPTIMIZER_KEY}{key}"] = value
    return out


def _live_version_list(key: str, tensor: torch.Tensor) -> list[int]:
    if tensor.dtype != torch.int64 or tensor.dim() != 1 or len(tensor) > MAX_LIVE_VERSIONS:
        raise ProtocolError(
            f"{key!r} must list at most {MAX_LIVE_VERSIONS} versions as int64, "
            f"got {tensor.dtype} {tuple(tensor.shape)}"
        )
    out = [int(v) for v in tensor.tolist()]
    if any(v < 0 for v in out) or len(set(out)) != len(out):
        raise ProtocolError(f"{key!r} lists versions {out}: negative or repeated")
    return out


def unit_state_from_tensors(
    unit: int, module: torch.nn.Module, tensors: Mapping[str, torch.Tensor]
) -> UnitState:
    """Unit ``unit``'s :class:`UnitState` from :func:`unit_state_tensors`' entries
    (others are ignored), on ``module`` (built fresh: its weights are replaced).
    ProtocolError on an entry that does not fit the unit."""
    prefix = unit_key(unit, "")
    live: dict[str, torch.Tensor] = {}
    versions: dict[int, dict[str, torch.Tensor]] = {}
    optimizer: dict[str, dict[str, torch.Tensor]] = {}
    shapes = {n: p for n, p in module.named_parameters() if p.requires_grad}
    params = set(shapes)
    live_versions: list[int] = []
    for key, tensor in tensors.items():
        if not key.startswith(prefix):
            continue
        rest = key[len(prefix) :]
        if rest == LIVE_VERSIONS_KEY:
            live_versions = _live_version_list(key, tensor)
            continue
        name, opt, entry = rest.partition(OPTIMIZER_KEY)
        if opt:
            if name not in params or not entry:
                raise ProtocolError(f"optimizer state {key!r} names no parameter of the unit")
            if tensor.shape not in (shapes[name].shape, torch.Size()):
                # per-parameter state (moments, momentum) or a scalar (Adam's step)
                raise ProtocolError(f"optimizer state {key!r} has shape {tuple(tensor.shape)}")
            optimizer.setdefault(name, {})[entry] = tensor.clone()
            continue
        name, tag, version = rest.partition(VERSION_KEY)
        if tag:
            if name not in params or not version.isdigit():
                raise ProtocolError(f"version tensor {key!r} names no parameter of the unit")
            param = shapes[name]
            if tensor.shape != param.shape or tensor.dtype != param.dtype:
                raise ProtocolError(
                    f"version tensor {key!r} is {tensor.dtype} {tuple(tensor.shape)}, "
                    f"the parameter {param.dtype} {tuple(param.shape)}"
                )
            versions.setdefault(int(version), {})[name] = tensor.clone()
            continue
        live[name] = tensor
    for v, kept in versions.items():
        if set(kept) != params:
            raise ProtocolError(f"version {v} lacks parameters {sorted(params - set(kept))}")
    try:
        module.load_state_dict(live, strict=True)
    except (RuntimeError, KeyError) as exc:
        raise ProtocolError(f"the unit's weights do not fit it: {exc}") from None
    for v in live_versions:
        if v in versions:
            raise ProtocolError(f"unit {unit}'s version {v} was sent and named live both")
        # loaded above: the module's parameters now hold the live weights
        versions[v] = {n: p.detach().clone() for n, p in module.named_parameters() if n in params}
    return UnitState(module, optimizer, versions)
