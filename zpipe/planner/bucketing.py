"""Measured speeds and bandwidths snapped to buckets, so PipeEdge's category DP stays small.

Why. The category DP (:mod:`zpipe.planner.pipeedge`) groups devices that are
interchangeable, and its state space is ``prod(n_c + 1)`` over the categories.
Measured numbers are never exactly equal: every link a coordinator measures
and every profile a stage takes differs in the last digits, so every device is
a category of its own and the state space doubles with each device.

What. :func:`bucket_cluster` returns a copy of the cluster in which

- each device's ``speed``, each access-link, link and client bandwidth is
  replaced by the low end of its bucket, and each device's own profile by its
  bucket's unit-by-unit slowest times. A bucket holds values within a factor
  ``1 + tolerance`` of its low end; buckets are laid from the smallest value
  up, each starting at the smallest value not yet covered (the fewest buckets
  of that geometric width that cover the values, and no two measurements closer
  than the tolerance are split by a fixed grid line between them);
- latencies are dropped (zero): a plan's period does not depend on them
  (:meth:`ClusterSpec.comm_time_s`), so they only split categories;
- memory is kept exactly: it is a hard limit, and a plan feasible on the
  bucketed cluster must be feasible on the real one.

The bound it certifies. Snapping always rounds a time up, never down: every
compute and transfer time of the bucketed cluster lies in ``[x, r * x]`` of the
real one's ``x``, with ``r = max_snap <= 1 + tolerance`` the largest factor any
single value moved. So for every plan ``P``, ``exact(P) <= bucketed(P) <= r *
exact(P)``, and for the plan ``B`` optimal on the bucketed cluster and the
exact optimum ``OPT``::

    bucketed(B) <= bucketed(OPT's plan) <= r * OPT   so   OPT >= bucketed(B) / r

A second lower bound, usually much tighter: the same buckets snapped the other
way (each to its fastest value) make every time shrink, so that cluster's
optimum is at most ``OPT`` too (one more DP of the same size).
:func:`certify` turns that into numbers: ``lower_bound_s`` is the larger of the
two bounds, and ``certified_ratio = exact(B) / lower_bound_s <= r`` (``exact(B)`` re-costs
the chosen plan on the real values). A certified ratio of 1.02 says the plan's
real bottleneck is within 2 % of the best possible, whatever the exact DP
would have found.

Option values (:func:`parse_bucketing`): ``"exact"`` (no bucketing), ``"auto"``
(exact when the cluster's categories are few enough, else bucketed at
:data:`DEFAULT_TOLERANCE`; see :mod:`zpipe.planner.pipeedge`) or a tolerance
(a number in ``(0, MAX_TOLERANCE]``, or its string form).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from zpipe._errors import ConfigError
from zpipe.planner.cluster import ClusterDevice, ClusterLink, ClusterSpec
from zpipe.planner.profile import ModelProfile

# 5 %: measured link rates on these machines scatter by a few percent (the probe read
# 91-99 % of a tbf cap), measured compute times by about as much on a quiet host.
DEFAULT_TOLERANCE = 0.05
# A bucket wider than a factor 2 no longer says anything useful about a plan.
MAX_TOLERANCE = 1.0
BUCKETING_MODES = ("auto", "exact")

Bucketing = str | float  # "auto", "exact" or a tolerance


def parse_bucketing(value: object) -> Bucketing:
    """``"auto"``, ``"exact"`` or a tolerance in ``(0, MAX_TOLERANCE]``; anything else is a
    :class:`ConfigError` that says what is accepted."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in BUCKETING_MODES:
            return text
        try:
            number = float(text.rstrip("%")) / (100.0 if text.endswith("%") else 1.0)
        except ValueError:
            number = math.nan
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        number = math.nan
    if not (math.isfinite(number) and 0 < number <= MAX_TOLERANCE):
        raise ConfigError(
            f"bucketing must be 'auto', 'exact' or a tolerance in (0, {MAX_TOLERANCE:g}] "
            f"(0.05 or 5% for 5 %), got {value!r}"
        )
    return number


