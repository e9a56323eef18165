"""Eq. 5's period of a pipeline's cuts (FTPipeHD): its slowest stage or link.

Pure: numbers in, numbers out; what :func:`zpipe.training.repartition.decide_repartition`
compares cuts by and the controller remembers for cuts it has run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def period_at(
    bounds: Sequence[int],
    reference_unit_s: Sequence[float],
    capacities: Sequence[float],
    output_bytes: Sequence[float] | None,
    bandwidths_bps: Sequence[float] | None,
    fixed_s: Sequence[float] | None = None,
) -> float:
    """Eq. 5's period of the given cuts: the slowest stage (eq. 7, plus its own cost
    per batch when given) or link (2 x eq. 6)."""
    worst = 0.0
    for i, cap in enumerate(capacities):
        own = 0.0 if fixed_s is None else fixed_s[i]
        worst = max(worst, own + math.fsum(reference_unit_s[bounds[i] : bounds[i + 1]]) * cap)
    return max(worst, links_s(bounds, output_bytes, bandwidths_bps))


def links_s(
    bounds: Sequence[int],
    output_bytes: Sequence[float] | None,
    bandwidths_bps: Sequence[float] | None,
) -> float:
    """The slowest link of the given cuts: 2 x eq. 6, the activation that crosses it
    forward and its gradient back (0 without sizes or bandwidths)."""
    if output_bytes is None or bandwidths_bps is None:
        return 0.0
    worst = 0.0
    for i, bandwidth in enumerate(bandwidths_bps):
        size = float(output_bytes[bounds[i + 1] - 1])
        if size:
            worst = max(worst, 2.0 * size / bandwidth)
    return worst
