"""The HPP planner's vectorised DP against a frozen copy of its scalar predecessor.

``_ReferenceSolver`` below is the HPP dynamic program as it was before it was
vectorised with numpy (one stage's group and one transition at a time, in
Python). The planner must return the very same plan, shares and objective
(bit for bit) on seeded random mid-size cases: memory that binds, devices
without a memory limit, unlimited and overridden links, both schedules,
Algorithm 1 with ``block`` > 1, and cases with no plan at all.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zpipe.planner.allocation import allocate_microbatch, allocate_microbatches
from zpipe.planner.cluster import ClusterDevice, ClusterLink, ClusterSpec
from zpipe.planner.cost import InfeasiblePlanError
from zpipe.planner.hpp import memory_order, plan_training, stage_warmup
from zpipe.planner.profile import ModelProfile, UnitProfile
from zpipe.planner.training_cost import TrainingCosts

_TIE_RTOL = 1e-9
MB = 1_000_000
SIZES = (1, 2, 4, 8)

# -- the scalar DP, frozen ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Group:
    devices: tuple[str, ...]
    shares: tuple[int, ...]
    step_s: float
    backward_s: float
    allreduce_s: float


@dataclass(frozen=True, slots=True)
class _Stage:
    start: int
    end: int
    group: _Group


@dataclass(slots=True)
class _Point:
    aligned_s: float
    allreduce_s: float
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


def _single_stage(stage: _Stage, num_microbatches: int) -> _Point:
    g = stage.group
    return _Point(num_microbatches * g.step_s, g.allreduce_s, stage, None, len(g.devices), 1)


def _prepend(
    stage: _Stage, transfer: tuple[float, float], rest: _Point, num_microbatches: int
) -> _Point:
    g, m = stage.group, num_microbatches
    link = transfer[0] + transfer[1]
    aligned = max(rest.aligned_s + g.step_s + link, m * g.step_s, m * link + g.step_s)
    allreduce = max(g.allreduce_s, rest.allreduce_s - g.backward_s - transfer[1])
    used = rest.num_devices + len(g.devices)
    return _Point(aligned, allreduce, stage, rest, used, rest.num_stages + 1)


def _pareto(points: list[_Point]) -> list[_Point]:
    points.sort(key=lambda q: (q.aligned_s, q.allreduce_s, q.num_devices))
    front: list[_Point] = []
    for q in points:
        if not front or q.allreduce_s < front[-1].allreduce_s:
            front.append(q)
    return front


def _better(a: _Point | None, b: _Point) -> _Point:
    if a is None:
        return b
    if abs(a.round_s - b.round_s) <= _TIE_RTOL * max(a.round_s, b.round_s):
        return a if (a.num_devices, a.num_stages) <= (b.num_devices, b.num_stages) else b
    return a if a.round_s < b.round_s else b


_Entry = tuple[int, int, list[_Point]]


class _ReferenceSolver:
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
        self._groups: dict[tuple[int, int, int, int, int], _Group | None] = {}
        self._shares: dict[tuple[int, int, int, int, tuple[int, ...]], tuple[int, ...] | None] = {}
        self._links: dict[tuple[int, int, int, int, int], tuple[float, float]] = {}
        self._prefix: dict[tuple[int, int], float] = {}
        rows = [costs.prefix_rows(d) for d in self.devices]
        self._forward = [f for f, _ in rows]
        self._backward = [b for _, b in rows]

    def group(self, start: int, end: int, g: int, h: int, warmup: int) -> _Group | None:
        key = (start, end, g, h, warmup)
        if key not in self._groups:
            self._groups[key] = self._evaluate(start, end, g, h, warmup)
        return self._groups[key]

    def _evaluate(self, start: int, end: int, g: int, h: int, warmup: int) -> _Group | None:
        costs, devices, b = self.costs, self.devices[g:h], self.costs.microbatch_size
        caps = tuple(costs.max_share(d, start, end, warmup) for d in devices)
        if min(caps) < 0 or sum(caps) < b:
            return None
        fwd, bwd = self._forward, self._backward
        if len(devices) == 1:
            forward = fwd[g][b][end] - fwd[g][b][start]
            backward = bwd[g][b][end] - bwd[g][b][start]
            return _Group((devices[0].name,), (b,), forward + backward, backward, 0.0)
        key = (start, end, g, h, caps)
        if key not in self._shares:
            times = [
                [f[end] - f[start] + k[end] - k[start] for f, k in zip(fwd[d], bwd[d], strict=True)]
                for d in range(g, h)
            ]
            self._shares[key] = allocate_microbatch(times, caps, b, block=self.block)
        shares = self._shares[key]
        if shares is None:
            return None
        forward = max(fwd[g + k][y][end] - fwd[g + k][y][start] for k, y in enumerate(shares))
        backward = max(bwd[g + k][y][end] - bwd[g + k][y][start] for k, y in enumerate(shares))
        names = tuple(d.name for d in devices)
        return _Group(
            names, shares, forward + backward, backward, costs.allreduce_s(names, start, end)
        )

    def least_step_s(self, start: int, end: int, g: int, h: int) -> float:
        y = -(-self.costs.microbatch_size // (h - g))
        fwd, bwd = self._forward, self._backward
        return min(
            fwd[d][y][end] - fwd[d][y][start] + (bwd[d][y][end] - bwd[d][y][start])
            for d in range(g, h)
        )

    def least_prefix_s(self, i: int, g: int) -> float:
        if i == 0:
            return 0.0
        key = (g, i)
        if key not in self._prefix:
            y = -(-self.costs.microbatch_size // g)
            fwd, bwd = self._forward, self._backward
            per_unit = [
                min(
                    fwd[d][y][u + 1] - fwd[d][y][u] + (bwd[d][y][u + 1] - bwd[d][y][u])
                    for d in range(g)
                )
                for u in range(self.costs.num_units)
            ]
            for k, total in enumerate(itertools.accumulate(per_unit), start=1):
                self._prefix[g, k] = total
        return self._prefix[key]

    def transfer(self, end: int, g: int, h: int, g2: int, h2: int) -> tuple[float, float]:
        key = (end, g, h, g2, h2)
        if key not in self._links:
            senders = [d.name for d in self.devices[g:h]]
            receivers = [d.name for d in self.devices[g2:h2]]
            self._links[key] = self.costs.transfer_s(senders, receivers, end)
        return self._links[key]

    def solve(self) -> _Point | None:
        num_units, n = self.costs.num_units, len(self.devices)
        starts: dict[int, dict[int, list[_Entry]]] = {}
        best: _Point | None = None
        for p in range(1, min(num_units, n) + 1):
            warmup = stage_warmup(self.schedule, p, self.m)
            starts[p] = {}
            for i in range(num_units - p + 1):
                entries: list[_Entry] = []
                for g in range(0 if i == 0 else 1, n - p + 1):
                    for h in range(g + 1, n - p + 2):
                        bound = math.inf if best is None else best.round_s * (1 + _TIE_RTOL)
                        bound -= self.least_prefix_s(i, g)
                        front = self._state(i, g, h, p, warmup, starts.get(p - 1, {}), bound)
                        if not front:
                            continue
                        entries.append((g, h, front))
                        if i == 0:
                            best = _better(best, min(front, key=lambda q: q.round_s))
                if entries:
                    starts[p][i] = entries
            starts.pop(p - 1, None)
        return best

    def _state(
        self,
        i: int,
        g: int,
        h: int,
        p: int,
        warmup: int,
        rests: dict[int, list[_Entry]],
        bound: float,
    ) -> list[_Point]:
        num_units = self.costs.num_units
        if p == 1:
            group = self.group(i, num_units, g, h, warmup)
            return [] if group is None else [_single_stage(_Stage(i, num_units, group), self.m)]
        candidates: list[_Point] = []
        for j in range(i + 1, num_units - p + 2):
            if self.m * self.least_step_s(i, j, g, h) > bound:
                break
            rest_entries = rests.get(j)
            if not rest_entries or rest_entries[-1][0] < h:
                continue
            group = self.group(i, j, g, h, warmup)
            if group is None:
                break
            if self.m * group.step_s > bound:
                continue
            stage = _Stage(i, j, group)
            for g2, h2, rest in rest_entries:
                if g2 < h:
                    continue
                transfer = self.transfer(j, g, h, g2, h2)
                for r in rest:
                    point = _prepend(stage, transfer, r, self.m)
                    if point.round_s <= bound:
                        candidates.append(point)
        return _pareto(candidates)


# -- seeded random mid-size cases ---------------------------------------------------------


@dataclass(frozen=True)
class Case:
    profile: ModelProfile
    cluster: ClusterSpec
    microbatch_size: int
    num_microbatches: int
    schedule: str
    optimizer: str
    block: int


def random_case(seed: int, num_units: tuple[int, int] = (12, 36)) -> Case:
    rng = random.Random(seed)
    units = []
    for k in range(rng.randint(*num_units)):
        forward = rng.uniform(0.5, 20.0) / 1000
        backward = forward * rng.uniform(1.0, 3.0)
        exponent = rng.choice([0.5, 0.8, 1.0])
        out = rng.randint(0, 4) * MB // 4
        saved = rng.randint(0, 6) * MB // 2
        units.append(
            UnitProfile(
                name=f"u{k}",
                param_bytes=rng.randint(0, 8) * MB // 2,
                time_s=tuple(forward * s**exponent for s in SIZES),
                output_bytes=tuple(out * s for s in SIZES),
                memory_bytes=tuple(0 for _ in SIZES),
                backward_time_s=tuple(backward * s**exponent for s in SIZES),
                activation_bytes=tuple(saved * s for s in SIZES),
            )
        )
    profile = ModelProfile(
        batch_sizes=SIZES, units=tuple(units), input_bytes=tuple(MB * s for s in SIZES)
    )
    total = sum(u.param_bytes + 8 * (u.activation_bytes or (0,))[-1] for u in units)
    scale = rng.choice([1.0, 0.3, 0.12])  # 0.12: memory often binds, sometimes no plan
    devices = []
    for d in range(rng.randint(3, 6)):
        memory = None if rng.random() < 0.2 else int(total * scale * rng.uniform(0.15, 1.2))
        bandwidth = None if rng.random() < 0.15 else rng.choice([50.0, 100.0, 1000.0])
        speed = rng.choice([0.25, 0.5, 1.0, 1.0])
        devices.append(ClusterDevice(f"d{d}", memory, speed, bandwidth))
    names = [d.name for d in devices]
    links = {
        pair: ClusterLink(bandwidth_mbps=rng.choice([20.0, 400.0]))
        for pair in rng.sample([(a, b) for a in names for b in names if a != b], rng.randint(0, 4))
    }
    return Case(
        profile=profile,
        cluster=ClusterSpec(tuple(devices), links=links),
        microbatch_size=rng.choice([2, 3, 5, 8]),
        num_microbatches=rng.randint(1, 6),
        schedule=rng.choice(["1f1b", "1f1b", "gpipe"]),
        optimizer=rng.choice(["sgd", "adam"]),
        block=rng.choice([1, 1, 2]),
    )


@pytest.mark.parametrize(
    ("seed", "num_units"), [*((s, (12, 36)) for s in range(32)), (101, (90, 110)), (103, (90, 110))]
)
def test_hpp_plans_exactly_as_the_scalar_dp(seed: int, num_units: tuple[int, int]) -> None:
    x = random_case(seed, num_units)
    costs = TrainingCosts(
        x.profile, x.cluster, microbatch_size=x.microbatch_size, optimizer=x.optimizer
    )
    ordered = memory_order(x.cluster.devices)
    best = _ReferenceSolver(
        costs, ordered, num_microbatches=x.num_microbatches, schedule=x.schedule, block=x.block
    ).solve()
    kwargs = {
        "microbatch_size": x.microbatch_size,
        "num_microbatches": x.num_microbatches,
        "schedule": x.schedule,
        "optimizer": x.optimizer,
        "block": x.block,
    }
    if best is None:
        with pytest.raises(InfeasiblePlanError):
            plan_training(x.profile, x.cluster, **kwargs)  # type: ignore[arg-type]
        return
    plan = plan_training(x.profile, x.cluster, **kwargs)  # type: ignore[arg-type]
    expected = [(s.group.devices, s.start, s.end, s.group.shares) for s in best.stages()]
    assert [(s.devices, s.start, s.end, s.shares) for s in plan.stages] == expected
    assert plan.predicted["planner_objective_s"] == best.round_s  # bit for bit


# -- Algorithm 1, many groups at once -----------------------------------------------------


@st.composite
def group_batches(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int]:
    """Groups of k devices: times growing with the share (some linear, some not, some
    devices alike or free, to exercise the ties), caps from none to more than B."""
    b, k, rows = draw(st.integers(1, 12)), draw(st.integers(1, 5)), draw(st.integers(1, 6))
    times = np.zeros((rows, k, b + 1))
    caps = np.zeros((rows, k), dtype=np.int64)
    for r in range(rows):
        for d in range(k):
            if d and draw(st.booleans()):
                times[r, d] = times[r, d - 1]  # a device like the one before
            elif draw(st.integers(0, 9)) > 0:
                per, fixed = draw(st.integers(1, 20)), draw(st.integers(0, 30))
                exponent = draw(st.sampled_from([0.5, 0.8, 1.0, 1.3]))
                times[r, d, 1:] = [fixed + per * y**exponent for y in range(1, b + 1)]
            caps[r, d] = draw(st.integers(-1, b + 2))
    return times, caps, b


@settings(max_examples=300, deadline=None, database=None)
@given(group_batches(), st.integers(1, 3))
def test_algorithm_1_in_batches_gives_the_same_shares(
    batch: tuple[np.ndarray, np.ndarray, int], block: int
) -> None:
    times, caps, b = batch
    shares, ok = allocate_microbatches(times, caps, b, block=block)
    for r in range(len(caps)):
        expected = allocate_microbatch(times[r].tolist(), caps[r].tolist(), b, block=block)
        assert (tuple(int(y) for y in shares[r]) if ok[r] else None) == expected


@pytest.mark.parametrize("seed", range(6))
def test_memory_caps_in_batches_are_the_scalar_ones(seed: int) -> None:
    x = random_case(seed)
    costs = TrainingCosts(
        x.profile, x.cluster, microbatch_size=x.microbatch_size, optimizer=x.optimizer
    )
    pairs = [
        (i, j) for i in range(x.profile.num_units) for j in range(i + 1, x.profile.num_units + 1)
    ]
    starts, ends = np.array([i for i, _ in pairs]), np.array([j for _, j in pairs])
    for device in x.cluster.devices:
        for warmup in (1, 3, 6):
            caps = costs.max_shares(device, starts, ends, warmup)
            assert caps.tolist() == [costs.max_share(device, i, j, warmup) for i, j in pairs]