def bucket_lows(values: Iterable[float], tolerance: float) -> dict[float, float]:
    """Each value's bucket low end: buckets ``[low, low * (1 + tolerance)]`` laid from the
    smallest value up, each starting at the smallest value not yet covered."""
    return {value: low for value, (low, _) in bucket_ends(values, tolerance).items()}


def bucket_ends(values: Iterable[float], tolerance: float) -> dict[float, tuple[float, float]]:
    """Each value's bucket as (smallest, largest value in it); see :func:`bucket_lows`."""
    ordered = sorted(set(values))
    ends: dict[float, tuple[float, float]] = {}
    start = 0
    for k, value in enumerate(ordered):
        if not value <= ordered[start] * (1 + tolerance):
            for member in ordered[start:k]:
                ends[member] = (ordered[start], ordered[k - 1])
            start = k
    for member in ordered[start:]:
        ends[member] = (ordered[start], ordered[-1])
    return ends


@dataclass(frozen=True)
class BucketedCluster:
    """The cluster to plan on, how far a value moved at most, and at what tolerance."""

    cluster: ClusterSpec
    tolerance: float
    max_snap: float  # >= 1: the largest factor any time moved by


def bucket_cluster(
    cluster: ClusterSpec, tolerance: float, *, batch_size: int, optimistic: bool = False
) -> BucketedCluster:
    """``cluster`` with speeds, bandwidths and own profiles snapped (see the module notes).

    ``optimistic`` snaps the other way, to each bucket's fastest value: every time only
    shrinks, so that cluster's optimum is a lower bound of the exact one (the same
    buckets, so the same categories). Linear in the devices and links (plus a sort):
    devices that share a profile object are snapped once.
    """
    if not (math.isfinite(tolerance) and 0 < tolerance <= MAX_TOLERANCE):
        raise ConfigError(f"tolerance must be in (0, {MAX_TOLERANCE:g}], got {tolerance!r}")
    side = 1 if optimistic else 0
    speeds = {
        value: ends[side]
        for value, ends in bucket_ends(
            (d.speed for d in cluster.devices if d.profile is None), tolerance
        ).items()
    }
    bandwidths = {
        value: ends[side] for value, ends in bucket_ends(_bandwidths(cluster), tolerance).items()
    }
    profiles, profile_snap = _bucket_profiles(
        [d.profile for d in cluster.devices if d.profile is not None],
        tolerance,
        batch_size,
        optimistic=optimistic,
    )
    moved = [value / snapped for value, snapped in (*speeds.items(), *bandwidths.items())]
    snap = max([1.0, profile_snap] + [max(m, 1 / m) for m in moved])

    def bw(value: float | None) -> float | None:
        return None if value is None else bandwidths[value]

    devices = tuple(
        ClusterDevice(
            name=d.name,
            memory_bytes=d.memory_bytes,
            speed=d.speed if d.profile is not None else speeds[d.speed],
            bandwidth_mbps=bw(d.bandwidth_mbps),
            latency_ms=0.0,
            profile=None if d.profile is None else profiles[id(d.profile)],
        )
        for d in cluster.devices
    )
    # A link that only set a latency is gone: the default rule gives the same bandwidth.
    links = {
        pair: ClusterLink(bandwidth_mbps=bw(link.bandwidth_mbps))
        for pair, link in cluster.links.items()
        if link.bandwidth_mbps is not None
    }
    client = ClusterLink(bandwidth_mbps=bw(cluster.client.bandwidth_mbps))
    return BucketedCluster(ClusterSpec(devices, links, client), tolerance, snap)


def _bandwidths(cluster: ClusterSpec) -> list[float]:
    """Every bandwidth the cluster states. One set for all of them: snapping is monotone,
    so the default rule's ``min`` of two access links snaps to the ``min`` of their snaps."""
    values = [d.bandwidth_mbps for d in cluster.devices]
    values += [link.bandwidth_mbps for link in cluster.links.values()]
    values.append(cluster.client.bandwidth_mbps)
    return [v for v in values if v is not None]


