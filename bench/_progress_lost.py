"""What a recovery loses, counted three ways, and how long a chain copy takes to reach
its holder (pure: ``bench/async_recovery.py``'s ``fast_vs_exact`` section).

What each recovery loses (FTPipeHD III-F; exact rollback is zpipe's own):

* ``fast``: the survivors keep their weights; the dead stage's units come back
  from their newest completed copy (chain, else global) of version ``v``; the run
  resumes at the first mini-batch not acknowledged, ``A``. The restored units
  miss the updates of mini-batches ``v .. A - 1`` for good (nothing trains them
  again); a survivor misses those it had not applied yet. Mini-batches forwarded
  past ``A`` are discarded and forwarded again (both recoveries).
* ``exact``: every unit goes back to the last replica ``r`` and mini-batches
  ``r .. A - 1`` are trained again: no update is missing from the final model,
  the work of ``A - r`` mini-batches is done twice.

The issue's key counts, for both, the most mini-batches of updates any unit
missed at the restart (fast: the report's ``progress_lost``; exact: ``A - r``).
Two more counts explain it:

* :func:`lost_if_instant`: what fast would lose if every copy were at its holder
  the moment it was taken (the floor the periods set);
* :func:`model_lost`: the mean of each unit's count weighted by its parameters
  (how much of the model's progress was lost, not its worst unit's).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any

import torch

from zpipe.models.weights import split_unit_key


def lost_if_instant(resumed_at: int, chain_every: int) -> int:
    """Mini-batches a fast recovery resuming at ``resumed_at`` would lose for the dead
    stage's units if each chain copy were at its holder at once: a stage's update
    count when the ``A``-th loss comes back is ``A - 1`` (its update of mini-batch
    ``A - 2`` runs beside the last stage's forward of ``A - 1``), so the newest copy
    is of the last multiple of ``chain_every`` at or below ``A - 1``."""
    if resumed_at < 1 or chain_every < 1:
        return max(resumed_at, 0)
    return resumed_at - chain_every * ((resumed_at - 1) // chain_every)


def unit_params(state: Mapping[str, torch.Tensor]) -> dict[int, int]:
    """Parameters (elements) of each unit of a ``units.<i>.<name>`` state dict."""
    counts: dict[int, int] = {}
    for key, tensor in state.items():
        unit = split_unit_key(key)
        if unit is not None:
            counts[unit[0]] = counts.get(unit[0], 0) + tensor.numel()
    return counts


def model_lost(lost_per_unit: Mapping[int, int], params: Mapping[int, int]) -> float:
    """Each unit's mini-batches lost weighted by its parameters (a unit absent from
    ``lost_per_unit`` lost none); 0.0 with no parameters."""
    total = sum(params.values())
    if total <= 0:
        return 0.0
    return sum(n * lost_per_unit.get(u, 0) for u, n in params.items()) / total


def _mb(name: str) -> int | None:
    found = re.search(r"mb(\d+)$", name)
    return int(found.group(1)) if found else None


def copy_transfer_mb(
    events: Sequence[Mapping[str, Any]], last_stage: str
) -> dict[str, list[float]]:
    """From a run's trace events (:func:`zpipe.client.trace.chrome_trace`): for each
    stage, each chain copy's time from the start of its snapshot to the end of its
    first ``copy`` span (a chain copy is sent before a global one of the same
    mini-batch; the span ends once the holder acknowledged the last chunk and the
    coordinator was told), in mini-batches: over the median gap between the last
    stage's successive forwards. Empty without two such forwards."""
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    ends = sorted(
        e["ts"] + e["dur"]
        for e in spans
        if names.get(e["pid"]) == last_stage and str(e["name"]).startswith("forward")
    )
    gaps = [b - a for a, b in pairwise(ends) if b > a]
    if not gaps:
        return {}
    period = statistics.median(gaps)
    snapshots: dict[tuple[str, int], float] = {}
    copies: dict[tuple[str, int], float] = {}
    for e in sorted(spans, key=lambda e: e["ts"]):
        stage, mb = names.get(e["pid"], "?"), _mb(str(e["name"]))
        if mb is None:
            continue
        if str(e["name"]).startswith("snapshot"):
            snapshots.setdefault((stage, mb), e["ts"])
        elif str(e["name"]).startswith("copy"):
            copies.setdefault((stage, mb), e["ts"] + e["dur"])
    out: dict[str, list[float]] = {}
    for key, start in sorted(snapshots.items()):
        if key in copies:
            out.setdefault(key[0], []).append(round((copies[key] - start) / period, 2))
    return out
