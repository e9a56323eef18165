"""Asteroid's Algorithm 1 (MobiCom '24, section 3.2): one micro-batch's samples split
across a stage's device group, by capacity first and then by moving samples off the
stragglers; and the same for many groups at once, vectorised for the HPP planner."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from zpipe._errors import ConfigError


def allocate_microbatch(
    step_times: Sequence[Sequence[float]],
    max_shares: Sequence[int],
    microbatch_size: int,
    *,
    block: int = 1,
) -> tuple[int, ...] | None:
    """Asteroid's Algorithm 1: split a micro-batch's samples across a device group.

    ``step_times[d][y]`` is device ``d``'s forward + backward time of the stage
    on ``y`` samples (``y = 0..B``); ``max_shares[d]`` the most samples its
    memory holds (``bs_d``). Phase 1 (MemoryAwareBalancing) hands out the
    samples in proportion to each device's capacity ``v_d = 1 / step_times[d][B]``
    (eq. 9), capped by its memory, and hands what the capped devices could not
    take to the others, again in proportion, until all are placed. Phase 2
    (StragglerWorkloadOffloading) moves ``block`` samples at a time from the
    slowest device to the fastest one with room for them, while that makes the
    slowest device faster: it repairs what proportional shares get wrong when
    time is not linear in the batch size. Returns the shares (summing to
    ``microbatch_size``, each within its cap), or None when the group's memory
    cannot hold the micro-batch.
    """
    b = microbatch_size
    if block < 1:
        raise ConfigError(f"block must be >= 1, got {block}")
    if len(step_times) != len(max_shares) or not max_shares:
        raise ConfigError("give one step-time row and one memory cap per device, for >= 1 device")
    caps = [min(max(int(c), 0), b) for c in max_shares]
    if sum(caps) < b:
        return None
    capacities = [1.0 / t[b] if t[b] > 0 else math.inf for t in step_times]
    shares = _balance_by_capacity(capacities, caps, b)
    return _offload_stragglers(step_times, caps, shares, block)


def allocate_microbatches(
    step_times: np.ndarray, max_shares: np.ndarray, microbatch_size: int, *, block: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`allocate_microbatch` for many groups of ``k`` devices at once.

    ``step_times[r, d, y]`` and ``max_shares[r, d]`` are group ``r``'s. Returns
    ``(shares [R, k], ok [R])``: row ``r`` is :func:`allocate_microbatch`'s
    answer where ``ok[r]``, and None where not. The same arithmetic in the same
    order, with the same tie-breaks, so the same shares.
    """
    b = microbatch_size
    if block < 1:
        raise ConfigError(f"block must be >= 1, got {block}")
    times = np.asarray(step_times, dtype=np.float64)
    caps = np.clip(np.asarray(max_shares, dtype=np.int64), 0, b)
    if times.ndim != 3 or caps.ndim != 2 or times.shape[:2] != caps.shape or caps.shape[1] < 1:
        raise ConfigError("give step times [group, device, share] and caps [group, device]")
    if times.shape[2] <= b:
        raise ConfigError(f"step times must cover the shares 0..{b}")
    ok = caps.sum(axis=1) >= b
    shares = np.zeros(caps.shape, dtype=np.int64)
    rows = np.flatnonzero(ok)
    if not rows.size:
        return shares, ok
    times, caps = times[rows], caps[rows]
    if not np.isfinite(times).all():  # keep the scalar code's tie-breaks among infinities
        for r, row in enumerate(rows):
            found = allocate_microbatch(times[r].tolist(), caps[r].tolist(), b, block=block)
            shares[row] = found  # type: ignore[assignment]  # never None: ok[row]
        return shares, ok
    full = times[:, :, b]
    with np.errstate(divide="ignore"):
        capacities = np.where(full > 0, 1.0 / np.where(full > 0, full, 1.0), np.inf)
    start = _balance_by_capacity_batch(capacities, caps, b)
    shares[rows] = _offload_stragglers_batch(times, caps, start, block)
    return shares, ok


