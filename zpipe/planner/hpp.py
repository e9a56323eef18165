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
from collections.abc import Sequence

import numpy as np

from zpipe._errors import ConfigError
from zpipe.planner.allocation import allocate_microbatches
from zpipe.planner.cluster import ClusterDevice, ClusterSpec
from zpipe.planner.hpp_state import FrontEntry, GroupTable, HppGroup, Level, Point, Stage
from zpipe.planner.profile import ModelProfile
from zpipe.planner.straight import plan_straight, search_microbatch_and_order
from zpipe.planner.training_baselines import plan_data_parallel, plan_even
from zpipe.planner.training_common import (
    build_plan,
    check_choices,
    memory_order,
    raise_infeasible,
    select_devices,
    stage_warmup,
)
from zpipe.planner.training_cost import (
    TrainingCosts,
    estimate_round_s,
)
from zpipe.planner.training_plan import TrainingPlan, TrainStage

# Rounds within this relative distance tie; the plan with fewer devices, then fewer
# stages, wins (prefix sums are not bit-exact).
_TIE_RTOL = 1e-9
# Limit of the HPP DP's work: (stage, next stage) pairs it would examine without pruning.
# Asteroid Table 7's case, 213 units over 6 devices, is 9.6 million (half a second on 2 cores).
MAX_HPP_WORK = 20_000_000


# -- the HPP dynamic program ------------------------------------------------------------


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
        # Refused before anything is built: the link table below alone grows with the
        # fourth power of the devices (minutes for a few dozen).
        _check_hpp_size(costs.num_units, len(devices))
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
        self._tables: dict[tuple[int, int], GroupTable] = {}
        self._finals: dict[tuple[int, int], GroupTable] = {}
        self._prefix: dict[int, list[float]] = {}

    # -- stages -----------------------------------------------------------------------

    def _table(self, g: int, h: int, *, final: bool = False) -> GroupTable:
        tables = self._finals if final else self._tables
        table = tables.get((g, h))
        if table is None:
            table = tables[g, h] = GroupTable(self.costs.num_units, h - g)
            if final:  # one column: the stage that ends at the last unit
                table.widen(1)
        return table

    def _evaluate(
        self,
        table: GroupTable,
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

    def _group(self, table: GroupTable, start: int, column: int, g: int, h: int) -> HppGroup:
        return HppGroup(
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

    def solve(self) -> Point | None:
        """The least-round plan over every split, grouping and number of stages."""
        num_units, n = self.costs.num_units, len(self.devices)
        best: Point | None = None
        level: Level | None = None  # the states of p - 1 stages
        warmup = 0
        for p in range(1, min(num_units, n) + 1):
            if stage_warmup(self.schedule, p, self.m) != warmup:
                warmup = stage_warmup(self.schedule, p, self.m)
                self._tables, self._finals = {}, {}  # stages are evaluated at one warm-up
            states: dict[int, list[FrontEntry]] = {}
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
                entries: list[FrontEntry] = []
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
        level: Level | None,
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
        self, p: int, i: int, g: int, h: int, bound: float, level: Level | None, stop: int
    ) -> list[Point]:
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
            stage = Stage(i, self.costs.num_units, group)
            return [Point(m * group.step_s, group.allreduce_s, stage, None, h - g, 1)]
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
        front: list[Point] = []
        stages: dict[int, Stage] = {}
        for k in order[on_front].tolist():
            j = int(units[k])
            if j not in stages:
                stages[j] = Stage(i, j, self._group(table, i, j - low, g, h))
            stage = stages[j]
            rest = level.points[int(at[k])]
            front.append(
                Point(
                    float(aligned[k]),
                    float(allreduce[k]),
                    stage,
                    rest,
                    int(used[k]),
                    rest.num_stages + 1,
                )
            )
        return front

    def _level(self, states: dict[int, list[FrontEntry]]) -> Level:
        num_units = self.costs.num_units
        counts = np.zeros(num_units + 1, dtype=np.int64)
        last_group = np.full(num_units + 1, -1, dtype=np.int64)
        unit: list[int] = []
        first: list[int] = []
        pair: list[int] = []
        points: list[Point] = []
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
        return Level(
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


def _better(a: Point | None, b: Point) -> Point:
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
        raise_infeasible(costs, ordered, schedule, num_microbatches, "hpp")
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
    return build_plan(
        costs,
        algo="hpp",
        schedule=schedule,
        num_microbatches=num_microbatches,
        stages=stages,
        extra={"planner_objective_s": best.round_s},
    )


# -- the entry point -------------------------------------------------------------------


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
    check_choices(algo, schedule, num_microbatches)
    costs = TrainingCosts(profile, cluster, microbatch_size=microbatch_size, optimizer=optimizer)
    chosen = select_devices(cluster, devices)
    m = num_microbatches
    if algo == "hpp":
        return _plan_hpp(costs, chosen, num_microbatches=m, schedule=schedule, block=block)
    if algo == "straight":
        return plan_straight(costs, chosen, num_microbatches=m, schedule=schedule)
    if algo == "data-parallel":
        return plan_data_parallel(costs, chosen, num_microbatches=m, schedule=schedule, block=block)
    return plan_even(costs, chosen, num_microbatches=m, schedule=schedule)


__all__ = [
    "MAX_HPP_WORK",
    "estimate_round_s",
    "memory_order",
    "plan_training",
    "search_microbatch_and_order",
    "stage_warmup",
]
