"""PipeEdge's partition planner: which devices, in which order, run which units.

PipeEdge (Hu et al., section III-B, Algorithm 1, eq. 1-3) minimises the
slowest stage's ``max(compute, communication)`` over every choice of a device
subset, its order and a contiguous split of the units, with each device's
memory as a hard limit. This is its "category dynamic programming": devices
that are interchangeable form one category, and a DP state counts how many
devices of each category are used, not which ones.

Categories. Two devices are interchangeable when swapping them maps the
cluster onto itself: the same compute (speed, or an equal own profile) and
memory, the same link (both directions) to every third device and to the
client, and a symmetric link between the two. Swaps that preserve the cluster
compose, so the relation is an equivalence and every permutation inside a
category leaves every plan's cost unchanged. That is what makes the category
DP exact: members of one category are told apart only by name, and the links
between categories (and within one) are well defined.

State (as in PipeEdge's code): ``g(j, S, u)`` is the least possible
bottleneck of running units ``[0, j)`` with device counts ``S`` (one count per
category, a mixed-radix index, ``prod(n_c + 1)`` values) where the last stage
runs on a category-``u`` device whose outgoing transfer is not yet paid.
Transition to a next stage on category ``v`` covering ``[j, k)``:

    g(k, S + v, v) = min over (j, u) of max(g(j, S, u), T_comm(u -> v, P_j), T_comp(j..k, v))

The hop's cost does not depend on ``k`` and the stage's compute does not
depend on ``u``, so the min over ``u`` is taken first. A state using ``t``
devices follows only from states using ``t - 1``, so the DP runs one layer of
count vectors at a time, in numpy, expanding only the vectors that can still
win (:mod:`zpipe.planner.category_dp`: dominated partial plans and ones that
cannot beat a greedy plan are dropped). The memory check is Algorithm 1's
break, as a mask: ``k`` stops at the last unit that still fits category
``v``'s memory. The client's send of the input is the first hop; the last
stage's send of the result to the client closes the pipeline.

Measured values: a coordinator's measured speeds and links make every device a
category of its own; ``bucketing`` (:mod:`zpipe.planner.bucketing`) snaps them
to buckets so that the categories stay few, and certifies how far the plan can
be from the exact optimum.

Ties: among plans with the least bottleneck the one with fewest devices wins,
then the first found in a deterministic order (categories in cluster order,
each category's devices in cluster order).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import NoReturn

import numpy as np

from zpipe._errors import ConfigError
from zpipe.planner.bucketing import (
    DEFAULT_TOLERANCE,
    MAX_TOLERANCE,
    bucket_cluster,
    certify,
    parse_bucketing,
)
from zpipe.planner.category_dp import CategoryTables, DPTooLargeError, solve_categories
from zpipe.planner.cluster import CLIENT, ClusterDevice, ClusterSpec
from zpipe.planner.cost import (
    InfeasiblePlanError,
    check_memory_totals,
    device_unit_times,
    fmt_bytes,
    predict_plan,
)
from zpipe.planner.memory import profile_need_matrix
from zpipe.planner.plan import Plan, StagePlan
from zpipe.planner.profile import ModelProfile

# Limit of one solve: element operations of the DP's (S, i, k) arrays, about 2 ns each
# on one core, so a few seconds. The sparse DP stores only live count vectors.
MAX_DP_WORK = 1_500_000_000
# A lattice this many times the limit is refused before the DP starts: even pruning
# away most of it, the solve would pass the limit, after seconds of work.
HOPELESS_FACTOR = 8
# "auto" plans exactly while the full lattice of count vectors is at most this large
# (12 distinct devices, or 4 categories of 7): the DP then takes well under a second.
AUTO_EXACT_STATES = 1 << 12


def _compute_key(device: ClusterDevice) -> tuple[str, object]:
    """What decides a device's unit times: its own profile, else its speed."""
    if device.profile is not None:
        return ("profile", device.profile)
    return ("speed", device.speed)


