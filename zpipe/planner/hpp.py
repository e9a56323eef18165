"""Training planners: Asteroid's HPP dynamic program, Eco-FL's straight pipeline, baselines.

All four return a :class:`TrainingPlan` whose predictions come from one cost
model (:mod:`zpipe.planner.training_cost`), so their plans compare fairly:

- ``hpp`` (Asteroid, MobiCom '24, section 3.3, Algorithm 2): contiguous stages,
  each on a group of devices that split every micro-batch (Algorithm 1),
  chosen by a dynamic program that minimises the estimated round latency.
- ``straight`` (Eco-FL, ICPP '22, section 4.2, eq. 1; PipeDream's and
  FTPipeHD's eq. 5 are the same DP): one device per stage, in the given order,
  minimising the slowest stage's forward + backward or inter-stage transfer.
- ``data-parallel``: one stage holding every device that fits the model,
  samples shared by capacity within memory (Algorithm 1).
- ``even``: GPipe's partition, the same number of units per device.

The HPP dynamic program
-----------------------
Devices are sorted by memory, most first (Asteroid puts the early, activation-
heavy stages on the large devices), and every stage's group is a contiguous
run of that order, each later stage's group after the earlier ones'.
``Q(i, g, h, p)`` is the best sub-pipeline that runs units ``[i, L)`` in ``p``
stages, the first of them on devices ``[g, h)``. It refines the paper's
``Q(l, n, p)`` by the first group's end ``h``, because the transfer into a
stage depends on which devices receive it. Eq. 10's transition prepends a
stage ``[i, j)`` on ``[g, h)``, and the communication step, to a sub-pipeline
``Q(j, g2, h2, p - 1)`` with ``g2 >= h``. The paper's ``Q(L, N, p)`` puts
every device in some group; we also let devices be left out before, between
and after the groups, so that a device too small for any stage, or too slow
or badly linked to help, does not spoil the plan (with ``g2 = h`` throughout
the paper's plans are all still there).

Exactness. With ``E^s = E_f^s + E_b^s``, eq. 4-6 reduce to (see
:func:`~zpipe.planner.training_cost.estimate_round_s`)::

    round = A + R,   A = max_s (M E^s + sum_{i<s} E^i),   R = max_s (T_a^s - sum_{i<s} E_b^i)

``A`` is eq. 11's aligned execution time of the dominant step. Prepending an
execution step ``ne`` and a communication step ``nc`` gives::

    A' = max(A + E^ne + E^nc, M E^ne, M E^nc + E^ne)        (eq. 11)
    R' = max(T_a^ne, R - E_b^ne - E_b^nc)

Both grow with ``A`` and ``R``, but a sub-pipeline with the least ``A + R`` is
not always the best to extend (the all-reduce term ``R`` shrinks by the new
steps' backward, ``A`` does not). So each state keeps the Pareto front of its
``(A, R)`` pairs instead of one number, and the DP is exact for this cost
model: it finds the least round over every split into contiguous stages and
every choice of disjoint, ordered, contiguous runs of the memory-ordered
devices as their groups. Fronts stay small
(one point wherever no group all-reduces).

The warm-up K_p of a stage depends only on how many stages follow it
(Asteroid's ``K_p = min(2 (P - p) - 1, M)``; M under GPipe), which the DP
knows as it builds from the back, so every stage's memory (eq. 3) is checked
with the K it will run with.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import NoReturn

import numpy as np

from zpipe._errors import ConfigError
from zpipe.planner.cluster import ClusterDevice, ClusterSpec
from zpipe.planner.cost import InfeasiblePlanError, fmt_bytes
from zpipe.planner.pipeedge import device_categories
from zpipe.planner.plan import even_ranges
from zpipe.planner.profile import ModelProfile
from zpipe.planner.training_cost import (
    TrainingCosts,
    allocate_microbatches,
    estimate_round_s,
    estimate_stages_round_s,
    evaluate_group,
    group_cost,
    predict_training,
    stage_costs,
)
from zpipe.planner.training_plan import (
    TRAINING_ALGOS,
    TRAINING_SCHEDULES,
    TrainingPlan,
    TrainStage,
)
from zpipe.training.schedules import asteroid_warmup, ecofl_warmup

# Rounds within this relative distance tie; the plan with fewer devices, then fewer
# stages, wins (prefix sums are not bit-exact).
_TIE_RTOL = 1e-9
# Limit of the HPP DP's work: (stage, next stage) pairs it would examine without pruning.
# Asteroid Table 7's case, 213 units over 6 devices, is 9.6 million (half a second on 2 cores).
MAX_HPP_WORK = 20_000_000


def memory_order(devices: Sequence[ClusterDevice]) -> list[ClusterDevice]:
    """Asteroid's device order: most memory first, unlimited first of all; ties keep order."""
    return sorted(devices, key=lambda d: -math.inf if d.memory_bytes is None else -d.memory_bytes)


def stage_warmup(schedule: str, stages_from_end: int, num_microbatches: int) -> int:
    """K of a stage followed by ``stages_from_end - 1`` more: Asteroid's for 1F1B, M for GPipe."""
    if schedule == "gpipe":
        return num_microbatches
    return asteroid_warmup(stages_from_end, 0, num_microbatches)


# -- the HPP dynamic program ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Group:
    """What the DP needs of a stage's group: its shares and eq. 8's and eq. 5's times."""

    devices: tuple[str, ...]
    shares: tuple[int, ...]
    step_s: float  # E_f + E_b
    backward_s: float  # E_b
    allreduce_s: float  # T_a


@dataclass(frozen=True, slots=True)
class _Stage:
    start: int
    end: int
    group: _Group


