"""FTPipeHD's dynamic partition (section III-D, eqs. 1-7): cuts from live capacities.

Pure: plain numbers in, cut points out. The devices keep their order (worker
``i`` is stage ``i``); what moves is where each stage's units start and end.

Capacities (eqs. 1-3, :func:`zpipe.planner.capacity.estimate_capacities`):
worker ``i``'s time per batch over the reference device's (the central node,
``C_0 = 1``) time for the same units, ``C_i = T_e^i / sum_j T_{e,j}^0``; its time
for unit ``j`` is then ``T_{e,j}^i = T_{e,j}^0 * C_i``.

The dynamic programme (PipeDream's, with each worker's own capacity): ``A(j, n)``
is the shortest period of a pipeline of the first ``n`` workers over units
``0..j``::

    A(j, 1) = T^0(0, j)                                              (4)
    A(j, n) = min_{l} max( A(l, n - 1),                              (5)
                           2 * T_c^{n-2}(l),         activation + its gradient
                           T^{n-1}(l + 1, j) )
    T_c^i(j) = D_j / B_{i,i+1}                                       (6)
    T^i(l + 1, j) = sum_{m=l+1}^{j} T_{e,m}^i                        (7)

Units are 0-indexed here and every stage gets at least one. Without measurements
(every ``C_i = 1``) eq. 7 runs on the reference times alone.

A stage's own cost per mini-batch (``fixed_s``, :mod:`zpipe.training.stage_cost`)
extends eq. 7 to ``T^i(l + 1, j) = F_i + sum_{m=l+1}^{j} T_{e,m}^i``: whatever
units a stage holds, it pays ``F_i`` once per batch. ``F_i = 0`` is eq. 7.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

from zpipe._errors import ConfigError
from zpipe.planner.capacity import estimate_capacities


@dataclass(frozen=True)
class FTPipeHDPartition:
    """Each stage's units ``[bounds[i], bounds[i + 1])`` and the predicted period;
    stage ``i`` runs on worker ``workers[i]`` (every worker, in order, unless the
    partition left some out)."""

    bounds: tuple[int, ...]
    period_s: float  # A(J - 1, n): the slowest of compute and link, per batch
    stage_s: tuple[float, ...]  # eq. 7 for each stage's units on its worker
    link_s: tuple[float, ...]  # 2 * eq. 6 at each cut
    workers: tuple[int, ...] = ()  # the workers that take part, in stage order

    def __post_init__(self) -> None:
        if not self.workers:  # every worker, one stage each
            object.__setattr__(self, "workers", tuple(range(len(self.bounds) - 1)))
        if len(self.workers) != len(self.bounds) - 1:
            raise ConfigError(f"{len(self.workers)} workers for {len(self.bounds) - 1} stages")

    def left_out(self, num_workers: int) -> tuple[int, ...]:
        """The workers of ``num_workers`` this partition gives no units."""
        return tuple(w for w in range(num_workers) if w not in self.workers)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self.bounds, self.bounds[1:], strict=False))


def _check_positive(name: str, values: Sequence[float], *, allow_zero: bool) -> list[float]:
    out = [float(v) for v in values]
    for i, v in enumerate(out):
        if not math.isfinite(v) and not (v == math.inf and name == "bandwidths"):
            raise ConfigError(f"{name}[{i}] must be a finite number, got {v!r}")
        if v < 0 or (v == 0 and not allow_zero):
            raise ConfigError(f"{name}[{i}] must be {'>= 0' if allow_zero else '> 0'}, got {v}")
    return out


def ftpipehd_partition(
    reference_unit_s: Sequence[float],
    *,
    capacities: Sequence[float] | None = None,
    num_stages: int | None = None,
    output_bytes: Sequence[float] | None = None,
    bandwidths_bps: Sequence[float] | None = None,
    fixed_s: Sequence[float] | None = None,
    leave_out: bool = False,
    leave_out_gain: float = 0.0,
    pair_bandwidths_bps: Mapping[tuple[int, int], float] | None = None,
    keep_ends: bool = False,
) -> FTPipeHDPartition:
    """The cut points that minimize eq. 5's period.

    ``reference_unit_s``: each unit's time per batch on the reference device
    (``T_{e,j}^0``); ``capacities``: ``C_i`` per worker in stage order (default: all
    1, eq. 7 alone; their count is the number of stages, else ``num_stages``);
    ``output_bytes``: ``D_j``, the bytes unit ``j`` sends on (default: free links);
    ``bandwidths_bps``: ``B_{i,i+1}`` in bytes per second, one per link between
    consecutive workers (default: infinite); ``fixed_s``: ``F_i``, each worker's own
    seconds per batch whatever its units (default: none, eq. 7); ``leave_out``: the
    workers that take part are chosen too (see the module notes), a partition with
    fewer taken only when its period is shorter than everyone's by more than
    ``leave_out_gain``; ``pair_bandwidths_bps``: ``{(i, k): B}`` for non-consecutive
    workers ``i < k`` whose link was measured (default: the slowest hop between);
    ``keep_ends``: the first and last workers always take part (a pipeline whose
    feed and sink are wired to them).
    """
    units = _check_positive("reference_unit_s", reference_unit_s, allow_zero=True)
    if capacities is None:
        if num_stages is None:
            raise ConfigError("give the workers' capacities or num_stages")
        caps = [1.0] * num_stages
    else:
        caps = _check_positive("capacities", capacities, allow_zero=False)
        if num_stages is not None and num_stages != len(caps):
            raise ConfigError(f"{len(caps)} capacities for {num_stages} stages")
    n, total = len(caps), len(units)
    if n < 1:
        raise ConfigError("a pipeline needs at least one worker")
    if total < n:
        raise ConfigError(f"{total} units cannot give each of {n} stages one")
    sizes = (
        [0.0] * total
        if output_bytes is None
        else _check_positive("output_bytes", output_bytes, allow_zero=True)
    )
    if len(sizes) != total:
        raise ConfigError(f"output_bytes needs one entry per unit ({total}), got {len(sizes)}")
    links = (
        [math.inf] * (n - 1)
        if bandwidths_bps is None
        else _check_positive("bandwidths", bandwidths_bps, allow_zero=False)
    )
    if len(links) != n - 1:
        raise ConfigError(f"bandwidths_bps needs one entry per link ({n - 1}), got {len(links)}")

    fixed = [0.0] * n if fixed_s is None else _check_positive("fixed_s", fixed_s, allow_zero=True)
    if len(fixed) != n:
        raise ConfigError(f"fixed_s needs one entry per worker ({n}), got {len(fixed)}")

    if isinstance(leave_out_gain, bool) or not 0 <= leave_out_gain < 1:
        raise ConfigError(f"leave_out_gain must lie in [0, 1), got {leave_out_gain!r}")
    pairs = {} if pair_bandwidths_bps is None else dict(pair_bandwidths_bps)
    for (a, b), bps in pairs.items():
        if not (0 <= a < b < n) or not bps > 0:
            raise ConfigError(f"pair_bandwidths_bps[{(a, b)}] must link workers a < b < {n} "
                              f"with a bandwidth > 0, got {bps!r}")  # fmt: skip

    prefix = [0.0]
    for t in units:
        prefix.append(prefix[-1] + t)

    def compute(worker: int, first: int, last: int) -> float:  # eq. 7 (and 3)
        return fixed[worker] + (prefix[last + 1] - prefix[first]) * caps[worker]

    def link(worker: int, unit: int) -> float:  # 2 x eq. 6
        return 2.0 * sizes[unit] / links[worker] if sizes[unit] else 0.0

    # best[k][j]: A(j, k + 1); cut[k][j]: the l that gives it
    best = [[math.inf] * total for _ in range(n)]
    cut = [[-1] * total for _ in range(n)]
    for j in range(total):
        best[0][j] = compute(0, 0, j)  # eq. 4
    for k in range(1, n):
        for j in range(k, total):
            for l in range(k - 1, j):  # noqa: E741 - the paper's name
                value = max(best[k - 1][l], link(k - 1, l), compute(k, l + 1, j))
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, l
    bounds = [total]
    j = total - 1
    for k in range(n - 1, 0, -1):
        j = cut[k][j]
        bounds.append(j + 1)
    bounds.append(0)
    bounds.reverse()
    stage_s = tuple(compute(i, bounds[i], bounds[i + 1] - 1) for i in range(n))
    link_s = tuple(link(i, bounds[i + 1] - 1) for i in range(n - 1))
    everyone = FTPipeHDPartition(tuple(bounds), best[n - 1][total - 1], stage_s, link_s)
    if not leave_out or n == 1:
        return everyone
    fewer = _with_workers_left_out(compute, units, sizes, links, pairs, keep_ends=keep_ends)
    if len(fewer.workers) < n and fewer.period_s < everyone.period_s * (1.0 - leave_out_gain):
        return fewer
    return everyone


def _with_workers_left_out(
    compute: Callable[[int, int, int], float],
    units: Sequence[float],
    sizes: Sequence[float],
    links: Sequence[float],
    pairs: Mapping[tuple[int, int], float],
    *,
    keep_ends: bool,
) -> FTPipeHDPartition:
    """Eq. 5 over the units and which workers take part (the module notes' ``B``)."""
    n, total = len(links) + 1, len(units)

    def bandwidth(a: int, b: int) -> float:
        # a measured pair, else the narrowest hop of the chain between them
        return pairs.get((a, b), min(links[a:b]))

    def link(a: int, b: int, unit: int) -> float:
        return 2.0 * sizes[unit] / bandwidth(a, b) if sizes[unit] else 0.0

    # best[k][j]: B(j, k); came[k][j]: (k', l) it came from, (-1, -1): k alone
    # a worker alone at the front: any, or worker 0 only when the ends are kept
    best = [
        [compute(k, 0, j) if k == 0 or not keep_ends else math.inf for j in range(total)]
        for k in range(n)
    ]
    came = [[(-1, -1)] * total for _ in range(n)]
    # workers taking part: of two pipelines with the same period, the one with more
    # (the fewer devices left idle)
    count = [[1] * total for _ in range(n)]
    for k in range(1, n):
        for j in range(1, total):
            for before in range(k):
                for l in range(j):  # noqa: E741 - the paper's name
                    value = max(best[before][l], link(before, k, l), compute(k, l + 1, j))
                    more = count[before][l] + 1
                    if value < best[k][j] or (value == best[k][j] and more > count[k][j]):
                        best[k][j], came[k][j], count[k][j] = value, (before, l), more
    ends = [n - 1] if keep_ends else range(n)
    last = min(ends, key=lambda k: (best[k][total - 1], -count[k][total - 1], -k))
    workers, bounds = [last], [total]
    k, j = last, total - 1
    while came[k][j][0] >= 0:
        k, l = came[k][j]  # noqa: E741
        workers.append(k)
        bounds.append(l + 1)
        j = l
    bounds.append(0)
    workers.reverse()
    bounds.reverse()
    stage_s = tuple(compute(w, bounds[i], bounds[i + 1] - 1) for i, w in enumerate(workers))
    link_s = tuple(link(a, b, bounds[i + 1] - 1) for i, (a, b) in enumerate(pairwise(workers)))
    return FTPipeHDPartition(tuple(bounds), best[last][total - 1], stage_s, link_s, tuple(workers))


def repartition_from_measurements(
    measured_s: Mapping[str, float],
    order: Sequence[str],
    bounds: Sequence[int],
    reference_unit_s: Sequence[float],
    *,
    output_bytes: Sequence[float] | None = None,
    bandwidths_bps: Sequence[float] | None = None,
    leave_out: bool = False,
    leave_out_gain: float = 0.0,
    keep_ends: bool = False,
) -> FTPipeHDPartition:
    """FTPipeHD's re-partition: each worker's capacity from its measured time per
    batch over its current units ``[bounds[i], bounds[i + 1])`` (eqs. 1-3), then the
    cuts of eq. 5 for the same workers in the same ``order``."""
    if len(bounds) != len(order) + 1:
        raise ConfigError(f"{len(order)} workers need {len(order) + 1} bounds, got {len(bounds)}")
    missing = [d for d in order if d not in measured_s]
    if missing:
        raise ConfigError(f"no measured time from {missing}")
    ranges = {d: (int(bounds[i]), int(bounds[i + 1])) for i, d in enumerate(order)}
    caps = estimate_capacities(measured_s, ranges, reference_unit_s)
    return ftpipehd_partition(
        reference_unit_s,
        capacities=[caps[d] for d in order],
        output_bytes=output_bytes,
        bandwidths_bps=bandwidths_bps,
        leave_out=leave_out,
        leave_out_gain=leave_out_gain,
        keep_ends=keep_ends,
    )
