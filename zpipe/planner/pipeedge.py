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
depend on ``u``, so the min over ``u`` is taken first; that turns the paper's
``L^2 * prod(n_c + 1) * N^2`` into ``L * (N^2 + N * L)`` per count vector.
Order of evaluation: a state using ``t`` devices follows only from states
using ``t - 1``, so the DP runs one layer of count vectors at a time and
handles every ``(S, j, k)`` of a layer and category in a few numpy calls
(``O(D * N)`` calls in all, in chunks that keep temporaries to a few MB)
instead of a Python loop over ``j``. The memory check is Algorithm 1's break,
as a mask: ``k`` stops at the last unit that still fits category ``v``'s
memory (a binary search over prefix sums). The client's send of the input is
the first hop; the last stage's send of the result to the client closes the
pipeline.

Ties: among plans with the least bottleneck the one with fewest devices wins,
then the first found in a deterministic order (categories in cluster order,
each category's devices in cluster order).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from zpipe._errors import ConfigError
from zpipe.planner.cluster import CLIENT, ClusterDevice, ClusterSpec
from zpipe.planner.cost import (
    InfeasiblePlanError,
    check_memory_totals,
    device_unit_times,
    fmt_bytes,
    predict_plan,
)
from zpipe.planner.plan import Plan, StagePlan
from zpipe.planner.profile import ModelProfile

# Limits of an exact solve. Cells: g and its two parent arrays take 8 + 4 + 2 bytes
# each. Work: element operations of the (S, i, k) arrays, about 2 ns each on one core,
# so the limit is several seconds.
MAX_DP_CELLS = 20_000_000
MAX_DP_WORK = 2_500_000_000
_CHUNK_ELEMENTS = 1 << 20

# Bottlenecks within this relative distance count as equal when choosing the
# plan with fewer devices: prefix-sum differences are not bit-exact.
_TIE_RTOL = 1e-9


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


def plan_pipeedge(profile: ModelProfile, cluster: ClusterSpec, *, batch_size: int) -> Plan:
    """PipeEdge's optimal plan: least bottleneck, then fewest devices.

    Raises :class:`InfeasiblePlanError` when no choice of devices, order and
    split fits every device's memory.
    """
    plan, _ = solve_pipeedge(profile, cluster, batch_size=batch_size)
    return plan


def solve_pipeedge(
    profile: ModelProfile, cluster: ClusterSpec, *, batch_size: int
) -> tuple[Plan, float]:
    """:func:`plan_pipeedge` and the DP's optimal bottleneck in seconds."""
    num_units = profile.num_units
    memory = profile.memory_bytes(batch_size)
    out_bytes = profile.output_bytes(batch_size)
    in_bytes = profile.input_bytes_at(batch_size)
    check_memory_totals(memory, cluster.devices, profile)

    categories = device_categories(cluster)
    reps = [cluster.device(members[0]) for members in categories]
    counts = [len(members) for members in categories]
    n_cat = len(categories)
    strides = [1] * n_cat
    for c in range(1, n_cat):
        strides[c] = strides[c - 1] * (counts[c - 1] + 1)
    n_states = strides[-1] * (counts[-1] + 1)
    cells = n_cat * n_states * (num_units + 1)
    work = n_cat * n_states * num_units * (num_units + 1)
    if cells > MAX_DP_CELLS or work > MAX_DP_WORK:
        raise ConfigError(
            f"the cluster's {len(cluster.devices)} devices form {n_cat} categories of "
            f"interchangeable devices ({n_states} device-count combinations), too many to plan "
            f"{num_units} units exactly in reasonable time and memory; give devices that are "
            "alike the same speed, memory and links so that they share a category, or plan "
            "over fewer devices"
        )

    # Per-category tables over unit boundaries 0..L.
    comp_prefix = np.zeros((n_cat, num_units + 1))
    for c, rep in enumerate(reps):
        comp_prefix[c, 1:] = np.cumsum(device_unit_times(profile, rep, batch_size))
    mem_prefix = np.zeros(num_units + 1, dtype=np.int64)
    mem_prefix[1:] = np.cumsum(np.asarray(memory, dtype=np.int64))
    # jmax[c, i]: the last boundary k with units [i, k) fitting category c (Algorithm 1's break).
    jmax = np.empty((n_cat, num_units), dtype=np.int64)
    for c, rep in enumerate(reps):
        if rep.memory_bytes is None:
            jmax[c] = num_units
        else:
            limit = mem_prefix[:-1] + rep.memory_bytes
            jmax[c] = np.searchsorted(mem_prefix, limit, side="right") - 1

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

    digits = np.arange(n_states)
    used = np.stack([(digits // strides[c]) % (counts[c] + 1) for c in range(n_cat)])
    total_used = used.sum(axis=0)

    # comp[c][i, k]: compute time of units [i, k) on category c; inf where the range is
    # empty or no longer fits c's memory (Algorithm 1's break, as a mask).
    k_idx = np.arange(num_units + 1)[None, :]
    i_idx = np.arange(num_units)[:, None]
    comp = np.empty((n_cat, num_units, num_units + 1))
    for c in range(n_cat):
        spans = comp_prefix[c][None, :] - comp_prefix[c, :num_units, None]
        fits = (k_idx > i_idx) & (k_idx <= jmax[c][:, None])
        comp[c] = np.where(fits, spans, np.inf)

    g = np.full((n_cat, n_states, num_units + 1), np.inf)
    par_i = np.full((n_cat, n_states, num_units + 1), -1, dtype=np.int32)
    par_u = np.full((n_cat, n_states, num_units + 1), -2, dtype=np.int16)
    # Count vectors per numpy call, so that no temporary array outgrows a few MB.
    chunk = max(1, _CHUNK_ELEMENTS // (num_units * max(num_units + 1, n_cat * n_cat)))

    # A state with t devices follows only from states with t - 1, so one layer of count
    # vectors at a time handles every (S, i, k) of that layer in a few array operations.
    for t in range(1, len(cluster.devices) + 1):
        layer = np.nonzero(total_used == t - 1)[0]
        any_live = False
        for lo in range(0, layer.size, chunk):
            rows = layer[lo : lo + chunk]
            if t == 1:
                base = np.full((1, num_units, n_cat), np.inf)  # [S, i, v]
                base[0, 0] = source
                arg = np.full((1, num_units, n_cat), -1, dtype=np.int16)
            else:
                src = np.moveaxis(g[:, rows, :num_units], 0, -1)  # [S, i, u]
                live = np.isfinite(src).any(axis=(1, 2))
                if not live.any():
                    continue
                rows, src = rows[live], src[live]
                cand = np.maximum(src[:, :, :, None], hop[None, :num_units])  # [S, i, u, v]
                arg = cand.argmin(axis=2).astype(np.int16)
                base = np.take_along_axis(cand, arg[:, :, None, :], axis=2)[:, :, 0, :]
            any_live = True
            for v in range(n_cat):
                sel = np.nonzero(used[v, rows] < counts[v])[0]
                if sel.size == 0:
                    continue
                cost = np.maximum(base[sel, :, v][:, :, None], comp[v][None])  # [S, i, k]
                best_i = cost.argmin(axis=1)  # [S, k]
                dst = rows[sel] + strides[v]
                g[v, dst] = np.take_along_axis(cost, best_i[:, None, :], axis=1)[:, 0, :]
                par_i[v, dst] = best_i
                par_u[v, dst] = np.take_along_axis(arg[sel, :, v], best_i, axis=1)
        if not any_live:
            break  # no state with t - 1 devices is reachable, so none with more is

    final = np.maximum(g[:, :, num_units], sink[:, None])  # [u, S]
    best = float(final.min())
    if not math.isfinite(best):
        _raise_fragmented(memory, cluster.devices)
    # Fewest devices among the (near-)optimal end states, then the lowest (u, S).
    near = np.argwhere(final <= best * (1 + _TIE_RTOL))
    u_end, s_end = min(near.tolist(), key=lambda us: (int(total_used[us[1]]), us[0], us[1]))

    stages_rev: list[tuple[int, int, int]] = []
    k, s, u = num_units, s_end, u_end
    while k > 0:
        i = int(par_i[u, s, k])
        prev = int(par_u[u, s, k])
        stages_rev.append((u, i, k))
        s -= strides[u]
        k, u = i, prev
    next_member = [0] * n_cat
    stages = []
    for c, start, end in reversed(stages_rev):
        stages.append(StagePlan(categories[c][next_member[c]], start, end))
        next_member[c] += 1
    plan = Plan(algo="pipeedge", num_units=num_units, stages=tuple(stages))
    predicted = predict_plan(plan, profile, cluster, batch_size)
    predicted["planner_objective_s"] = float(final[u_end, s_end])
    predicted["num_categories"] = float(n_cat)
    return (
        Plan(algo="pipeedge", num_units=num_units, stages=plan.stages, predicted=predicted),
        float(final[u_end, s_end]),
    )


def _raise_fragmented(memory: Sequence[int], devices: Sequence[ClusterDevice]) -> None:
    held = sum(d.memory_bytes or 0 for d in devices)
    raise InfeasiblePlanError(
        f"the model needs {fmt_bytes(sum(memory))} and the {len(devices)} devices together "
        f"hold {fmt_bytes(held)}, but no split into contiguous unit ranges fits every device's "
        "memory (the units do not pack into the devices' sizes); add a device or memory, or "
        "profile the model with finer units"
    )