# Not frozen: the DP makes millions of points, and a frozen dataclass's __init__ costs
# several times a plain one's. Points are never changed after they are made.
@dataclass(slots=True)
class _Point:
    """One Pareto point of a DP state: a sub-pipeline, head stage first."""

    aligned_s: float  # A: the dominant step's aligned execution time (eq. 11)
    allreduce_s: float  # R: max_s (T_a^s - backward time before s)
    head: _Stage
    rest: _Point | None
    num_devices: int
    num_stages: int

    @property
    def round_s(self) -> float:
        return self.aligned_s + self.allreduce_s

    def stages(self) -> list[_Stage]:
        out = [self.head]
        rest = self.rest
        while rest is not None:
            out.append(rest.head)
            rest = rest.rest
        return out


# A state's Pareto front, with the group of its head stage: (g, h, front).
_Entry = tuple[int, int, list[_Point]]


class _GroupTable:
    """A run of devices' stages at one warm-up, filled in as the DP asks for them.

    Stage ``[i, j)`` sits at ``[i, j - i - 1]``: a band that widens as the DP asks for
    longer stages (its bounds keep them short). ``status``: 0 not evaluated yet, 1 the
    group runs the stage, 2 it cannot (memory).
    """

    __slots__ = ("_most", "allreduce", "backward", "shares", "status", "step", "width")

    def __init__(self, num_units: int, size: int) -> None:
        self._most = num_units  # j - i - 1 < num_units
        self.width = 0
        self.status = np.zeros((num_units + 1, 0), dtype=np.int8)
        self.step = np.zeros((num_units + 1, 0))  # E_f + E_b
        self.backward = np.zeros((num_units + 1, 0))  # E_b
        self.allreduce = np.zeros((num_units + 1, 0))  # T_a
        self.shares = np.zeros((num_units + 1, 0, size), dtype=np.int64)

    def widen(self, width: int) -> None:
        """Make room for columns ``0..width - 1``."""
        if width <= self.width:
            return
        width = min(max(width, 2 * self.width, 16), self._most)

        def grown(old: np.ndarray) -> np.ndarray:
            new = np.zeros((old.shape[0], width, *old.shape[2:]), dtype=old.dtype)
            new[:, : self.width] = old
            return new

        self.status, self.step, self.backward = (
            grown(self.status),
            grown(self.step),
            grown(self.backward),
        )
        self.allreduce, self.shares = grown(self.allreduce), grown(self.shares)
        self.width = width


@dataclass(frozen=True, slots=True)
class _Level:
    """The states of one number of stages, as flat arrays of their Pareto points in the
    order the DP made them: by first unit, then group ``(g, h)``, then front order."""

    offsets: np.ndarray  # the points of states that start at unit j: [offsets[j], offsets[j+1])
    last_group: np.ndarray  # per unit: the first device g of its last state's group; -1: none
    unit: np.ndarray  # per point: the first unit of its state
    first: np.ndarray  # g of its head stage's group
    pair: np.ndarray  # (g, h) of its head stage's group, as an index of _HppSolver.pairs
    aligned: np.ndarray  # A
    allreduce: np.ndarray  # R
    num_devices: np.ndarray
    points: list[_Point]


