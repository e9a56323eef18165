"""What a stage may announce in bulk: from the state of the units the plan gives it. Pure.

A stage's open bulk transfers (:class:`~zpipe.transport.bulk.Inbox`) may announce
no more than its budget together. Before any plan the budget is one whole message
(and at most twice the memory the stage reports): a registered fake stage that
opened four transfers announced at 1 GiB each had two of them admitted and took the
coordinator from 245 to 837 MiB (issue 33, finding 5). Once a run is planned, what a
stage can legitimately send is bounded by the units it holds: their weights, a
replica of them with an optimizer's moments, and a copy in flight beside
(:data:`PLANNED_STATE_COPIES`), plus :data:`PLANNED_STATE_MARGIN_BYTES` for headers,
small models and rounding. A stage the plan gives no units gets the margin only.
A model whose units cannot be sized without building them (user code) keeps the
rule before a plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zpipe.models import ModelSpec
from zpipe.models.size import parameter_bytes

# Copies of a stage's parameters its open transfers may announce together: its
# weights (or a replica's) with an optimizer's two moments (Adam), one such state in
# flight beside (an asynchronous copy while a backup goes), and room for a units'
# state of about the same size that is not its own now (a neighbour's copy it
# holds, the larger range it held before a re-partition's commit). A stage the plan
# gives no units is bounded by the margin alone, so this factor does not widen what
# a registered stranger may announce (hostile half_bulk).
PLANNED_STATE_COPIES = 8
# Room beside them: message headers, batch-norm buffers counted as parameters
# anyway, a model of a few kB, lossy results.
PLANNED_STATE_MARGIN_BYTES = 64 << 20

# Per device: the parameter bytes of the units it holds; None where they cannot be
# sized (the rule before a plan). A device absent holds no units.
Planned = Mapping[str, int | None]


def planned_budget(state_bytes: int | None, fallback: int) -> int:
    """The budget of a stage holding ``state_bytes`` of parameters (None: unknown,
    ``fallback``); never above ``fallback``."""
    if state_bytes is None:
        return fallback
    return min(fallback, PLANNED_STATE_COPIES * state_bytes + PLANNED_STATE_MARGIN_BYTES)


def unit_ranges(run: Any) -> dict[str, list[tuple[int, int]]]:
    """The units ``[start, end)`` each device of ``run`` holds (a training plan's
    groups each hold their stage's)."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    training = getattr(run, "training_plan", None)
    if training is not None:
        for stage in training.stages:
            for device in stage.devices:
                ranges.setdefault(device, []).append((stage.start, stage.end))
    else:
        for stage in run.plan.stages:
            ranges.setdefault(stage.device, []).append((stage.start, stage.end))
    for device in getattr(run, "devices", ()):  # taking part, units unknown here
        ranges.setdefault(device, [])
    return ranges


def planned_state(run: Any, model: Mapping[str, Any] | None) -> dict[str, int | None] | None:
    """Per device of ``run`` (None: no run), the parameter bytes of the units it
    holds, from the model's spec ``model`` without building anything; None for a
    device whose units cannot be sized."""
    if run is None:
        return None
    ranges = unit_ranges(run)
    sequence = _sized(model)
    out: dict[str, int | None] = {}
    for device, held in ranges.items():
        sizes = [parameter_bytes(sequence, s, e) for s, e in held] if sequence else [None]
        out[device] = None if not held or None in sizes else sum(s or 0 for s in sizes)
    return out


def _sized(model: Mapping[str, Any] | None) -> object | None:
    """The layer sequence of spec ``model`` if it can count its parameters unbuilt."""
    if not isinstance(model, Mapping):
        return None
    # the registry builds layers with torch: a run has started (and imported it) by now
    from zpipe.models.registry import USER_CODE_FAMILIES, load_layer_sequence

    try:
        spec = ModelSpec.from_dict(dict(model))
        if spec.family in USER_CODE_FAMILIES:
            return None  # sized only by importing user code: never here
        return load_layer_sequence(spec)
    except Exception:  # a spec this cannot size keeps the rule before a plan
        return None