def _interchangeable(cluster: ClusterSpec, x: str, y: str) -> bool:
    """Whether ``x`` and ``y`` differ only in name: memory, compute, and every link to and
    from every third device and the client."""
    dx, dy = cluster.device(x), cluster.device(y)
    if dx.memory_bytes != dy.memory_bytes or _compute_key(dx) != _compute_key(dy):
        return False

    def link(u: str, v: str) -> tuple[float, float]:
        return cluster.bandwidth_bps(u, v), cluster.latency_s(u, v)

    if link(x, y) != link(y, x):
        return False
    return all(
        link(x, w) == link(y, w) and link(w, x) == link(w, y)
        for w in (*cluster.names, CLIENT)
        if w != x and w != y
    )


def device_categories(cluster: ClusterSpec) -> list[list[str]]:
    """Group the cluster's devices into interchangeable categories, in cluster order.

    Devices that differ only in name share a category; a device whose link to
    some third device (or the client) differs from another's does not.

    Linear in the number of devices when they come in a few kinds: devices that
    declare the same memory, compute and access link and that no link entry
    names are interchangeable by construction (every link of theirs follows the
    default rule from the same access link), so they are bucketed by those
    fields at once; only one device of each bucket is then compared, link by
    link, with one of each category found so far (devices that declare
    different access links can still be interchangeable, when every other
    link caps theirs). Swapping two devices of a bucket changes nothing in the
    cluster, so the result is what comparing every device would give.
    """
    named = {end for pair in cluster.links for end in pair}
    buckets: dict[object, list[str]] = {}
    for device in cluster.devices:
        key: object = device.name  # named by a link entry: a bucket of its own
        if device.name not in named:
            compute = _compute_key(device)
            # a profile is compared by value below; here its identity is enough
            compute_id = (compute[0], id(compute[1]) if device.profile is not None else compute[1])
            key = (device.memory_bytes, compute_id, device.bandwidth_mbps, device.latency_ms)
        buckets.setdefault(key, []).append(device.name)
    # Comparing with one representative is enough: the relation is transitive.
    categories: list[list[list[str]]] = []
    for bucket in buckets.values():  # in order of each bucket's first device
        for found in categories:
            if _interchangeable(cluster, found[0][0], bucket[0]):
                found.append(bucket)
                break
        else:
            categories.append([bucket])
    order = {name: i for i, name in enumerate(cluster.names)}
    return [sorted((n for b in found for n in b), key=order.__getitem__) for found in categories]


def plan_pipeedge(
    profile: ModelProfile, cluster: ClusterSpec, *, batch_size: int, bucketing: object = "auto"
) -> Plan:
    """PipeEdge's optimal plan: least bottleneck, then fewest devices.

    ``bucketing``: ``"auto"`` (the default), ``"exact"`` or a tolerance; see
    :func:`solve_pipeedge`. Raises :class:`InfeasiblePlanError` when no choice of
    devices, order and split fits every device's memory.
    """
    plan, _ = solve_pipeedge(profile, cluster, batch_size=batch_size, bucketing=bucketing)
    return plan