class _HppSolver:
    """Asteroid's Algorithm 2 over memory-ordered ``devices``, vectorised with numpy.

    Speed matters here (Asteroid Table 7: 213 layers over 6 devices), so a state's
    stage loop stops at the first stage too long or too large to be in a better plan:
    a stage's time and memory never shrink as it takes more units. The bound only
    changes at states that start at unit 0 (complete plans), so the DP takes those one
    by one and then, for each group of devices, evaluates (Algorithm 1 included) every
    stage the other states of that many stages may need in one batch; each state then
    extends the next level's Pareto points in one batch too. The arithmetic is the
    scalar form's, in the same order, and ties break the same way, so the plans are too.
    """

    def __init__(
        self,
        costs: TrainingCosts,
        devices: Sequence[ClusterDevice],
        *,
        num_microbatches: int,
        schedule: str,
        block: int,
    ) -> None:
        self.costs = costs
        self.devices = list(devices)
        self.m = num_microbatches
        self.schedule = schedule
        self.block = block
        n, num_units = len(self.devices), costs.num_units
        tables = [costs.prefix_tables(d) for d in self.devices]
        self._forward = [f for f, _ in tables]
        self._backward = [k for _, k in tables]
        self._names = [d.name for d in self.devices]
        self.pairs = [(g, h) for g in range(n) for h in range(g + 1, n + 1)]
        self._pair = {gh: k for k, gh in enumerate(self.pairs)}
        # bandwidth[a, c]: the slowest link from a device of run a to another of run c
        links = [
            [math.inf if u == v else costs.bandwidth_bps(u, v) for v in self._names]
            for u in self._names
        ]
        self._bandwidth = np.array(
            [
                [
                    min(links[u][v] for u in range(g, h) for v in range(g2, h2))
                    for g2, h2 in self.pairs
                ]
                for g, h in self.pairs
            ]
        )
        self._bits = np.array(
            [0.0] + [costs.boundary_bytes(j) * 8.0 for j in range(1, num_units + 1)]
        )
        # at the current warm-up: stages that end before the last unit, and those that end there
        self._tables: dict[tuple[int, int], _GroupTable] = {}
        self._finals: dict[tuple[int, int], _GroupTable] = {}
        self._prefix: dict[int, list[float]] = {}

    # -- stages -----------------------------------------------------------------------

    def _table(self, g: int, h: int, *, final: bool = False) -> _GroupTable:
        tables = self._finals if final else self._tables
        table = tables.get((g, h))
        if table is None:
            table = tables[g, h] = _GroupTable(self.costs.num_units, h - g)
            if final:  # one column: the stage that ends at the last unit
                table.widen(1)
        return table

    def _evaluate(
        self,
        table: _GroupTable,
        g: int,
        h: int,
        warmup: int,
        starts: np.ndarray,
        ends: np.ndarray,
        columns: np.ndarray,
    ) -> None:
        """Fill in stages ``[starts[r], ends[r])`` on devices ``[g, h)`` at ``columns[r]``:
        Algorithm 1's shares (:func:`evaluate_group`'s), eq. 8's times and eq. 5's
        all-reduce."""
        if not starts.size:
            return
        costs, b, size = self.costs, self.costs.microbatch_size, h - g
        caps = np.stack(
            [costs.max_shares(self.devices[d], starts, ends, warmup) for d in range(g, h)], axis=1
        )
        runs = (caps.min(axis=1) >= 0) & (caps.sum(axis=1) >= b)
        table.status[starts, columns] = np.where(runs, 1, 2)
        starts, ends, columns, caps = starts[runs], ends[runs], columns[runs], caps[runs]
        if not starts.size:
            return
        fwd, bwd = self._forward[g:h], self._backward[g:h]
        if size == 1:
            shares = np.full((starts.size, 1), b, dtype=np.int64)
        else:
            # the same sums in the same order as TrainingCosts.step_times: [stage, device, y]
            times = np.stack(
                [
                    (f[:, ends] - f[:, starts] + k[:, ends]) - k[:, starts]
                    for f, k in zip(fwd, bwd, strict=True)
                ],
                axis=1,
            ).transpose(2, 1, 0)
            shares, _ = allocate_microbatches(times, caps, b, block=self.block)
        forward = backward = None
        for d, (f, k) in enumerate(zip(fwd, bwd, strict=True)):
            y = shares[:, d]
            fd = f[y, ends] - f[y, starts]
            bd = k[y, ends] - k[y, starts]
            forward = fd if forward is None else np.maximum(forward, fd)
            backward = bd if backward is None else np.maximum(backward, bd)
        assert forward is not None and backward is not None
        table.step[starts, columns] = forward + backward
        table.backward[starts, columns] = backward
        if size > 1:  # TrainingCosts.allreduce_s
            bandwidth = float(self._bandwidth[self._pair[g, h], self._pair[g, h]])
            weights = costs.weight_prefix[ends] - costs.weight_prefix[starts]
            volume = 2.0 * (size - 1) / size * weights * 8.0
            table.allreduce[starts, columns] = volume / bandwidth if bandwidth != math.inf else 0.0
        table.shares[starts, columns] = shares

    def _group(self, table: _GroupTable, start: int, column: int, g: int, h: int) -> _Group:
        return _Group(
            tuple(self._names[g:h]),
            tuple(int(y) for y in table.shares[start, column]),
            float(table.step[start, column]),
            float(table.backward[start, column]),
            float(table.allreduce[start, column]),
        )

    def _stops(self, g: int, h: int, rows: np.ndarray, bounds: np.ndarray, last: int) -> np.ndarray:
        """Per row ``i``: the first end ``j`` in ``(i, last]`` at which a lower bound of
        the group's step on units ``[i, j)``, whatever its shares, times M exceeds the
        row's bound (``last + 1`` if none): some device runs at least ceil(B / k) samples,
        and times grow with the share. Looks at ends in widening windows."""
        y = -(-self.costs.microbatch_size // (h - g))
        rates = [(self._forward[d][y], self._backward[d][y]) for d in range(g, h)]
        stops = np.full(rows.size, last + 1, dtype=np.int64)
        pending = np.arange(rows.size)
        following = rows + 1  # per row: the first end not looked at yet
        width = 16
        while pending.size:
            starts = rows[pending][:, None]
            ends = following[pending][:, None] + np.arange(width)
            inside = ends <= last
            at = np.minimum(ends, last)
            f, k = rates[0]
            least = (f[at] - f[starts]) + (k[at] - k[starts])
            for f, k in rates[1:]:
                least = np.minimum(least, (f[at] - f[starts]) + (k[at] - k[starts]))
            over = inside & (self.m * least > bounds[pending][:, None])
            found = over.any(axis=1)
            stops[pending[found]] = ends[found, over[found].argmax(axis=1)]
            following[pending] += width
            pending = pending[~found & inside[:, -1]]
            width *= 2
        return stops

    def _least_prefix(self, g: int) -> list[float]:
        """``[i]``: a lower bound of the steps that units ``[0, i)`` add to a round on
        devices ``[0, g)`` (``g >= 1``): eq. 11 adds every earlier stage's step to A, and
        each unit runs on some device with a share of at least ceil(B / g)."""
        prefix = self._prefix.get(g)
        if prefix is None:
            y = -(-self.costs.microbatch_size // g)
            per_unit = [
                min(float(s) for s in unit)
                for unit in zip(
                    *(
                        np.diff(self._forward[d][y]) + np.diff(self._backward[d][y])
                        for d in range(g)
                    ),
                    strict=True,
                )
            ]
            prefix = self._prefix[g] = [0.0, *itertools.accumulate(per_unit)]
        return prefix

    # -- the dynamic program ----------------------------------------------------------

    def solve(self) -> _Point | None:
        """The least-round plan over every split, grouping and number of stages."""
        num_units, n = self.costs.num_units, len(self.devices)
        _check_hpp_size(num_units, n)
        best: _Point | None = None
        level: _Level | None = None  # the states of p - 1 stages
        warmup = 0
        for p in range(1, min(num_units, n) + 1):
            if stage_warmup(self.schedule, p, self.m) != warmup:
                warmup = stage_warmup(self.schedule, p, self.m)
                self._tables, self._finals = {}, {}  # stages are evaluated at one warm-up
            states: dict[int, list[_Entry]] = {}
            # States at unit 0, one by one: each complete plan may tighten the bound.
            for g in range(n - p + 1):
                for h in range(g + 1, n - p + 2):
                    bound = math.inf if best is None else best.round_s * (1 + _TIE_RTOL)
                    one = np.zeros(1, dtype=np.int64)
                    first = self._prepare(p, g, h, warmup, one, np.array([bound]), level)
                    front = self._state(p, 0, g, h, bound, level, int(first[0]))
                    if front:
                        states.setdefault(0, []).append((g, h, front))
                        best = _better(best, min(front, key=lambda q: q.round_s))
            # The others, whose bound no longer changes: units [0, i) need a device
            # before the group, so g >= 1. Every stage they may look at is evaluated first,
            # a batch per group.
            rows = np.arange(1, num_units - p + 1)
            ceiling = math.inf if best is None else best.round_s * (1 + _TIE_RTOL)
            stops: dict[tuple[int, int], np.ndarray] = {}
            for g in range(1, n - p + 1):
                # every point's round grows by at least the steps before unit i
                bounds = ceiling - np.array(self._least_prefix(g))[rows]
                for h in range(g + 1, n - p + 2):
                    stops[g, h] = self._prepare(p, g, h, warmup, rows, bounds, level)
            for i in rows.tolist():
                entries: list[_Entry] = []
                for g in range(1, n - p + 1):
                    bound = ceiling - self._least_prefix(g)[i]
                    for h in range(g + 1, n - p + 2):
                        stop = int(stops[g, h][i - 1])
                        front = self._state(p, i, g, h, bound, level, stop)
                        if front:
                            entries.append((g, h, front))
                if entries:
                    states[i] = entries
            if not states:  # no state of p stages: none of more
                break
            level = self._level(states)
        return best

    def _prepare(
        self,
        p: int,
        g: int,
        h: int,
        warmup: int,
        rows: np.ndarray,
        bounds: np.ndarray,
        level: _Level | None,
    ) -> np.ndarray:
        """Evaluate, in one batch, the stages on ``[g, h)`` that the states ``(i, g, h, p)``
        for ``i`` in ``rows`` may look at with ``bounds``, where not done yet (perhaps some
        past one that does not fit, where :meth:`_state` stops). Returns their stops
        (:meth:`_stops`; none for ``p == 1``)."""
        num_units = self.costs.num_units
        if p == 1:
            table = self._table(g, h, final=True)
            todo = rows[table.status[rows, 0] == 0]
            zeros = np.zeros(todo.shape, dtype=np.int64)
            self._evaluate(table, g, h, warmup, todo, np.full(todo.shape, num_units), zeros)
            return zeros
        assert level is not None
        table = self._table(g, h)
        stops = self._stops(g, h, rows, bounds, num_units - p + 1)
        lengths = stops - rows - 1  # ends i + 1 .. stop - 1
        total = int(lengths.sum())
        if not total:
            return stops
        table.widen(int(lengths.max()))
        starts = np.repeat(rows, lengths)
        columns = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        ends = starts + 1 + columns
        # entries come in order of their first device: none after this group, no plan
        wanted = (level.last_group[ends] >= h) & (table.status[starts, columns] == 0)
        self._evaluate(table, g, h, warmup, starts[wanted], ends[wanted], columns[wanted])
        return stops

    def _state(
        self, p: int, i: int, g: int, h: int, bound: float, level: _Level | None, stop: int
    ) -> list[_Point]:
        """The Pareto front of state ``(i, g, h, p)``, without points whose round exceeds
        ``bound`` (a complete plan's): prepending steps never shortens a round.

        ``level`` holds the states of ``p - 1`` stages. The stage ends at most at
        ``stop - 1``: past it, its least step is too long (:meth:`_stops`). It ends
        before the first end too large for the group's memory, too: both only grow with
        the end. :meth:`_prepare` has evaluated the stages this looks at.
        """
        m = self.m
        if p == 1:
            table = self._table(g, h, final=True)
            if table.status[i, 0] != 1:
                return []
            group = self._group(table, i, 0, g, h)
            stage = _Stage(i, self.costs.num_units, group)
            return [_Point(m * group.step_s, group.allreduce_s, stage, None, h - g, 1)]
        assert level is not None
        table, low = self._table(g, h), i + 1
        if stop <= low:
            return []
        some = level.last_group[low:stop] >= h
        too_large = np.flatnonzero(some & (table.status[i, : stop - low] == 2))
        if too_large.size:
            stop = low + int(too_large[0])
        a, z = int(level.offsets[low]), int(level.offsets[stop])
        if a >= z:
            return []
        columns = level.unit[a:z] - low
        step = table.step[i, columns]
        at = a + np.flatnonzero((level.first[a:z] >= h) & (m * step <= bound))
        if not at.size:
            return []
        # Eq. 10-11: a new execution step and communication step in front of each point.
        units = level.unit[at]
        columns = units - low
        step, backward = table.step[i, columns], table.backward[i, columns]
        own, their = self._pair[g, h], level.pair[at]
        bits = self._bits[units]
        onward, back = self._bandwidth[own, their], self._bandwidth[their, own]
        send = np.where(onward == math.inf, 0.0, bits / onward)
        receive = np.where(back == math.inf, 0.0, bits / back)
        link = send + receive
        aligned = np.maximum(np.maximum(level.aligned[at] + step + link, m * step), m * link + step)
        allreduce = np.maximum(
            table.allreduce[i, columns], level.allreduce[at] - backward - receive
        )
        kept = np.flatnonzero(aligned + allreduce <= bound)
        if not kept.size:
            return []
        aligned, allreduce, at, units = aligned[kept], allreduce[kept], at[kept], units[kept]
        used = level.num_devices[at] + (h - g)
        # The points no other point beats in both A and R (ties: fewer devices first, then
        # the order they were made in).
        order = np.lexsort((kept, used, allreduce, aligned))
        ranked = allreduce[order]
        on_front = np.ones(order.size, dtype=bool)
        on_front[1:] = ranked[1:] < np.minimum.accumulate(ranked)[:-1]
        front: list[_Point] = []
        stages: dict[int, _Stage] = {}
        for k in order[on_front].tolist():
            j = int(units[k])
            if j not in stages:
                stages[j] = _Stage(i, j, self._group(table, i, j - low, g, h))
            stage = stages[j]
            rest = level.points[int(at[k])]
            front.append(
                _Point(
                    float(aligned[k]),
                    float(allreduce[k]),
                    stage,
                    rest,
                    int(used[k]),
                    rest.num_stages + 1,
                )
            )
        return front

    def _level(self, states: dict[int, list[_Entry]]) -> _Level:
        num_units = self.costs.num_units
        counts = np.zeros(num_units + 1, dtype=np.int64)
        last_group = np.full(num_units + 1, -1, dtype=np.int64)
        unit: list[int] = []
        first: list[int] = []
        pair: list[int] = []
        points: list[_Point] = []
        for i, entries in sorted(states.items()):
            for g, h, front in entries:
                last_group[i] = g
                counts[i] += len(front)
                unit += [i] * len(front)
                first += [g] * len(front)
                pair += [self._pair[g, h]] * len(front)
                points += front
        offsets = np.zeros(num_units + 2, dtype=np.int64)
        offsets[1:] = np.cumsum(counts)
        return _Level(
            offsets=offsets,
            last_group=last_group,
            unit=np.array(unit, dtype=np.int64),
            first=np.array(first, dtype=np.int64),
            pair=np.array(pair, dtype=np.int64),
            aligned=np.array([q.aligned_s for q in points]),
            allreduce=np.array([q.allreduce_s for q in points]),
            num_devices=np.array([q.num_devices for q in points], dtype=np.int64),
            points=points,
        )


def _better(a: _Point | None, b: _Point) -> _Point:
    """The lesser round; near-ties go to fewer devices, then fewer stages."""
    if a is None:
        return b
    if abs(a.round_s - b.round_s) <= _TIE_RTOL * max(a.round_s, b.round_s):
        return a if (a.num_devices, a.num_stages) <= (b.num_devices, b.num_stages) else b
    return a if a.round_s < b.round_s else b


def _check_hpp_size(num_units: int, num_devices: int) -> None:
    pairs = math.comb(num_units + 1, 2) * math.comb(num_devices + 2, 4)
    work = pairs * min(num_units, num_devices)
    if work > MAX_HPP_WORK:
        raise ConfigError(
            f"planning {num_units} units over {num_devices} devices exactly examines about "
            f"{work:,} stage pairs, too many to finish in reasonable time; plan over fewer "
            "devices (--devices) or profile the model with coarser units"
        )


# -- Eco-FL's straight pipeline (eq. 1) -------------------------------------------------


def _straight_split(
    costs: TrainingCosts, devices: Sequence[ClusterDevice], warmup: int
) -> tuple[float, list[int]] | None:
    """Eco-FL's eq. 1 over ``devices`` in order, one stage each, every stage holding
    ``warmup`` micro-batches; the objective and the stage boundaries, or None.

    ``A(k, s) = min_j max(A(j, s - 1), (a_j + g_j) / B, T(j..k, s))``: the slowest
    of the stages' forward + backward times and of the transfers of a
    boundary's activations and gradients between neighbours.
    """
    num_units, stages, b = costs.num_units, len(devices), costs.microbatch_size
    names = [d.name for d in devices]
    inf = math.inf
    best = [[inf] * (num_units + 1) for _ in range(stages + 1)]
    parent = [[-1] * (num_units + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        device = devices[s - 1]
        for k in range(s, num_units - (stages - s) + 1):
            for j in range(s - 1, k):
                if best[s - 1][j] == inf or costs.max_share(device, j, k, warmup) < b:
                    continue
                link = 0.0 if s == 1 else sum(costs.transfer_s([names[s - 2]], [names[s - 1]], j))
                step = costs.forward_s(device, j, k, b) + costs.backward_s(device, j, k, b)
                value = max(best[s - 1][j], link, step)
                if value < best[s][k]:
                    best[s][k], parent[s][k] = value, j
    if best[stages][num_units] == inf:
        return None
    bounds = [num_units]
    for s in range(stages, 0, -1):
        bounds.append(parent[s][bounds[-1]])
    bounds.reverse()
    return best[stages][num_units], bounds


def _straight_warmups(
    costs: TrainingCosts,
    devices: Sequence[ClusterDevice],
    bounds: Sequence[int],
    num_microbatches: int,
) -> tuple[list[int], list[int]]:
    """(Eco-FL's P_s from eq. 3, the K_s a stage can run: ``min(P_s, Q_s)``).

    ``Q_s`` is how many micro-batches' activations the stage's memory holds.
    The K_s are also kept from growing along the pipeline, which would
    deadlock 1F1B.
    """
    b = costs.microbatch_size
    spans = list(pairwise(bounds))
    forward = [costs.forward_s(d, i, j, b) for d, (i, j) in zip(devices, spans, strict=True)]
    backward = [costs.backward_s(d, i, j, b) for d, (i, j) in zip(devices, spans, strict=True)]
    links = [
        costs.transfer_s([devices[s].name], [devices[s + 1].name], spans[s][1])
        for s in range(len(devices) - 1)
    ]
    wanted = ecofl_warmup(
        forward, backward, [f for f, _ in links], [g for _, g in links], num_microbatches
    )
    runs: list[int] = []
    for s, (d, (i, j)) in enumerate(zip(devices, spans, strict=True)):
        held = _in_flight_capacity(costs, d, i, j)
        cap = runs[-1] if runs else num_microbatches
        runs.append(max(1, min(wanted[s], held, cap)))
    return wanted, runs


def _in_flight_capacity(costs: TrainingCosts, device: ClusterDevice, start: int, end: int) -> int:
    """Q_s: how many micro-batches' activations ``device`` holds beside the stage's weights."""
    if device.memory_bytes is None:
        return 1 << 30
    saved = costs.saved_bytes(start, end, costs.microbatch_size)
    room = device.memory_bytes - costs.static_bytes(start, end)
    if saved <= 0:
        return 1 << 30 if room >= 0 else 0
    return max(0, int(room // saved))


# -- building plans ---------------------------------------------------------------------


def _plan(
    costs: TrainingCosts,
    *,
    algo: str,
    schedule: str,
    num_microbatches: int,
    stages: Sequence[TrainStage],
    extra: dict[str, float] | None = None,
) -> TrainingPlan:
    plan = TrainingPlan(
        algo=algo,
        schedule=schedule,
        num_units=costs.num_units,
        microbatch_size=costs.microbatch_size,
        num_microbatches=num_microbatches,
        stages=tuple(stages),
    )
    predicted = predict_training(plan, costs)
    predicted.update(extra or {})
    return TrainingPlan(
        algo=algo,
        schedule=schedule,
        num_units=plan.num_units,
        microbatch_size=plan.microbatch_size,
        num_microbatches=num_microbatches,
        stages=plan.stages,
        predicted=predicted,
    )


def _plan_hpp(
    costs: TrainingCosts,
    devices: Sequence[ClusterDevice],
    *,
    num_microbatches: int,
    schedule: str,
    block: int,
) -> TrainingPlan:
    ordered = memory_order(devices)
    solver = _HppSolver(
        costs, ordered, num_microbatches=num_microbatches, schedule=schedule, block=block
    )
    best = solver.solve()
    if best is None:
        _raise_infeasible(costs, ordered, schedule, num_microbatches, "hpp")
    found = best.stages()
    stages = [
        TrainStage(
            devices=s.group.devices,
            start=s.start,
            end=s.end,
            shares=s.group.shares,
            warmup=stage_warmup(schedule, len(found) - k, num_microbatches),
        )
        for k, s in enumerate(found)
    ]
    return _plan(
        costs,
        algo="hpp",
        schedule=schedule,
        num_microbatches=num_microbatches,
        stages=stages,
        extra={"planner_objective_s": best.round_s},
    )


@dataclass(frozen=True)
class _StraightSplit:
    """Eco-FL's partition over devices in one order, with its warm-ups."""

    devices: list[ClusterDevice]
    bounds: list[int]
    objective_s: float
    wanted: list[int]  # P_s (eq. 3)
    runs: list[int]  # K_s the stages run: P_s where memory holds it

    @property
    def ddb_free(self) -> bool:
        """Every stage holds the forwards eq. 3 asks for: no data-dependency bubbles."""
        return all(k >= p for k, p in zip(self.runs, self.wanted, strict=True))

    def stages(self, microbatch_size: int) -> list[TrainStage]:
        return [
            TrainStage((d.name,), self.bounds[s], self.bounds[s + 1], (microbatch_size,), k)
            for s, (d, k) in enumerate(zip(self.devices, self.runs, strict=True))
        ]


def _solve_straight(
    costs: TrainingCosts,
    devices: Sequence[ClusterDevice],
    *,
    num_microbatches: int,
    schedule: str,
) -> _StraightSplit | None:
    used = list(devices[: costs.num_units])
    found = _straight_split(costs, used, num_microbatches if schedule == "gpipe" else 1)
    if found is None:
        return None
    objective, bounds = found
    if schedule == "gpipe":
        wanted = runs = [num_microbatches] * len(used)
    else:
        wanted, runs = _straight_warmups(costs, used, bounds, num_microbatches)
    return _StraightSplit(used, bounds, objective, wanted, runs)


def _straight_plan(
    costs: TrainingCosts, split: _StraightSplit, *, num_microbatches: int, schedule: str
) -> TrainingPlan:
    return _plan(
        costs,
        algo="straight",
        schedule=schedule,
        num_microbatches=num_microbatches,
        stages=split.stages(costs.microbatch_size),
        extra={"planner_objective_s": split.objective_s, "ddb_free": float(split.ddb_free)},
    )


def _plan_straight(
    costs: TrainingCosts,
    devices: Sequence[ClusterDevice],
    *,
    num_microbatches: int,
    schedule: str,
) -> TrainingPlan:
    split = _solve_straight(costs, devices, num_microbatches=num_microbatches, schedule=schedule)
    if split is None:
        used = devices[: costs.num_units]
        _raise_infeasible(costs, used, schedule, num_microbatches, "straight", order_fixed=True)
    return _straight_plan(costs, split, num_microbatches=num_microbatches, schedule=schedule)


def _plan_data_parallel(
    costs: TrainingCosts,
    devices: Sequence[ClusterDevice],
    *,
    num_microbatches: int,
    schedule: str,
    block: int,
) -> TrainingPlan:
    """One stage over every device that holds the whole model and one sample's activations;
    Algorithm 1's shares; devices left with no sample are dropped (they would only slow
    the all-reduce)."""
    num_units = costs.num_units
    warmup = stage_warmup(schedule, 1, num_microbatches)
    fits = [d for d in devices if costs.max_share(d, 0, num_units, warmup) >= 1]
    group = evaluate_group(costs, fits, 0, num_units, warmup, block=block) if fits else None
    if group is None:
        _raise_infeasible(costs, devices, schedule, num_microbatches, "data-parallel")
    busy = [d for d, y in zip(fits, group.shares, strict=True) if y > 0]
    if len(busy) < len(fits):
        shares = [y for y in group.shares if y > 0]
        group = group_cost(costs, busy, 0, num_units, shares, warmup)
    stage = TrainStage(group.devices, 0, num_units, group.shares, warmup)
    return _plan(
        costs,
        algo="data-parallel",
        schedule=schedule,
        num_microbatches=num_microbatches,
        stages=[stage],
    )


def _plan_even(
    costs: TrainingCosts,
    devices: Sequence[ClusterDevice],
    *,
    num_microbatches: int,
    schedule: str,
) -> TrainingPlan:
    """GPipe's partition over ``devices`` in order; raises if a stage overflows its device."""
    used = list(devices[: costs.num_units])
    ranges = even_ranges(costs.num_units, len(used))
    b = costs.microbatch_size
    stages = []
    for s, (d, (i, j)) in enumerate(zip(used, ranges, strict=True)):
        warmup = stage_warmup(schedule, len(used) - s, num_microbatches)
        need = costs.memory_bytes(i, j, b, warmup)
        if d.memory_bytes is not None and need > d.memory_bytes:
            raise InfeasiblePlanError(
                f"the even plan puts units [{i}, {j}) on stage {s}, device {d.name}, which "
                f"needs {fmt_bytes(need)} (weights, gradients, optimizer state and {warmup} "
                f"micro-batches' activations) but holds {fmt_bytes(d.memory_bytes)}; "
                f"{fmt_bytes(need - d.memory_bytes)} short: use the hpp planner, add memory "
                "or use a smaller micro-batch"
            )
        stages.append(TrainStage((d.name,), i, j, (b,), warmup))
    return _plan(
        costs, algo="even", schedule=schedule, num_microbatches=num_microbatches, stages=stages
    )


def _raise_infeasible(
    costs: TrainingCosts,
    devices: Sequence[ClusterDevice],
    schedule: str,
    num_microbatches: int,
    algo: str,
    *,
    order_fixed: bool = False,
) -> NoReturn:
    """Raise :class:`InfeasiblePlanError` saying how far the memory falls short.

    The least any plan needs: every unit's weights, gradients and optimizer
    state once, plus one micro-batch's activations (GPipe: M of them).
    """
    num_units, b = costs.num_units, costs.microbatch_size
    least_k = num_microbatches if schedule == "gpipe" else 1
    need = costs.memory_bytes(0, num_units, b, least_k)
    saved = least_k * costs.saved_bytes(0, num_units, b)
    held = sum(d.memory_bytes or 0 for d in devices)
    what = (
        f"training needs at least {fmt_bytes(need)} (weights, gradients and {costs.optimizer} "
        f"state: {fmt_bytes(costs.static_bytes(0, num_units))}; activations of "
        f"{least_k} micro-batch(es) of {b}: {fmt_bytes(saved)})"
    )
    limited = all(d.memory_bytes is not None for d in devices)
    if limited and need > held:
        raise InfeasiblePlanError(
            f"{what} but the {len(devices)} devices hold {fmt_bytes(held)} together; "
            f"{fmt_bytes(need - held)} short: add devices or memory, use a smaller micro-batch "
            "or an optimizer with less state"
        )
    largest = max(d.memory_bytes or 0 for d in devices)
    for k in range(num_units):
        unit_need = costs.static_bytes(k, k + 1)
        if limited and unit_need > largest:
            raise InfeasiblePlanError(
                f"unit {k} ({costs.profile.units[k].name}) alone needs {fmt_bytes(unit_need)} "
                f"for its weights, gradients and {costs.optimizer} state, but the largest "
                f"device holds {fmt_bytes(largest)}; {fmt_bytes(unit_need - largest)} short"
            )
    hints = ["another device order"] if order_fixed else []
    hints += ["a smaller micro-batch"] + (["the hpp planner"] if algo != "hpp" else [])
    raise InfeasiblePlanError(
        f"{what} and the {len(devices)} devices hold {fmt_bytes(held)} together, but no "
        f"{algo} plan fits every device's memory (the stages do not pack into the devices' "
        f"sizes); try {', '.join(hints)} or more memory"
    )


# -- the entry points -------------------------------------------------------------------


def _devices(cluster: ClusterSpec, names: Sequence[str] | None) -> list[ClusterDevice]:
    if names is None:
        return list(cluster.devices)
    if not names:
        raise ConfigError("give at least one device to plan over")
    if len(set(names)) != len(names):
        raise ConfigError(f"a device is named twice in {list(names)}")
    return [cluster.device(n) for n in names]


def _check_choices(algo: str, schedule: str, num_microbatches: int) -> None:
    if algo not in TRAINING_ALGOS:
        raise ConfigError(f"unknown training planner {algo!r}; known: {', '.join(TRAINING_ALGOS)}")
    if schedule not in TRAINING_SCHEDULES:
        raise ConfigError(
            f"unknown schedule {schedule!r}; use one of {', '.join(TRAINING_SCHEDULES)}"
        )
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int):
        raise ConfigError(f"num_microbatches must be an integer, got {num_microbatches!r}")
    if num_microbatches < 1:
        raise ConfigError(f"num_microbatches must be >= 1, got {num_microbatches}")


def plan_training(
    profile: ModelProfile,
    cluster: ClusterSpec,
    *,
    microbatch_size: int,
    num_microbatches: int,
    algo: str = "hpp",
    schedule: str = "1f1b",
    optimizer: str = "sgd",
    devices: Sequence[str] | None = None,
    block: int = 1,
) -> TrainingPlan:
    """Plan synchronous pipeline training of ``profile``'s model on ``cluster``.

    ``algo``: ``"hpp"`` (Asteroid's DP; devices are taken in memory order),
    ``"straight"`` (Eco-FL's eq. 1, one device per stage in the given order),
    ``"data-parallel"`` or ``"even"`` (GPipe's partition in the given order).
    ``devices``: the devices to plan over, in order (default: the cluster's).
    ``optimizer`` sets the memory model's optimizer state (``sgd``,
    ``sgd-momentum``, ``adam``, ``adamw``); ``block`` the samples Algorithm 1
    moves at a time. The profile must hold training measurements
    (``python -m zpipe profile --train``). Raises :class:`InfeasiblePlanError`
    when no plan of the kind fits the devices' memory.
    """
    _check_choices(algo, schedule, num_microbatches)
    costs = TrainingCosts(profile, cluster, microbatch_size=microbatch_size, optimizer=optimizer)
    chosen = _devices(cluster, devices)
    m = num_microbatches
    if algo == "hpp":
        return _plan_hpp(costs, chosen, num_microbatches=m, schedule=schedule, block=block)
    if algo == "straight":
        return _plan_straight(costs, chosen, num_microbatches=m, schedule=schedule)
    if algo == "data-parallel":
        return _plan_data_parallel(
            costs, chosen, num_microbatches=m, schedule=schedule, block=block
        )
    return _plan_even(costs, chosen, num_microbatches=m, schedule=schedule)


def _distinct_orders(categories: Sequence[Sequence[str]], length: int) -> Iterator[list[str]]:
    """Every order of ``length`` devices up to swapping interchangeable devices.

    Devices of one category differ only by name, so an order is a sequence of
    categories; each category's members are used in their listed order.
    """
    left = [len(c) for c in categories]
    chosen: list[int] = []

    def extend() -> Iterator[list[str]]:
        if len(chosen) == length:
            used = [0] * len(categories)
            names = []
            for c in chosen:
                names.append(categories[c][used[c]])
                used[c] += 1
            yield names
            return
        for c in range(len(categories)):
            if left[c]:
                left[c] -= 1
                chosen.append(c)
                yield from extend()
                chosen.pop()
                left[c] += 1

    yield from extend()


@dataclass(frozen=True)
class _Candidate:
    costs: TrainingCosts
    split: _StraightSplit
    estimate_s: float


def _best_order(
    costs: TrainingCosts,
    cluster: ClusterSpec,
    orders: Iterator[list[str]],
    *,
    num_microbatches: int,
    schedule: str,
    max_orders: int,
) -> tuple[_Candidate | None, _Candidate | None]:
    """(the best order whose stages hold their P_s, the best order of all) by eq. 4-6."""
    best_free: _Candidate | None = None
    best_any: _Candidate | None = None
    for count, order in enumerate(orders):
        if count >= max_orders:
            raise ConfigError(
                f"more than {max_orders} distinct device orders to try; plan over fewer "
                "devices, or raise max_orders"
            )
        devices = [cluster.device(n) for n in order]
        split = _solve_straight(
            costs, devices, num_microbatches=num_microbatches, schedule=schedule
        )
        if split is None:
            continue
        groups, links = stage_costs(costs, split.stages(costs.microbatch_size))
        found = _Candidate(costs, split, estimate_stages_round_s(groups, links, num_microbatches))
        if best_any is None or found.estimate_s < best_any.estimate_s:
            best_any = found
        if split.ddb_free and (best_free is None or found.estimate_s < best_free.estimate_s):
            best_free = found
    return best_free, best_any


def search_microbatch_and_order(
    profile: ModelProfile,
    cluster: ClusterSpec,
    *,
    num_microbatches: int,
    microbatch_sizes: Sequence[int] | None = None,
    schedule: str = "1f1b",
    optimizer: str = "sgd",
    devices: Sequence[str] | None = None,
    max_orders: int = 5040,
) -> TrainingPlan:
    """Eco-FL's search (ICPP '22, section 4.3): the largest micro-batch, and the device order,
    for which every stage holds the P_s forwards eq. 3 asks for.

    Micro-batch sizes are tried from the largest down (default: the profile's
    measured sizes); at each, every distinct order of the devices
    (interchangeable devices are not told apart) gets Eco-FL's straight
    partition (eq. 1), and the orders whose stages all hold their ``P_s``
    forwards in memory compete on the estimated round (eq. 4-6). The first
    size with such an order wins. If no size has one, the plan with the most
    simulated samples per second among each size's best is returned, with
    ``predicted["ddb_free"] == 0``. Raises :class:`InfeasiblePlanError` when no
    size and order fits at all.
    """
    _check_choices("straight", schedule, num_microbatches)
    chosen = _devices(cluster, devices)
    sizes = sorted(set(microbatch_sizes or profile.batch_sizes), reverse=True)
    if sizes[-1] < 1:
        raise ConfigError(f"micro-batch sizes must be >= 1, got {list(microbatch_sizes or [])}")
    names = {d.name for d in chosen}
    categories = [[n for n in c if n in names] for c in device_categories(cluster)]
    categories = [c for c in categories if c]
    plans: list[TrainingPlan] = []
    for size in sizes:
        costs = TrainingCosts(profile, cluster, microbatch_size=size, optimizer=optimizer)
        orders = _distinct_orders(categories, min(len(chosen), costs.num_units))
        free, anything = _best_order(
            costs,
            cluster,
            orders,
            num_microbatches=num_microbatches,
            schedule=schedule,
            max_orders=max_orders,
        )
        if free is not None:
            return _straight_plan(
                costs, free.split, num_microbatches=num_microbatches, schedule=schedule
            )
        if anything is not None:
            plans.append(
                _straight_plan(
                    costs, anything.split, num_microbatches=num_microbatches, schedule=schedule
                )
            )
    if not plans:
        raise InfeasiblePlanError(
            f"no order of the {len(chosen)} devices fits a straight pipeline's memory at any "
            f"micro-batch size of {sizes}; use the hpp planner, more memory or smaller sizes"
        )
    return max(plans, key=lambda p: p.predicted["samples_per_s"])


__all__ = [
    "MAX_HPP_WORK",
    "estimate_round_s",
    "memory_order",
    "plan_training",
    "search_microbatch_and_order",
    "stage_warmup",
]
