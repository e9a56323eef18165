"""Baseline planners behind PipeEdge's interface, and the registry of all planners.

Every planner is ``planner(profile, cluster, *, batch_size) -> Plan`` and puts
:func:`~zpipe.planner.cost.predict_plan`'s numbers in ``Plan.predicted``, so
plans from different planners compare on the same cost model.

- :func:`plan_even`: GPipe's partition, the same number of units on every
  device, the devices in the cluster's order.
- :func:`plan_pipedream`: PipeDream's partition for a straight pipeline.

What :func:`plan_pipedream` takes from PipeDream (Narayanan et al., SOSP'19,
section 3.1, and its ``optimizer_graph_hierarchical.py``): workers are assumed
identical, so a stage's time is the profile's own time for its units (device
speeds are not looked at); a stage also pays for sending its output over one
bandwidth shared by every pair of workers (PipeDream's one-level topology,
as PipeEdge applies it to the edge; we take the median bandwidth over all
ordered device pairs); the DP ``A(k, m) = min_j max(A(j, m-1), C_j, T(j..k))``
over contiguous splits minimises the slowest stage; and the devices are used
in the order they are listed, one stage each, as many stages as devices.

What we left out or changed: replication of stages (data parallelism inside a
stage) and the hierarchical levels, because inference pipelines here run one
device per stage; the backward pass and weight-synchronisation terms, because
this is forward-only; and memory: PipeDream checks one memory size for all
workers, we check each stage against the device it lands on (which can only
help PipeDream). When there are more devices than units, both baselines use
the first ``num_units`` devices.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping

import numpy as np

from zpipe._errors import ConfigError
from zpipe.planner.bucketing import parse_bucketing
from zpipe.planner.cluster import ClusterSpec
from zpipe.planner.cost import (
    InfeasiblePlanError,
    check_memory_totals,
    check_plan_memory,
    predict_plan,
)
from zpipe.planner.memory import profile_need_matrix
from zpipe.planner.pipeedge import plan_pipeedge
from zpipe.planner.plan import Plan, StagePlan, even_ranges
from zpipe.planner.profile import ModelProfile

Planner = Callable[..., Plan]


def _with_predictions(
    plan: Plan,
    profile: ModelProfile,
    cluster: ClusterSpec,
    batch_size: int,
    extra: Mapping[str, float] | None = None,
) -> Plan:
    predicted = predict_plan(plan, profile, cluster, batch_size)
    predicted.update(extra or {})
    return Plan(algo=plan.algo, num_units=plan.num_units, stages=plan.stages, predicted=predicted)


def plan_even(profile: ModelProfile, cluster: ClusterSpec, *, batch_size: int) -> Plan:
    """GPipe's even partition over the cluster's devices in order (raises if it overflows)."""
    num_units = profile.num_units
    names = cluster.names[:num_units]
    ranges = even_ranges(num_units, len(names))
    plan = Plan(
        algo="even",
        num_units=num_units,
        stages=tuple(StagePlan(d, a, b) for d, (a, b) in zip(names, ranges, strict=True)),
    )
    check_memory_totals(
        profile_need_matrix(profile, batch_size), cluster.devices[:num_units], profile
    )
    check_plan_memory(plan, profile, cluster, batch_size)
    return _with_predictions(plan, profile, cluster, batch_size)


def plan_pipedream(profile: ModelProfile, cluster: ClusterSpec, *, batch_size: int) -> Plan:
    """PipeDream's homogeneous partition over the cluster's devices in order."""
    num_units = profile.num_units
    names = cluster.names[:num_units]
    stages = len(names)
    need = profile_need_matrix(profile, batch_size)
    check_memory_totals(need, cluster.devices[:num_units], profile)
    times = profile.times(batch_size)
    out = profile.output_bytes(batch_size)
    bandwidth = statistics.median(
        [cluster.bandwidth_bps(u, v) for u in names for v in names if u != v] or [np.inf]
    )
    prefix = np.concatenate(([0.0], np.cumsum(times)))
    # comm[j]: sending unit j-1's output at the shared bandwidth; no hop after the last unit.
    comm = np.zeros(num_units + 1)
    comm[1:num_units] = np.asarray(out[:-1], dtype=np.float64) * 8.0 / bandwidth

    caps = [cluster.device(n).memory_bytes for n in names]
    first = _split_dp(prefix, need, caps, comm, num_units, None)
    if first is None:
        raise InfeasiblePlanError(
            f"PipeDream's partition over the {stages} devices in this order cannot fit every "
            "stage into its device's memory; use the pipeedge planner, which also picks the "
            "devices and their order, or add memory"
        )
    objective, bounds = first
    # When a slow shared link dominates every stage, many splits tie on the objective and
    # the first one found can be badly unbalanced; among the tied splits take the one with
    # the least compute on its slowest stage (PipeDream's aim) so the baseline is not
    # handicapped by an arbitrary choice.
    second = _split_dp(prefix, need, caps, comm, num_units, objective * (1 + 1e-9))
    if second is not None:
        bounds = second[1]
    plan = Plan(
        algo="pipedream",
        num_units=num_units,
        stages=tuple(StagePlan(names[m], bounds[m], bounds[m + 1]) for m in range(stages)),
    )
    return _with_predictions(plan, profile, cluster, batch_size, {"planner_objective_s": objective})


def _split_dp(
    prefix: np.ndarray,
    need: np.ndarray,
    caps: list[int | None],
    comm: np.ndarray,
    num_units: int,
    limit: float | None,
) -> tuple[float, list[int]] | None:
    """Split ``[0, num_units)`` into ``len(caps)`` contiguous stages, stage m within ``caps[m]``.

    Without ``limit``: minimise the slowest stage's ``max(compute, comm of its input)``
    (PipeDream's ``A(k, m)``). With ``limit``: minimise the slowest stage's compute among
    splits whose every stage stays within ``limit``. ``None`` when no split qualifies.
    """
    stages = len(caps)
    # a[m, k]: the least objective for units [0, k) on the first m devices.
    a = np.full((stages + 1, num_units + 1), np.inf)
    parent = np.full((stages + 1, num_units + 1), -1, dtype=np.int64)
    a[0, 0] = 0.0
    for m in range(1, stages + 1):
        cap = caps[m - 1]
        for k in range(m, num_units - (stages - m) + 1):
            j = np.arange(m - 1, k)  # the previous stage ends at j; this one runs [j, k)
            compute = prefix[k] - prefix[j]
            if limit is None:
                cost = np.maximum(np.maximum(a[m - 1, j], comm[j]), compute)
            else:
                cost = np.maximum(a[m - 1, j], compute)
                cost = np.where((comm[j] <= limit) & (compute <= limit), cost, np.inf)
            if cap is not None:
                cost = np.where(need[j, k] <= cap, cost, np.inf)
            best = int(np.argmin(cost))
            a[m, k] = cost[best]
            parent[m, k] = j[best]
    if not np.isfinite(a[stages, num_units]):
        return None
    bounds = [num_units]
    for m in range(stages, 0, -1):
        bounds.append(int(parent[m, bounds[-1]]))
    bounds.reverse()
    return float(a[stages, num_units]), bounds


PLANNERS: dict[str, Planner] = {
    "pipeedge": plan_pipeedge,
    "even": plan_even,
    "pipedream": plan_pipedream,
}


def plan_with(
    algo: str,
    profile: ModelProfile,
    cluster: ClusterSpec,
    batch_size: int,
    *,
    bucketing: object = "auto",
) -> Plan:
    """Run the planner called ``algo`` (see :data:`PLANNERS`). ``bucketing``
    (:mod:`zpipe.planner.bucketing`) applies to ``pipeedge``, the one planner whose
    cost grows with the number of distinct devices; it is checked for every planner."""
    parse_bucketing(bucketing)
    try:
        planner = PLANNERS[algo]
    except KeyError:
        raise ConfigError(
            f"unknown planner {algo!r}; known: {', '.join(sorted(PLANNERS))}"
        ) from None
    if algo == "pipeedge":
        return plan_pipeedge(profile, cluster, batch_size=batch_size, bucketing=bucketing)
    return planner(profile, cluster, batch_size=batch_size)