def solve_pipeedge(
    profile: ModelProfile, cluster: ClusterSpec, *, batch_size: int, bucketing: object = "auto"
) -> tuple[Plan, float]:
    """:func:`plan_pipeedge` and the plan's bottleneck in seconds (the DP's optimum when exact).

    ``bucketing`` (:mod:`zpipe.planner.bucketing`): ``"exact"`` plans on the
    values as given, and refuses a cluster whose categories are too many;
    a tolerance (``0.05``) plans on speeds and bandwidths snapped to buckets
    of that width, and the plan's ``predicted`` carries the certified bound
    (``bucketing_certified_ratio``: its real bottleneck over a proven lower
    bound of the exact optimum, at most ``1 + tolerance``); ``"auto"`` is
    exact while the count vectors are at most :data:`AUTO_EXACT_STATES` (so
    every cluster that PipeEdge's DP plans quickly gets the exact plan), else
    bucketed at :data:`DEFAULT_TOLERANCE`, widened (doubling, up to
    :data:`MAX_TOLERANCE`) only while the DP would still be too large.
    """
    mode = parse_bucketing(bucketing)
    check_memory_totals(profile_need_matrix(profile, batch_size), cluster.devices, profile)
    if mode == "exact":
        return _solve_exact(profile, cluster, batch_size)
    if mode == "auto":
        categories = device_categories(cluster)
        if _lattice_size([len(c) for c in categories]) <= AUTO_EXACT_STATES:
            return _solve_exact(profile, cluster, batch_size, categories)
        tolerances = _widening(DEFAULT_TOLERANCE)
    else:
        assert isinstance(mode, float)
        tolerances = [mode]
    tried = math.inf
    for k, tolerance in enumerate(tolerances):
        last = k + 1 == len(tolerances)
        bucketed = bucket_cluster(cluster, tolerance, batch_size=batch_size)
        categories = device_categories(bucketed.cluster)
        if len(categories) >= tried and not last:
            continue  # a wider bucket merged nothing: the DP would fail as before
        tried = len(categories)
        try:
            plan, optimum = _solve_categories(profile, bucketed.cluster, batch_size, categories)
        except DPTooLargeError as exc:
            if not last:
                continue
            raise ConfigError(
                f"{exc}: even with speeds and bandwidths bucketed to {tolerance:.0%} the "
                f"cluster's {len(cluster.devices)} devices form too many categories; give "
                "devices that are alike the same memory, or plan over fewer devices"
            ) from None
        predicted = predict_plan(plan, profile, cluster, batch_size)
        certificate = certify(
            bucketed,
            optimum,
            predicted["bottleneck_s"],
            _optimistic_optimum(profile, cluster, batch_size, tolerance, categories),
        )
        predicted.update(plan.predicted)
        predicted.update(certificate.as_prediction())
        predicted["planner_objective_s"] = optimum
        return replace(plan, predicted=predicted), predicted["bottleneck_s"]
    raise AssertionError("unreachable: at least one tolerance is tried")


def _optimistic_optimum(
    profile: ModelProfile,
    cluster: ClusterSpec,
    batch_size: int,
    tolerance: float,
    categories: list[list[str]],
) -> float:
    """The optimum with every bucket at its fastest value: a lower bound of the exact
    optimum (0 when that DP is too large; the a-priori bound still holds)."""
    optimistic = bucket_cluster(cluster, tolerance, batch_size=batch_size, optimistic=True)
    try:
        return _solve_categories(profile, optimistic.cluster, batch_size, categories)[1]
    except DPTooLargeError:
        return 0.0


def _widening(start: float) -> list[float]:
    """``start``, then doubled until :data:`MAX_TOLERANCE`."""
    out = [start]
    while out[-1] < MAX_TOLERANCE:
        out.append(min(MAX_TOLERANCE, out[-1] * 2))
    return out


def _lattice_size(counts: Sequence[int]) -> int:
    return math.prod(n + 1 for n in counts)


def _solve_exact(
    profile: ModelProfile,
    cluster: ClusterSpec,
    batch_size: int,
    categories: list[list[str]] | None = None,
) -> tuple[Plan, float]:
    try:
        plan, optimum = _solve_categories(profile, cluster, batch_size, categories)
    except DPTooLargeError as exc:
        n_cat = len(device_categories(cluster)) if categories is None else len(categories)
        raise ConfigError(
            f"the cluster's {len(cluster.devices)} devices form {n_cat} categories of "
            f"interchangeable devices, too many to plan {profile.num_units} units exactly "
            f"in reasonable time and memory ({exc}); give devices that are alike the same "
            "speed, memory and links so that they share a category, plan over fewer "
            "devices, or bucket measured values (bucketing='auto' or a tolerance)"
        ) from None
    predicted = predict_plan(plan, profile, cluster, batch_size)
    predicted.update(plan.predicted)
    return replace(plan, predicted=predicted), optimum


