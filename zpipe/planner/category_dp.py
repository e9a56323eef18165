"""PipeEdge's category DP, expanded sparsely: only device-count states that can still win.

The recurrence is PipeEdge's (see :mod:`zpipe.planner.pipeedge`): a node
``(S, v)`` is a vector of device counts ``S`` (one count per category) whose
last stage runs on category ``v``; its value ``g(S, v, k)`` is the least
bottleneck of running units ``[0, k)`` that way, the last stage's outgoing hop
not yet paid. A node follows from exactly one count vector, ``S - e_v``:

    g(S, v, k) = min over i of max(base(S - e_v, i, v), T_comp(i..k, v))
    base(P, i, v) = min over u of max(g(P, u, i), T_comm(u -> v, after unit i - 1))

Dominance. Two partial plans that end at the same boundary ``k`` on the same
category ``u`` have the same futures, except that the one that used fewer
devices of every category has more left. So a cell ``g(S, u, k)`` that is no
smaller than ``g(S', u, k)`` for some ``S' <= S`` (componentwise, ``S' != S``)
can never be part of a plan better than one through ``S'``, which also uses
fewer devices (the tie rule's preference). Such cells are dropped (set to
infinity) before they are expanded: the best plan, fewest devices first, is
the one the full DP finds. ``M(S, u, k) = min over S' <= S of g(S', u, k)``
is kept per count vector, one layer (device total) at a time, through the
vectors that were generated; a vector never generated (no live predecessor)
contributes nothing, which only prunes less.

Why it pays: with many devices most count vectors are dominated (a vector
that adds a device and does not lower any boundary's bottleneck is useless),
so a layer holds tens to hundreds of live vectors where the full lattice has
``prod(n_c + 1)``: 64 devices in 4 categories of 16 is 83,521 vectors, of
which a few hundred are ever live. The work is bounded by ``max_work``
element operations; a solve that would exceed it raises
:class:`DPTooLargeError` rather than run for minutes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from zpipe._errors import ConfigError

# Count vectors per numpy call, so that no temporary array outgrows a few MB.
CHUNK_ELEMENTS = 1 << 20

# Count-vector lattices up to this size skip the greedy bound: it costs more than it saves.
SMALL_LATTICE = 1024

# Bottlenecks within this relative distance count as equal when choosing the
# plan with fewer devices: prefix-sum differences are not bit-exact.
TIE_RTOL = 1e-9


class DPTooLargeError(ConfigError):
    """The DP would do more than its work limit: too many live device-count states."""


@dataclass(frozen=True)
class CategoryTables:
    """What the DP needs about ``C`` categories and ``L`` units, as arrays.

    ``comp[c, i, k]``: compute of units ``[i, k)`` on category ``c`` (inf where the
    range is empty or does not fit ``c``'s memory); ``hop[i, u, v]``: sending the
    output of unit ``i - 1`` from ``u`` to ``v`` (``hop[0]`` unused); ``source[v]``:
    the client's send of the input to ``v``; ``sink[u]``: ``u``'s send of the result
    to the client; ``counts[c]``: devices in category ``c``.
    """

    counts: Sequence[int]
    comp: np.ndarray
    hop: np.ndarray
    source: np.ndarray
    sink: np.ndarray
    unit_times: np.ndarray  # [c, unit]: each unit's compute on category c


@dataclass(frozen=True)
class CategorySolution:
    """The optimal bottleneck, its stages as ``(category, start, end)``, and the effort."""

    bottleneck_s: float
    stages: tuple[tuple[int, int, int], ...]
    live_states: int  # count vectors expanded (with a cell that was not dominated)
    work: int  # element operations spent


@dataclass
class _Layer:
    """The nodes of one device total: node ``n`` is ``(state[n], cat[n])``."""

    state: np.ndarray  # int64 [n] mixed-radix count vectors
    cat: np.ndarray  # int16 [n] category of the last stage
    g: np.ndarray  # [n, L + 1]


@dataclass(frozen=True)
class _Spans:
    """Category ``v``'s stages as flat ``(i, k)`` pairs, grouped by ``k``: the pairs that
    fit memory and are not empty, so a min over ``i`` is one ``reduceat``."""

    first: np.ndarray  # [pairs] i
    comp: np.ndarray  # [pairs] compute of units [i, k)
    ends: np.ndarray  # [K] the k that have at least one pair
    starts: np.ndarray  # [K] where each k's pairs begin

    def within(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The pairs with ``lo <= i <= hi``: (i, compute, the k, where each k begins)."""
        if lo == 0 and hi >= self.first.max(initial=0):
            return self.first, self.comp, self.ends, self.starts
        keep = np.nonzero((self.first >= lo) & (self.first <= hi))[0]
        k_of = np.repeat(self.ends, np.diff(np.append(self.starts, self.first.size)))[keep]
        ends, starts = np.unique(k_of, return_index=True)
        return self.first[keep], self.comp[keep], ends, starts


def _spans(comp: np.ndarray) -> list[_Spans]:
    out = []
    for table in comp:  # [i, k]
        i_idx, k_idx = np.nonzero(np.isfinite(table).T)  # sorted by k, then i
        k_idx, i_idx = i_idx, k_idx
        ends, starts = np.unique(k_idx, return_index=True)
        out.append(_Spans(i_idx, table[i_idx, k_idx], ends, starts))
    return out


def _digits(states: np.ndarray, strides: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``used[c, s]``: devices of category ``c`` in each state."""
    return (states[None, :] // strides[:, None]) % (counts[:, None] + 1)


def _bases(dense: np.ndarray, hop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``base[P, i, v] = min over u of max(g[P, u, i], hop[i, u, v])`` and the first
    ``u`` reaching it."""
    num_units = hop.shape[0]
    src = np.moveaxis(dense[:, :, :num_units], 1, -1)  # [P, i, u]
    cand = np.maximum(src[:, :, :, None], hop[None])  # [P, i, u, v]
    arg = cand.argmin(axis=2)
    base = np.take_along_axis(cand, arg[:, :, None, :], axis=2)[:, :, 0, :]
    return base, arg


def solve_categories(
    tables: CategoryTables, *, max_devices: int, max_work: int
) -> CategorySolution | None:
    """The least bottleneck over every count vector, order and split, fewest devices first;
    ``None`` when no plan fits memory. Ties: fewest devices, then the lowest (last
    category, count vector), then the first ``i`` and ``u``, as the dense DP chose."""
    counts = np.asarray(tables.counts, dtype=np.int64)
    n_cat = counts.size
    num_units = tables.comp.shape[1]
    strides = np.ones(n_cat, dtype=np.int64)
    for c in range(1, n_cat):
        strides[c] = strides[c - 1] * (counts[c - 1] + 1)
    spans = _spans(tables.comp)
    widest = max(1, max(s.first.size for s in spans))
    chunk = max(1, CHUNK_ELEMENTS // max(widest, num_units * n_cat * n_cat))
    hop = tables.hop[:num_units]
    layers: list[_Layer] = []
    prev_states = np.zeros(1, dtype=np.int64)  # layer 0: no device used
    prev_best = np.full((1, n_cat, num_units + 1), np.inf)  # M of layer 0: nothing
    upper = math.inf  # the best complete plan so far (it used fewer devices)
    # A plan found greedily: partial plans that cannot beat it, even finishing on all the
    # devices left at their best rates, are dropped (strictly worse only: ties survive).
    # (A small lattice is cheaper to expand than to bound.)
    small = math.prod(int(n) + 1 for n in counts) <= SMALL_LATTICE
    ceiling = math.inf if small else greedy_upper_bound(tables) * (1 + 2 * TIE_RTOL)
    rest_work, rates = _rest_work_and_rates(tables.unit_times)
    work = live_states = 0
    dominance = True

    for t in range(1, min(max_devices, num_units) + 1):
        if not layers:
            pred = prev_states
            dense = np.full((1, n_cat, num_units + 1), np.inf)
        else:
            dense = _dense(layers[-1], prev_states, n_cat, num_units)  # [P, u, k]
            live = np.isfinite(dense[:, :, :num_units]).any(axis=(1, 2))
            if not live.any():
                break
            pred, dense = prev_states[live], dense[live]
            live_states += int(pred.size)
            # Vectors whose live cells start at nearby units share a chunk, so that each
            # chunk computes only the stages that start where its cells are live.
            finite = np.isfinite(dense[:, :, :num_units]).any(axis=1)  # [P, i]
            first_live = finite.argmax(axis=1)
            last_live = num_units - 1 - finite[:, ::-1].argmax(axis=1)
            order = np.argsort(first_live, kind="stable")
            pred, dense = pred[order], dense[order]
            first_live, last_live = first_live[order], last_live[order]
        used = _digits(pred, strides, counts)
        parts: list[tuple[np.ndarray, int, np.ndarray]] = []
        for lo in range(0, pred.size, chunk):
            block = slice(lo, lo + chunk)
            if layers:
                src = np.moveaxis(dense[block, :, :num_units], 1, -1)  # [P, i, u]
                base = np.maximum(src[:, :, :, None], hop[None]).min(axis=2)  # [P, i, v]
                work += base.size * n_cat
                band = (int(first_live[block].min()), int(last_live[block].max()))
            else:
                base = np.full((1, num_units, n_cat), np.inf)
                base[0, 0] = tables.source
                band = (0, 0)
            for v in range(n_cat):
                sel = np.nonzero(used[v, block] < counts[v])[0]
                if sel.size == 0:
                    continue
                first, comp, ends, starts = spans[v].within(*band)
                work += sel.size * first.size * 2
                if work > max_work:
                    raise DPTooLargeError(
                        f"the category DP passed its limit of {max_work:.3g} operations at "
                        f"{t} devices ({live_states} count vectors expanded)"
                    )
                g = np.full((sel.size, num_units + 1), np.inf)
                if first.size:
                    cost = np.maximum(base[sel][:, first, v], comp[None, :])
                    g[:, ends] = np.minimum.reduceat(cost, starts, axis=1)
                parts.append((pred[block][sel] + strides[v], v, g))
        if not parts:
            break
        layer = _Layer(
            state=np.concatenate([p[0] for p in parts]),
            cat=np.concatenate([np.full(p[0].size, p[1], dtype=np.int16) for p in parts]),
            g=np.concatenate([p[2] for p in parts]),
        )
        if dominance:
            before = np.count_nonzero(np.isfinite(layer.g))
            prev_states, prev_best = _prune_dominated(
                layer, prev_states, prev_best, strides, counts
            )
            # Where devices keep helping (compute-bound clusters) hardly anything is
            # dominated; stop paying for the check (pruning less is always sound).
            dominance = t < 3 or bool(np.count_nonzero(np.isfinite(layer.g)) < 0.9 * before)
        else:
            prev_states = np.unique(layer.state)
        finals = np.maximum(layer.g[:, num_units], tables.sink[layer.cat])
        upper = min(upper, float(finals.min()))
        partial = layer.g[:, :num_units]
        # A partial plan no better than a complete one with fewer devices cannot win.
        partial[partial >= upper] = np.inf
        left = (counts[:, None] - _digits(layer.state, strides, counts)).T @ rates  # [n]
        with np.errstate(divide="ignore", invalid="ignore"):
            finish = rest_work[None, :num_units] / left[:, None]
        partial[np.maximum(partial, finish) > ceiling] = np.inf
        layers.append(layer)

    return _best_plan(layers, tables, spans, strides, num_units, live_states, work)


def _rest_work_and_rates(unit_times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Units ``[k, L)``'s work counted in category 0's seconds, and each category's best
    rate in those seconds per second: a device of ``c`` finishes at most ``B * rate[c]`` of
    that work within a bottleneck ``B``, so the devices left need at least
    ``rest_work[k] / sum(rates left)`` to finish (a lower bound, memory and links aside)."""
    ref = unit_times[0]
    rest_work = np.concatenate((np.cumsum(ref[::-1])[::-1], [0.0]))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(unit_times > 0, ref[None, :] / unit_times, np.where(ref > 0, np.inf, 0))
    rates = ratio.max(axis=1)
    return rest_work, rates


def greedy_upper_bound(tables: CategoryTables, *, steps: int = 48) -> float:
    """The bottleneck of a plan found greedily (inf if none): categories in blocks, in a
    few orders; each device takes as many units as fit a bottleneck ``B``; ``B`` by
    bisection. It only needs to be a real plan's cost, not a good one; closer is faster."""
    comp, hop = tables.comp, tables.hop
    n_cat, num_units = comp.shape[0], comp.shape[1]
    rates = _rest_work_and_rates(tables.unit_times)[1]
    by_rate = sorted(range(n_cat), key=lambda c: -rates[c])
    orders = [by_rate, by_rate[::-1]]
    if n_cat <= 4:
        orders = [list(p) for p in itertools.permutations(range(n_cat))]
    sequences = [[c for c in order for _ in range(int(tables.counts[c]))] for order in orders]

    def feasible(bound: float, sequence: list[int]) -> bool:
        k, prev = 0, -1
        for c in sequence:
            if k == num_units:
                break
            into = tables.source[c] if prev < 0 else hop[k, prev, c]
            if into > bound:
                continue
            reach = k + int(np.count_nonzero(comp[c, k] <= bound))
            if reach > k:
                k, prev = reach, c
        return k == num_units and prev >= 0 and tables.sink[prev] <= bound

    finite = comp[np.isfinite(comp)]
    hi = float(
        max(
            finite.max(initial=0.0),
            np.nanmax(np.where(np.isfinite(hop), hop, np.nan), initial=0.0),
            np.max(tables.source[np.isfinite(tables.source)], initial=0.0),
            np.max(tables.sink[np.isfinite(tables.sink)], initial=0.0),
        )
    )
    best = math.inf
    for sequence in sequences:
        if not feasible(min(hi, best), sequence):
            continue
        lo, top = 0.0, min(hi, best)
        for _ in range(steps):
            mid = (lo + top) / 2
            if feasible(mid, sequence):
                top = mid
            else:
                lo = mid
        best = min(best, top)
    return best


def _dense(layer: _Layer, states: np.ndarray, n_cat: int, num_units: int) -> np.ndarray:
    """The layer's cells by count vector: ``[len(states), u, k]``, inf where no node."""
    dense = np.full((states.size, n_cat, num_units + 1), np.inf)
    rows = np.searchsorted(states, layer.state)
    dense[rows, layer.cat] = layer.g
    return dense


def _prune_dominated(
    layer: _Layer,
    prev_states: np.ndarray,
    prev_best: np.ndarray,
    strides: np.ndarray,
    counts: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Drop the layer's cells that a vector with one device fewer (transitively: any
    fewer) matches or beats; return the layer's vectors and their ``M``."""
    n_cat, width = prev_best.shape[1], prev_best.shape[2]
    states = np.unique(layer.state)
    used = _digits(states, strides, counts)
    bound = np.full((states.size, n_cat, width), np.inf)
    for c in range(n_cat):
        has = np.nonzero(used[c] > 0)[0]
        keys = states[has] - strides[c]
        idx = np.searchsorted(prev_states, keys)
        idx[idx >= prev_states.size] = 0
        found = prev_states[idx] == keys
        rows = has[found]
        bound[rows] = np.minimum(bound[rows], prev_best[idx[found]])
    rows = np.searchsorted(states, layer.state)
    dominated = layer.g >= bound[rows, layer.cat]
    best = bound
    best[rows, layer.cat] = np.minimum(bound[rows, layer.cat], layer.g)
    layer.g[dominated] = np.inf
    return states, best


def _best_plan(
    layers: list[_Layer],
    tables: CategoryTables,
    spans: list[_Spans],
    strides: np.ndarray,
    num_units: int,
    live_states: int,
    work: int,
) -> CategorySolution | None:
    finals = [np.maximum(layer.g[:, num_units], tables.sink[layer.cat]) for layer in layers]
    best = min((float(f.min()) for f in finals if f.size), default=math.inf)
    if not math.isfinite(best):
        return None
    # Fewest devices among the (near-)optimal end nodes, then the lowest (category, vector).
    t = next(t for t, f in enumerate(finals) if (f <= best * (1 + TIE_RTOL)).any())
    layer = layers[t]
    near = np.nonzero(finals[t] <= best * (1 + TIE_RTOL))[0]
    node = min(near.tolist(), key=lambda n: (int(layer.cat[n]), int(layer.state[n])))
    bottleneck = float(finals[t][node])
    state, cat, k = int(layer.state[node]), int(layer.cat[node]), num_units
    stages: list[tuple[int, int, int]] = []
    # Walk back, recomputing each stage's first unit and predecessor from the stored
    # cells exactly as the forward pass did (first i, then first u, among equals).
    while t > 0:
        pred_state = state - int(strides[cat])
        pred_layer = layers[t - 1]
        dense = _dense_one(pred_layer, pred_state, len(spans), num_units)
        base, arg = _bases(dense[None], tables.hop[:num_units])
        span = spans[cat]
        lo, hi = _segment(span, k)
        cost = np.maximum(base[0, span.first[lo:hi], cat], span.comp[lo:hi])
        pick = lo + int(cost.argmin())
        i = int(span.first[pick])
        stages.append((cat, i, k))
        state, cat, k, t = pred_state, int(arg[0, i, cat]), i, t - 1
    stages.append((cat, 0, k))
    stages.reverse()
    return CategorySolution(bottleneck, tuple(stages), live_states, work)


def _dense_one(layer: _Layer, state: int, n_cat: int, num_units: int) -> np.ndarray:
    dense = np.full((n_cat, num_units + 1), np.inf)
    hits = np.nonzero(layer.state == state)[0]
    dense[layer.cat[hits]] = layer.g[hits]
    return dense


def _segment(span: _Spans, k: int) -> tuple[int, int]:
    at = int(np.searchsorted(span.ends, k))
    lo = int(span.starts[at])
    hi = int(span.starts[at + 1]) if at + 1 < span.starts.size else span.first.size
    return lo, hi
