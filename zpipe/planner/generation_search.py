"""The search behind :func:`zpipe.planner.generation.plan_generation`: the Pareto-front
dynamic programme over device categories, unit boundaries and the ring's partial
objectives (see that module's docstring for what is searched and why), and how two
plans are ranked. Pure.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from zpipe._errors import InfeasiblePlanError
from zpipe.planner.cluster import ClusterSpec
from zpipe.planner.generation_cost import (
    GenerationUnit,
    GenerationWorkload,
    client_hops_s,
    combine,
    memory_shortfall,
    stage_memory,
)
from zpipe.planner.plan import StagePlan

# Relative distance within which two objectives tie (sums are not bit-exact).
TIE_RTOL = 1e-9


# How plans are ranked (:func:`better_key`): (J, time to first token, stages, bottleneck).
PlanKey = tuple[float, float, int, float]

# A DP state: (devices used per category, first stage's category, last stage's, boundary).
_State = tuple[tuple[int, ...], int, int, int]


# A partial plan: (R, tau, Q, pi) so far (hops into each stage included, the closing hop
# not yet), its last stage as (category, start, end), and the partial plan it extends.
# A tuple, not a dataclass: the DP makes hundreds of thousands of them.
_Entry = tuple[float, float, float, float, tuple[int, int, int], Any]


def better_key(key: PlanKey, best: PlanKey | None) -> bool:
    """Whether a plan of ``(J, ttft, stages, tau)`` beats ``best``: less J, then (J tying
    within :data:`TIE_RTOL`) less time to first token, then fewer stages, then less
    bottleneck."""
    if best is None:
        return True
    j, t, n, tau = key
    bj, bt, bn, btau = best
    if j < bj * (1 - TIE_RTOL) - 1e-15:
        return True
    if j > bj * (1 + TIE_RTOL) + 1e-15:
        return False
    if t < bt * (1 - TIE_RTOL) - 1e-15:
        return True
    if t > bt * (1 + TIE_RTOL) + 1e-15:
        return False
    if n != bn:
        return n < bn
    return tau < btau * (1 - TIE_RTOL) - 1e-15


class GenerationSolver:
    """The Pareto-front DP of the module docstring over ``categories`` (lists of names).

    With ``fixed_order`` each category is one device and a plan's stages use them
    in the list's order (a subsequence), so a state is (first, last, boundary);
    with ``every_device`` too, every one of them in turn (no device skipped).
    """

    def __init__(
        self,
        units: Sequence[GenerationUnit],
        cluster: ClusterSpec,
        workload: GenerationWorkload,
        speed: Mapping[str, float],
        categories: list[list[str]],
        max_ttft_s: float | None,
        *,
        fixed_order: bool,
        every_device: bool = False,
    ) -> None:
        assert fixed_order or not every_device
        self.every_device = every_device
        self.units = units
        self.cluster = cluster
        self.workload = workload
        self.speed = speed
        self.categories = categories
        self.max_ttft_s = max_ttft_s
        self.fixed_order = fixed_order
        self.counts = [len(c) for c in categories]
        self.states = 0
        self.best_key: PlanKey = (math.inf, math.inf, 0, math.inf)  # of the plan found
        n_cat, num_units = len(categories), len(units)
        # spans[c][i]: (end, decode_s, prefill_s) of every stage [i, end) that fits c's memory
        self.spans: list[list[list[tuple[int, float, float]]]] = []
        dec = list(itertools.accumulate((u.decode_time_s for u in units), initial=0.0))
        pre = list(itertools.accumulate((u.prefill_time_s for u in units), initial=0.0))
        for members in categories:
            rep = cluster.device(members[0])
            rows: list[list[tuple[int, float, float]]] = []
            for i in range(num_units):
                row = []
                for j in range(i + 1, num_units + 1):
                    if memory_shortfall(rep, stage_memory(units, i, j, workload)) is not None:
                        break  # Algorithm 1's break: a longer stage needs more memory still
                    rate = speed[rep.name]
                    row.append((j, (dec[j] - dec[i]) / rate, (pre[j] - pre[i]) / rate))
                rows.append(row)
            self.spans.append(rows)
        # rest_*[k]: the least compute units [k, L) can take, each on the fastest device
        fastest = max(speed[m[0]] for m in categories)
        self.rest_decode = [0.0] * (num_units + 1)
        self.rest_prefill = [0.0] * (num_units + 1)
        for k in range(num_units - 1, -1, -1):
            self.rest_decode[k] = self.rest_decode[k + 1] + units[k].decode_time_s / fastest
            self.rest_prefill[k] = self.rest_prefill[k + 1] + units[k].prefill_time_s / fastest
        # hops[a][b][i]: (x, l, y) from category a to b after unit i - 1; None: no such pair
        self.hops: list[list[list[tuple[float, float, float]] | None]] = []
        for a in range(n_cat):
            row_b: list[list[tuple[float, float, float]] | None] = []
            for b in range(n_cat):
                pair = self._pair(a, b)
                if pair is None:
                    row_b.append(None)
                    continue
                sender, receiver = pair
                bw = cluster.bandwidth_bps(sender, receiver)
                lat = cluster.latency_s(sender, receiver)
                per_unit = [(0.0, 0.0, 0.0)]  # nothing crosses before unit 0
                for i in range(1, num_units + 1):
                    out = units[i - 1].output_bytes_per_token
                    # as ClusterSpec.comm_time_s computes it
                    x = workload.decode_batch * out * 8.0 / bw
                    y = workload.prefill_chunk * out * 8.0 / bw
                    per_unit.append((x, lat, y))
                row_b.append(per_unit)
            self.hops.append(row_b)

    def _pair(self, a: int, b: int) -> tuple[str, str] | None:
        """Two distinct devices, one of category ``a`` sending to one of ``b``."""
        if a != b:
            return self.categories[a][0], self.categories[b][0]
        if self.counts[a] < 2:
            return None
        return self.categories[a][0], self.categories[a][1]

    def _finish(self, first: int, entry: _Entry, stages: int) -> tuple[float, float, float] | None:
        """``(J, ttft, tau)`` of a complete plan, or None when it misses ``max_ttft_s``."""
        ring, period, pre_sum, pre_period, (last_cat, _, _), _ = entry
        if stages > 1:
            hop = self.hops[last_cat][first]
            assert hop is not None  # a plan of >1 stage ending on ``first``'s category has 2
            x, lat, _ = hop[len(self.units)]
            ring += x + lat
            period = max(period, x)
        first_name = self.categories[first][0]
        last_name = self.categories[last_cat][0]
        if stages > 1 and first == last_cat:
            last_name = self.categories[last_cat][1]
        pre_sum += client_hops_s(self.units, first_name, last_name, self.cluster, self.workload)
        _, _, ttft = combine(ring, period, pre_sum, pre_period, self.workload)
        # within TIE_RTOL: sums in another order than predict_generation's may differ
        if self.max_ttft_s is not None and ttft > self.max_ttft_s * (1 + TIE_RTOL):
            return None
        return max(ring, self.workload.groups * period), ttft, period

    def solve(self, bound: float | None = None) -> tuple[StagePlan, ...]:
        """The best plan's stages; ``bound``: a ``J`` some plan is known to reach (the
        search drops partial plans already worse than it)."""
        num_units = len(self.units)
        n_cat = len(self.categories)
        groups = self.workload.groups
        chunks_less_one = self.workload.chunks - 1
        best: PlanKey | None = None
        best_entry: _Entry | None = None

        rest_decode, rest_prefill = self.rest_decode, self.rest_prefill
        max_ttft = math.inf if self.max_ttft_s is None else self.max_ttft_s * (1 + TIE_RTOL)
        limit = math.inf if bound is None else bound * (1 + TIE_RTOL)

        def complete(first: int, entry: _Entry, stages: int) -> None:
            nonlocal best, best_entry, limit
            if self.every_device and stages != n_cat:
                return
            done = self._finish(first, entry, stages)
            if done is not None and better_key((done[0], done[1], stages, done[2]), best):
                best = (done[0], done[1], stages, done[2])
                best_entry = entry
                limit = min(limit, done[0] * (1 + TIE_RTOL))

        # Both bounds below only grow as stages are added: J >= max(R + the rest's
        # compute on the fastest device, G * tau); ttft >= Q + that rest + (k - 1) * pi.
        layer: dict[_State, list[_Entry]] = {}
        zero = (0,) * n_cat
        for f in range(1 if self.every_device else n_cat):
            used = _bump(zero, f)
            for j, d, p in self.spans[f][0]:
                entry: _Entry = (d, d, p, p, (f, 0, j), None)
                if j == num_units:
                    complete(f, entry, 1)
                else:
                    _insert(layer, (used, f, f, j), entry)
        stages = 1
        while layer:
            self.states += len(layer)
            nxt: dict[_State, list[_Entry]] = {}
            for (used, first, last, i), front in layer.items():
                if self.every_device:
                    after = range(last + 1, min(last + 2, n_cat))
                elif self.fixed_order:
                    after = range(last + 1, n_cat)
                else:
                    after = range(n_cat)
                for v in after:
                    if used[v] >= self.counts[v]:
                        continue
                    hop_row = self.hops[last][v]
                    if hop_row is None:
                        continue
                    x, lat, y = hop_row[i]
                    # in a fixed order the last device says which may follow: no counts
                    key_used = used if self.fixed_order else _bump(used, v)
                    for e in front:
                        ring0 = e[0] + x + lat
                        period0 = max(e[1], x)
                        pre0 = e[2] + y + lat
                        pre_period0 = max(e[3], y)
                        if groups * period0 > limit or ring0 + rest_decode[i] > limit:
                            continue
                        for j, d, p in self.spans[v][i]:
                            if groups * d > limit:
                                break  # a longer stage computes longer still
                            ring = ring0 + d
                            period = period0 if period0 >= d else d
                            pre = pre0 + p
                            pre_period = pre_period0 if pre_period0 >= p else p
                            if (
                                ring + rest_decode[j] > limit
                                or pre + rest_prefill[j] + chunks_less_one * pre_period > max_ttft
                            ):
                                continue
                            cand: _Entry = (ring, period, pre, pre_period, (v, i, j), e)
                            if j == num_units:
                                complete(first, cand, stages + 1)
                            else:
                                _insert(nxt, (key_used, first, v, j), cand)
            layer = nxt
            stages += 1
        if best_entry is None or best is None:
            self._raise_none()
        assert best_entry is not None and best is not None
        self.best_key = best
        return self._stages(best_entry)

    def _stages(self, entry: _Entry) -> tuple[StagePlan, ...]:
        chain: list[tuple[int, int, int]] = []
        e: _Entry | None = entry
        while e is not None:
            chain.append(e[4])
            e = e[5]
        chain.reverse()
        taken = [0] * len(self.categories)
        out = []
        for c, start, end in chain:
            out.append(StagePlan(self.categories[c][taken[c]], start, end))
            taken[c] += 1
        return tuple(out)

    def _raise_none(self) -> None:
        if self.max_ttft_s is not None:
            raise InfeasiblePlanError(
                f"no plan that fits memory has a time to first token within {self.max_ttft_s:g} s "
                f"for a prompt of {self.workload.prompt} tokens in chunks of "
                f"{self.workload.prefill_chunk}: allow a longer time, a shorter prompt or "
                "larger chunks, or add faster devices"
            )
        raise InfeasiblePlanError(
            f"no split of the {len(self.units)} units into contiguous ranges fits every device's "
            f"memory for {self.workload.sequences} sequences of up to "
            f"{self.workload.max_context} tokens (the units, with their KV caches, do not pack "
            "into the devices' sizes): serve fewer sequences or a shorter context, or add "
            "devices or memory"
        )


def _bump(used: tuple[int, ...], c: int) -> tuple[int, ...]:
    return (*used[:c], used[c] + 1, *used[c + 1 :])


def _insert(table: dict[_State, list[_Entry]], key: _State, entry: _Entry) -> None:
    """Add ``entry`` to ``key``'s Pareto front unless an entry there dominates it."""
    front = table.get(key)
    if front is None:
        table[key] = [entry]
        return
    r, t, q, pi = entry[0], entry[1], entry[2], entry[3]
    for o in front:
        if o[0] <= r and o[1] <= t and o[2] <= q and o[3] <= pi:
            return
    front[:] = [o for o in front if not (r <= o[0] and t <= o[1] and q <= o[2] and pi <= o[3])]
    front.append(entry)