def _solve_categories(
    profile: ModelProfile,
    cluster: ClusterSpec,
    batch_size: int,
    categories: list[list[str]] | None = None,
) -> tuple[Plan, float]:
    """The category DP on ``cluster`` as given: the plan (its ``predicted`` holds only the
    DP's own figures) and the optimal bottleneck."""
    num_units = profile.num_units
    need = profile_need_matrix(profile, batch_size)
    out_bytes = profile.output_bytes(batch_size)
    in_bytes = profile.input_bytes_at(batch_size)
    if categories is None:
        categories = device_categories(cluster)
    reps = [cluster.device(members[0]) for members in categories]
    counts = [len(members) for members in categories]
    n_cat = len(categories)
    dense_work = _lattice_size(counts) * n_cat * num_units * (num_units + 1)
    if dense_work > HOPELESS_FACTOR * MAX_DP_WORK:
        raise DPTooLargeError(
            f"{_lattice_size(counts)} device-count combinations, far past the DP's limit"
        )

    # Per-category tables over unit boundaries 0..L.
    comp_prefix = np.zeros((n_cat, num_units + 1))
    for c, rep in enumerate(reps):
        comp_prefix[c, 1:] = np.cumsum(device_unit_times(profile, rep, batch_size))
    # jmax[c, i]: the last boundary k with units [i, k) fitting category c (Algorithm 1's
    # break): a stage's need never shrinks as it takes more units (zpipe.planner.memory)
    jmax = np.empty((n_cat, num_units), dtype=np.int64)
    above = np.arange(num_units + 1)[None, :] > np.arange(num_units)[:, None]
    for c, rep in enumerate(reps):
        if rep.memory_bytes is None:
            jmax[c] = num_units
        else:
            fits = above & (need <= rep.memory_bytes)
            jmax[c] = np.arange(num_units) + fits.sum(axis=1)

    # Links between categories; within one, between two of its members.
    bw = np.empty((n_cat, n_cat))
    for a in range(n_cat):
        for b in range(n_cat):
            sender = categories[a][0]
            receiver = categories[b][1] if a == b and counts[b] > 1 else categories[b][0]
            if sender == receiver:  # a single-device category never follows itself
                bw[a, b] = math.inf
                continue
            bw[a, b] = cluster.bandwidth_bps(sender, receiver)
    bits = np.asarray(out_bytes, dtype=np.float64) * 8.0
    # hop[i, u, v]: sending unit i-1's output from u to v (x / inf is 0).
    # Latency overlaps with other micro-batches in flight: it is no part of a period.
    hop = np.concatenate(([0.0], bits[:-1]))[:, None, None] / bw[None, :, :]
    source = np.array([cluster.comm_time_s(CLIENT, r.name, in_bytes) for r in reps])
    sink = np.array([cluster.comm_time_s(r.name, CLIENT, out_bytes[-1]) for r in reps])

    # comp[c][i, k]: compute time of units [i, k) on category c; inf where the range is
    # empty or no longer fits c's memory (Algorithm 1's break, as a mask).
    k_idx = np.arange(num_units + 1)[None, :]
    i_idx = np.arange(num_units)[:, None]
    comp = np.empty((n_cat, num_units, num_units + 1))
    for c in range(n_cat):
        spans = comp_prefix[c][None, :] - comp_prefix[c, :num_units, None]
        fits = (k_idx > i_idx) & (k_idx <= jmax[c][:, None])
        comp[c] = np.where(fits, spans, np.inf)

    solution = solve_categories(
        CategoryTables(
            counts=counts,
            comp=comp,
            hop=hop,
            source=source,
            sink=sink,
            unit_times=np.diff(comp_prefix, axis=1),
        ),
        max_devices=len(cluster.devices),
        max_work=MAX_DP_WORK,
    )
    if solution is None:
        _raise_fragmented(need, cluster.devices)
    assert solution is not None
    next_member = [0] * n_cat
    stages = []
    for c, start, end in solution.stages:
        stages.append(StagePlan(categories[c][next_member[c]], start, end))
        next_member[c] += 1
    predicted = {
        "planner_objective_s": solution.bottleneck_s,
        "num_categories": float(n_cat),
        "dp_live_states": float(solution.live_states),
    }
    plan = Plan(algo="pipeedge", num_units=num_units, stages=tuple(stages), predicted=predicted)
    return plan, solution.bottleneck_s


def _raise_fragmented(need: np.ndarray, devices: Sequence[ClusterDevice]) -> NoReturn:
    held = sum(d.memory_bytes or 0 for d in devices)
    raise InfeasiblePlanError(
        f"the model needs {fmt_bytes(float(need[0, -1]))} on one device and the "
        f"{len(devices)} devices together "
        f"hold {fmt_bytes(held)}, but no split into contiguous unit ranges fits every device's "
        "memory (the units do not pack into the devices' sizes); add a device or memory, or "
        "profile the model with finer units"
    )
