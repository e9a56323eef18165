"""Eq. 5's inputs for a fast recovery's re-cut of the survivors (FTPipeHD III-F), from
what the run measured: pure, plain data in, plain data out.

FTPipeHD re-partitions the survivors with eq. 5 over the capacities its execution
profiling measured and the bandwidths between the workers that become
neighbours. A run that re-partitions live has both already: its controller
(:class:`zpipe.training.repartition.RepartitionController`) keeps each device's
smoothed capacity ``C_i`` and own cost per batch ``F_i`` from its looks, each
boundary's size ``D_j`` and the links between the stages it cut; the coordinator
has measured (or been told) the links between any two devices, which covers the
pairs a death makes neighbours. :func:`eq5_inputs` picks, for the survivors in
their order, what :func:`zpipe.recovery.fast_recovery.plan_fast_recovery` takes,
and says what it used and why (the recovery's report):

- capacities only when every survivor has one measured (a look that measured
  them all); otherwise every ``C_i`` is 1 (eq. 7 on the reference unit times:
  the rule before any look), and ``F_i`` is left out with them;
- links only when the boundary sizes are known and every pair of consecutive
  survivors has a bandwidth; otherwise links are free (eq. 5 without ``2 T_c``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from zpipe._errors import ConfigError

# before any look measured them, every survivor counts as 1 (eq. 7)
UNMEASURED = "none measured: 1 each (eq. 7)"


@dataclass(frozen=True)
class PipelineMeasurements:
    """What a run measured of its devices and links. ``reference_unit_s``: each unit's
    reference time (what capacities scale); ``capacities`` and ``fixed_s``: ``C_i``
    and ``F_i`` by device (empty: none measured); ``capacity_source``: where they come
    from, for the report; ``output_bytes``: ``D_j`` per unit (None: links are not
    costed); ``links``: bytes per second between two devices (a pair given in either
    direction serves both), ``link_sources``: each pair's origin, for the report."""

    reference_unit_s: tuple[float, ...]
    capacities: Mapping[str, float] = field(default_factory=dict)
    fixed_s: Mapping[str, float] = field(default_factory=dict)
    capacity_source: str = "measured"
    output_bytes: tuple[float, ...] | None = None
    links: Mapping[tuple[str, str], float] = field(default_factory=dict)
    link_sources: Mapping[tuple[str, str], str] = field(default_factory=dict)


@dataclass(frozen=True)
class Eq5Inputs:
    """The arguments of :func:`~zpipe.recovery.fast_recovery.plan_fast_recovery` that
    feed eq. 5, and ``report``: which capacities and links they are, from where."""

    reference_unit_s: list[float]
    capacities: dict[str, float] | None
    fixed_s: dict[str, float] | None
    output_bytes: list[float] | None
    bandwidths_bps: dict[tuple[str, str], float] | None
    report: dict[str, Any]

    def kwargs(self) -> dict[str, Any]:
        return {
            "reference_unit_s": self.reference_unit_s,
            "capacities": self.capacities,
            "fixed_s": self.fixed_s,
            "output_bytes": self.output_bytes,
            "bandwidths_bps": self.bandwidths_bps,
        }


def eq5_inputs(survivors: Sequence[str], measured: PipelineMeasurements) -> Eq5Inputs:
    """Eq. 5's inputs for ``survivors`` (in the order they will run) from ``measured``
    (see the module notes); ConfigError on a malformed measurement."""
    order = list(survivors)
    if not order:
        raise ConfigError("eq. 5 needs at least one survivor")
    units = [float(t) for t in measured.reference_unit_s]
    if not units or not all(math.isfinite(t) and t > 0 for t in units):
        raise ConfigError(f"reference unit times must be finite and > 0, got {units}")
    report: dict[str, Any] = {}

    caps: dict[str, float] | None = None
    fixed: dict[str, float] | None = None
    missing = [d for d in order if not _positive(measured.capacities.get(d))]
    if missing:
        report["capacities"] = None
        report["capacities_from"] = UNMEASURED
        if len(missing) < len(order):
            report["capacities_unmeasured"] = missing
    else:
        caps = {d: float(measured.capacities[d]) for d in order}
        fixed = {d: max(0.0, float(measured.fixed_s.get(d, 0.0))) for d in order}
        report["capacities"] = {d: round(c, 4) for d, c in caps.items()}
        report["capacities_from"] = measured.capacity_source
        if any(fixed.values()):
            report["fixed_s"] = {d: round(f, 6) for d, f in fixed.items()}
        else:
            fixed = None

    sizes: list[float] | None = None
    links: dict[tuple[str, str], float] | None = None
    if measured.output_bytes is None:
        report["links_mbit_s"] = None
        report["links_from"] = "no boundary sizes: links not costed"
    else:
        sizes = [float(b) for b in measured.output_bytes]
        if len(sizes) != len(units):
            raise ConfigError(f"{len(sizes)} boundary sizes for {len(units)} units")
        found = {pair: _link(measured, *pair) for pair in pairwise(order)}
        unknown = [f"{a}>{b}" for (a, b), link in found.items() if link is None]
        if unknown:
            sizes = None
            report["links_mbit_s"] = None
            report["links_from"] = f"no bandwidth for {unknown}: links not costed"
        else:
            links = {pair: link[0] for pair, link in found.items() if link is not None}
            report["links_mbit_s"] = {
                f"{a}>{b}": None if math.isinf(bps) else round(bps * 8 / 1e6, 3)
                for (a, b), bps in links.items()
            }
            report["links_from"] = {
                f"{a}>{b}": link[1] for (a, b), link in found.items() if link is not None
            }
    return Eq5Inputs(units, caps, fixed, sizes, links, report)


def _positive(value: object) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def _link(measured: PipelineMeasurements, a: str, b: str) -> tuple[float, str] | None:
    """The bandwidth between ``a`` and ``b`` (either direction's entry) and its origin."""
    for key in ((a, b), (b, a)):
        bps = measured.links.get(key)
        if bps is not None and bps > 0:
            return float(bps), measured.link_sources.get(key, "measured")
    return None


__all__ = ["UNMEASURED", "Eq5Inputs", "PipelineMeasurements", "eq5_inputs"]
