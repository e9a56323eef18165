"""What a stage's reply to a re-partitioning look says of its compute.

Pure: a stage reports cumulative counters (seconds of forward, backward and step,
mini-batches) and its newest forwards one by one (``recent``); the controller
(:class:`zpipe.training.repartition.RepartitionController`) reads them here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

# the counters a stage reports whose sum is its compute time (seconds, cumulative)
COMPUTE_COUNTERS = ("forward_s", "backward_s", "step_s")
SPAN_COUNTERS = ("forward_s",)  # what a stage's ``recent`` times per mini-batch


def stage_totals(counters: Mapping[str, Any]) -> tuple[float, float, int]:
    """A stage's cumulative compute seconds, the forward part of them (what its
    ``recent`` times one by one), and its mini-batches."""
    seconds = math.fsum(float(counters.get(k) or 0.0) for k in COMPUTE_COUNTERS)
    spans = math.fsum(float(counters.get(k) or 0.0) for k in SPAN_COUNTERS)
    return seconds, spans, int(counters.get("microbatches") or 0)


def recent_times(given: Any, since: int) -> list[float] | None:
    """A stage's ``recent`` (``[mb, seconds]`` pairs, oldest first) from mini-batch
    ``since`` on, as seconds; None when it sent none or malformed ones (an older
    stage: the window's mean then)."""
    if not isinstance(given, list):
        return None
    out: list[float] = []
    for pair in given:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            return None
        mb, seconds = pair
        if isinstance(mb, bool) or not isinstance(mb, int):
            return None
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            return None
        if mb >= since:
            out.append(float(seconds))
    return out