def _balance_by_capacity_batch(capacities: np.ndarray, caps: np.ndarray, total: int) -> np.ndarray:
    """:func:`_balance_by_capacity` (with :func:`_proportional`) row by row, vectorised."""
    num_rows, k = caps.shape
    shares = np.zeros((num_rows, k), dtype=np.int64)
    left = np.full(num_rows, total, dtype=np.int64)
    active = caps > 0
    before = np.arange(k)[None, :] < np.arange(k)[:, None]  # [d, e]: e comes before d
    while True:
        rows = np.flatnonzero((left > 0) & active.any(axis=1))
        if not rows.size:
            return shares
        act, todo = active[rows], left[rows]
        weights = np.where(act, capacities[rows], 0.0)
        infinite = np.isinf(weights)
        weights = np.where(np.any(infinite, axis=1)[:, None], infinite.astype(np.float64), weights)
        whole = weights[:, 0].copy()
        for d in range(1, k):  # the sum in the scalar code's order
            whole = whole + weights[:, d]
        empty = whole <= 0
        if empty.any():
            weights = np.where(empty[:, None], act.astype(np.float64), weights)
            whole = np.where(empty, act.sum(axis=1).astype(np.float64), whole)
        with np.errstate(divide="ignore", invalid="ignore"):
            ideal = np.where(act, weights / whole[:, None] * todo[:, None], 0.0)
        quotas = np.floor(ideal).astype(np.int64)
        spare = todo - quotas.sum(axis=1)
        remainder = ideal - quotas
        # rank of each device by (-remainder, index) among the active ones
        ahead = np.greater(remainder[:, None, :], remainder[:, :, None]) | (
            np.equal(remainder[:, None, :], remainder[:, :, None]) & before[None]
        )
        rank = (ahead & act[:, None, :]).sum(axis=2)
        quotas += act & (rank < spare[:, None])
        held = shares[rows]
        give = np.where(act, np.minimum(quotas, caps[rows] - held), 0)
        held += give
        shares[rows] = held
        left[rows] = todo - give.sum(axis=1)
        active[rows] = act & (held < caps[rows])


def _offload_stragglers_batch(
    step_times: np.ndarray, caps: np.ndarray, start: np.ndarray, block: int
) -> np.ndarray:
    """:func:`_offload_stragglers` row by row, vectorised (finite times)."""
    shares = start.copy()
    k = shares.shape[1]
    devices = np.arange(k)[None, :]
    moving = np.arange(shares.shape[0])
    while moving.size:
        times, held, room_cap = step_times[moving], shares[moving], caps[moving]
        r = np.arange(moving.size)
        now = times[r[:, None], devices, held]
        straggler = now.argmax(axis=1)  # the first of the slowest: the lowest index
        old = now[r, straggler]
        move = np.minimum(block, held[r, straggler])
        room = (devices != straggler[:, None]) & (held + move[:, None] <= room_cap)
        go = (move > 0) & room.any(axis=1)
        fastest = np.where(room, now, np.inf).argmin(axis=1)
        moved = held.copy()
        moved[r, straggler] -= move * go
        moved[r, fastest] += move * go
        new = times[r[:, None], devices, moved].max(axis=1)
        better = go & (new < old)  # otherwise the scalar code undoes the move and stops
        shares[moving[better]] = moved[better]
        moving = moving[better]
    return shares


def _proportional(weights: Sequence[float], total: int) -> list[int]:
    """Integers summing to ``total`` in proportion to ``weights`` (largest remainders)."""
    if any(math.isinf(w) for w in weights):  # devices that take no time share equally
        weights = [1.0 if math.isinf(w) else 0.0 for w in weights]
    whole = sum(weights)
    if whole <= 0:
        weights, whole = [1.0] * len(weights), float(len(weights))
    ideal = [w / whole * total for w in weights]
    quotas = [math.floor(x) for x in ideal]
    left = total - sum(quotas)
    by_remainder = sorted(range(len(ideal)), key=lambda d: (-(ideal[d] - quotas[d]), d))
    for d in by_remainder[:left]:
        quotas[d] += 1
    return quotas


def _balance_by_capacity(capacities: Sequence[float], caps: Sequence[int], total: int) -> list[int]:
    """Algorithm 1, phase 1 (lines 1-12), with whole samples.

    Each pass gives every device still below its cap its proportional quota of
    what is left, at most up to the cap; a pass either places everything or
    fills at least one device, so there are at most as many passes as devices.
    """
    shares = [0] * len(caps)
    left = total
    active = [d for d, c in enumerate(caps) if c > 0]
    while left > 0 and active:
        quotas = _proportional([capacities[d] for d in active], left)
        for d, quota in zip(active, quotas, strict=True):
            give = min(quota, caps[d] - shares[d])
            shares[d] += give
            left -= give
        active = [d for d in active if shares[d] < caps[d]]
    return shares


def _offload_stragglers(
    step_times: Sequence[Sequence[float]], caps: Sequence[int], start: Sequence[int], block: int
) -> tuple[int, ...]:
    """Algorithm 1, phase 2 (lines 13-20): move load off the straggler while it helps."""
    shares = list(start)
    n = len(shares)

    def slowest() -> tuple[float, int]:
        return max((step_times[d][shares[d]], -d) for d in range(n))

    while True:
        old, neg = slowest()
        straggler = -neg
        move = min(block, shares[straggler])
        room = [d for d in range(n) if d != straggler and shares[d] + move <= caps[d]]
        if move == 0 or not room:
            break
        fastest = min(room, key=lambda d: (step_times[d][shares[d]], d))
        shares[straggler] -= move
        shares[fastest] += move
        if slowest()[0] >= old:  # the new straggler is no faster: undo and stop
            shares[straggler] += move
            shares[fastest] -= move
            break
    return tuple(shares)