def _bucket_profiles(
    owns: Sequence[ModelProfile], tolerance: float, batch_size: int, *, optimistic: bool
) -> tuple[dict[int, ModelProfile], float]:
    """Own profiles grouped when every unit's time is within ``1 + tolerance`` across the
    group; each member is planned with the group's slowest time per unit (``optimistic``:
    fastest). Returns the profile to use by ``id`` of the original, and the largest
    factor a time moved by."""
    distinct: dict[int, ModelProfile] = {}
    for own in owns:
        distinct.setdefault(id(own), own)
    if not distinct:
        return {}, 1.0
    times = {key: own.times(batch_size) for key, own in distinct.items()}
    # Sorted by total time, so that a group gathers neighbours, as the 1-D buckets do.
    order = sorted(distinct, key=lambda key: math.fsum(times[key]))
    groups: list[tuple[list[float], list[float], list[int]]] = []  # (low, high, members)
    for key in order:
        row = times[key]
        for low, high, members in groups:
            lo = [min(a, b) for a, b in zip(low, row, strict=True)]
            hi = [max(a, b) for a, b in zip(high, row, strict=True)]
            if all(h <= l * (1 + tolerance) for l, h in zip(lo, hi, strict=True)):  # noqa: E741
                low[:], high[:] = lo, hi
                members.append(key)
                break
        else:
            groups.append((list(row), list(row), [key]))
    chosen: dict[int, ModelProfile] = {}
    snap = 1.0
    for low, high, members in groups:
        first = distinct[members[0]]
        end = low if optimistic else high
        rep = first if len(members) == 1 else _with_times(first, end, batch_size)
        for key in members:
            chosen[key] = rep
            snap = max(snap, _largest_move(times[key], end))
    return chosen, snap


def _with_times(profile: ModelProfile, times: Sequence[float], batch_size: int) -> ModelProfile:
    index = profile.batch_sizes.index(batch_size)
    units = tuple(
        dataclasses.replace(
            unit, time_s=tuple(t if k != index else new for k, t in enumerate(unit.time_s))
        )
        for unit, new in zip(profile.units, times, strict=True)
    )
    return dataclasses.replace(profile, units=units)


def _largest_move(before: Sequence[float], after: Sequence[float]) -> float:
    return max(
        (max(b / a, a / b) for a, b in zip(before, after, strict=True) if a > 0 and b > 0),
        default=1.0,
    )


@dataclass(frozen=True)
class Certificate:
    """How far a bucketed plan can be from the exact optimum, proven (module notes)."""

    tolerance: float
    max_snap: float
    bucketed_bottleneck_s: float  # the chosen plan on the bucketed cluster (the DP's optimum)
    exact_bottleneck_s: float  # the same plan re-costed on the real cluster
    lower_bound_s: float  # no plan on the real cluster does better

    @property
    def certified_ratio(self) -> float:
        """``exact_bottleneck_s / lower_bound_s``: at most ``max_snap``."""
        if self.lower_bound_s <= 0:
            return 1.0 if self.exact_bottleneck_s <= 0 else math.inf
        return self.exact_bottleneck_s / self.lower_bound_s

    def as_prediction(self) -> Mapping[str, float]:
        """The keys a plan's ``predicted`` carries."""
        return {
            "bucketing_tolerance": self.tolerance,
            "bucketing_max_snap": self.max_snap,
            "bucketed_bottleneck_s": self.bucketed_bottleneck_s,
            "bucketing_lower_bound_s": self.lower_bound_s,
            "bucketing_certified_ratio": self.certified_ratio,
        }


def certify(
    bucketed: BucketedCluster,
    bucketed_optimum_s: float,
    exact_s: float,
    optimistic_optimum_s: float = 0.0,
) -> Certificate:
    """The certificate of a plan that is optimal on ``bucketed`` (``bucketed_optimum_s``) and
    whose bottleneck on the real cluster is ``exact_s``; ``optimistic_optimum_s``, the
    optimum on the optimistic buckets, is a second lower bound (often the tighter)."""
    return Certificate(
        tolerance=bucketed.tolerance,
        max_snap=bucketed.max_snap,
        bucketed_bottleneck_s=bucketed_optimum_s,
        exact_bottleneck_s=exact_s,
        lower_bound_s=max(bucketed_optimum_s / bucketed.max_snap, optimistic_optimum_s),
    )
