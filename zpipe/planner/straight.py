"""Eco-FL's straight pipeline (ICPP '22, section 4.2, eq. 1; PipeDream's and FTPipeHD's
eq. 5 are the same DP): one device per stage in a given order, and Eco-FL's search over
micro-batch sizes and device orders (section 4.3)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise

from zpipe._errors import ConfigError, InfeasiblePlanError
from zpipe.planner.cluster import ClusterDevice, ClusterSpec
from zpipe.planner.pipeedge import device_categories
from zpipe.planner.profile import ModelProfile
from zpipe.planner.schedules import ecofl_warmup
from zpipe.planner.training_common import (
    build_plan,
    check_choices,
    in_flight_capacity,
    raise_infeasible,
    select_devices,
)
from zpipe.planner.training_cost import (
    TrainingCosts,
    estimate_stages_round_s,
    stage_costs,
)
from zpipe.planner.training_plan import TrainingPlan, TrainStage


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
        held = in_flight_capacity(costs, d, i, j)
        cap = runs[-1] if runs else num_microbatches
        runs.append(max(1, min(wanted[s], held, cap)))
    return wanted, runs


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
    return build_plan(
        costs,
        algo="straight",
        schedule=schedule,
        num_microbatches=num_microbatches,
        stages=split.stages(costs.microbatch_size),
        extra={"planner_objective_s": split.objective_s, "ddb_free": float(split.ddb_free)},
    )


def plan_straight(
    costs: TrainingCosts,
    devices: Sequence[ClusterDevice],
    *,
    num_microbatches: int,
    schedule: str,
) -> TrainingPlan:
    split = _solve_straight(costs, devices, num_microbatches=num_microbatches, schedule=schedule)
    if split is None:
        used = devices[: costs.num_units]
        raise_infeasible(costs, used, schedule, num_microbatches, "straight", order_fixed=True)
    return _straight_plan(costs, split, num_microbatches=num_microbatches, schedule=schedule)


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
    check_choices("straight", schedule, num_microbatches)
    chosen = select_devices(cluster, devices)
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
