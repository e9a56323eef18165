"""The training cost model the training planners share (Asteroid, MobiCom '24, section 3).

Everything here is for one micro-batch of ``B`` samples, split across a stage's
device group; a device that runs ``y`` of them costs:

- compute: ``t_f(i..j, y)`` and ``t_b(i..j, y)``, the sums of the units' forward
  (``time_s``) and backward (``backward_time_s``) times at batch size ``y`` on
  that device. Batch sizes the profile did not measure are interpolated
  linearly between measured ones, and proportionally (through zero) below
  the smallest and above the largest; ``y = 0`` costs nothing. A device with
  its own profile uses its own times (its backward times scaled from the
  model profile's, unit by unit, by its forward times when its profile has
  none); any other device divides the model profile's times by its speed.
- memory (eq. 3 with the running forward, :mod:`zpipe.planner.memory`, the one
  memory model): ``Mem = MOD + OPT + K x ACT(y) + max(F(y), step)``: ``MOD`` is the stage's
  weights twice (the weights and the gradients accumulated over the
  mini-batch), ``OPT`` the optimizer's state, ``copies`` more times the
  weights (:data:`OPTIMIZER_STATE_COPIES`: plain SGD 0, SGD with momentum 1,
  Adam 2), ``ACT(y)`` the bytes the stage's units save for the backward
  at ``y`` samples, held for ``K`` micro-batches at once (the stage's warm-up
  K_p), and ``F(y)`` the running forward's peak by the tight rule (the largest
  unit's peak plus the stage's input), read between profiled sizes as ``ACT``
  is, or the optimizer step's temporaries where larger (``OPTIMIZER_STEP_COPIES``
  copies of the weights: Adam 2, plain SGD 0). Weights are the profile's
  ``param_bytes``, which include buffers (BatchNorm statistics): slightly more
  than the trainable parameters, on the safe side.
- the stage's forward and backward time (eq. 8): the slowest device's.
- the all-reduce of the stage's gradients at the end of the round (eq. 5):
  ``2 (n - 1) / n x W / b_min`` for a ring over the group's ``n`` devices, with
  ``W`` the stage's weight bytes and ``b_min`` the slowest link between two of
  its devices; 0 for one device.
- the transfer between consecutive stages (a "communication step"): the
  whole micro-batch's boundary tensor (the output of the stage's last unit,
  and the same size again for its gradient on the way back) over the slowest
  link from a device of the sending group to one of the receiving group. It
  is exact from one device to one device, and where all of it crosses one
  device's link (a group sending to one device, or one device to a group); it
  errs high between two groups, whose several links carry it in parallel.
  Link latency is left out, as in :meth:`ClusterSpec.comm_time_s`.

Data is assumed to be on the first stage's devices and labels on the last's:
the client's link costs nothing in training.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from zpipe._errors import ConfigError
from zpipe.planner.allocation import allocate_microbatch
from zpipe.planner.cluster import ClusterDevice, ClusterSpec
from zpipe.planner.memory import (
    OPTIMIZER_STATE_COPIES,
    OPTIMIZER_STEP_COPIES,
    optimizer_state_copies,
    tight_forward_matrix,
    unit_inputs,
)
from zpipe.planner.profile import ModelProfile
from zpipe.planner.schedules import pipeline_actions, simulate
from zpipe.planner.training_plan import TrainingPlan, TrainStage

__all__ = ["OPTIMIZER_STATE_COPIES", "optimizer_state_copies"]  # their home is memory.py


def at_batch_sizes(
    batch_sizes: Sequence[int], values: np.ndarray | Sequence[Sequence[float]], largest: int
) -> np.ndarray:
    """``values[k, u]`` measured at ``batch_sizes[k]``, read at every size ``0..largest``.

    Linear between measured sizes; through zero below the smallest and
    proportional above the largest (the per-sample cost of the nearest
    measurement), so that the result never decreases with the batch size when
    the measurements do not. Returns an array ``[largest + 1, units]``.
    """
    sizes = np.asarray(batch_sizes, dtype=np.float64)
    table = np.asarray(values, dtype=np.float64)
    ys = np.arange(largest + 1, dtype=np.float64)
    xp = np.concatenate(([0.0], sizes))
    fp = np.vstack((np.zeros((1, table.shape[1])), table))
    k = np.clip(np.searchsorted(xp, ys, side="right") - 1, 0, len(xp) - 2)
    frac = ((ys - xp[k]) / (xp[k + 1] - xp[k]))[:, None]
    out = fp[k] + frac * (fp[k + 1] - fp[k])
    beyond = ys > sizes[-1]
    out[beyond] = table[-1][None, :] * (ys[beyond] / sizes[-1])[:, None]
    return out


def _prefix(per_unit: np.ndarray) -> np.ndarray:
    """Prefix sums over units (last axis), with a leading zero column."""
    out = np.zeros((*per_unit.shape[:-1], per_unit.shape[-1] + 1))
    out[..., 1:] = np.cumsum(per_unit, axis=-1)
    return out


def _table(profile: ModelProfile, rows: Sequence[Sequence[float]], largest: int) -> np.ndarray:
    """Per-unit values at every batch size ``0..largest``, made non-decreasing in the size
    (as the profiler makes its times) so that a larger share never looks cheaper."""
    table = at_batch_sizes(profile.batch_sizes, np.asarray(rows, dtype=np.float64), largest)
    return np.maximum.accumulate(table, axis=0)


@dataclass(frozen=True)
class _ComputeTables:
    """Prefix sums of one kind of device's forward and backward times, ``[y, unit]``."""

    forward: np.ndarray
    backward: np.ndarray


class TrainingCosts:
    """The cost model of one model on one cluster at one micro-batch size.

    Holds prefix sums over units for every share size ``0..B``, so that a
    stage's time or memory at any share is two table reads.
    """

    def __init__(
        self,
        profile: ModelProfile,
        cluster: ClusterSpec,
        *,
        microbatch_size: int,
        optimizer: str = "sgd",
    ) -> None:
        if isinstance(microbatch_size, bool) or not isinstance(microbatch_size, int):
            raise ConfigError(f"microbatch_size must be an integer, got {microbatch_size!r}")
        if microbatch_size < 1:
            raise ConfigError(f"microbatch_size must be >= 1, got {microbatch_size}")
        if not profile.has_training:
            raise ConfigError("profile has no training measurements; profile with --train")
        self.profile = profile
        self.cluster = cluster
        self.microbatch_size = microbatch_size
        self.num_units = profile.num_units
        self.optimizer = optimizer
        self.state_copies = optimizer_state_copies(optimizer)
        self.step_copies = OPTIMIZER_STEP_COPIES[optimizer]
        sizes, b = profile.batch_sizes, microbatch_size
        self._weights = _prefix(np.asarray(profile.param_bytes(), dtype=np.float64))
        self._saved = _prefix(_table(profile, [profile.activation_bytes(s) for s in sizes], b))
        # F at each profiled size, [size, start, end], never smaller at a larger size
        running = np.stack(
            [
                tight_forward_matrix(
                    profile.peak_bytes(s),
                    unit_inputs(profile.input_bytes_at(s), profile.output_bytes(s)),
                )
                for s in sizes
            ]
        )
        self._running = np.maximum.accumulate(running, axis=0)
        self._sizes = np.asarray(sizes, dtype=np.float64)
        self._out = _table(profile, [profile.output_bytes(s) for s in sizes], b)
        self._by_key: dict[object, _ComputeTables] = {}
        self._activation_rows: dict[tuple[int, int, int], list[float]] = {}
        self._bandwidth: dict[tuple[str, str], float] = {}

    # -- compute ------------------------------------------------------------------------

    def _compute_tables_of(self, device: ClusterDevice) -> _ComputeTables:
        profile, b = self.profile, self.microbatch_size
        sizes = profile.batch_sizes
        forward = _table(profile, [profile.times(s) for s in sizes], b)
        backward = _table(profile, [profile.backward_times(s) for s in sizes], b)
        own = device.profile
        if own is None:
            return _ComputeTables(_prefix(forward / device.speed), _prefix(backward / device.speed))
        if own.num_units != profile.num_units:
            raise ConfigError(
                f"device {device.name!r}: its own profile has {own.num_units} units but the "
                f"model profile has {profile.num_units}; profile the same model on it"
            )
        own_forward = _table(own, [own.times(s) for s in own.batch_sizes], b)
        if own.has_training:
            own_backward = _table(own, [own.backward_times(s) for s in own.batch_sizes], b)
        else:
            # No backward measured there: assume backward/forward is the same on both devices.
            ratio = np.divide(own_forward, forward, out=np.ones_like(forward), where=forward > 0)
            own_backward = backward * ratio
        return _ComputeTables(_prefix(own_forward), _prefix(own_backward))

    def _compute(self, device: ClusterDevice) -> _ComputeTables:
        key: object = device.speed if device.profile is None else ("profile", id(device.profile))
        tables = self._by_key.get(key)
        if tables is None:
            tables = self._by_key[key] = self._compute_tables_of(device)
        return tables

    def prefix_rows(self, device: ClusterDevice) -> tuple[list[list[float]], list[list[float]]]:
        """``device``'s forward and backward prefix sums as lists, ``[share][unit]``: for
        planners that read them millions of times (a list read costs a tenth of numpy's).
        ``forward[y][end] - forward[y][start]`` equals :meth:`forward_s`."""
        tables = self._compute(device)
        return tables.forward.tolist(), tables.backward.tolist()

    def prefix_tables(self, device: ClusterDevice) -> tuple[np.ndarray, np.ndarray]:
        """``device``'s forward and backward prefix sums, ``[share, unit]`` (0..B, 0..L):
        for planners that vectorise over stages. Do not modify them."""
        tables = self._compute(device)
        return tables.forward, tables.backward

    @property
    def weight_prefix(self) -> np.ndarray:
        """Prefix sums of the units' weight bytes, ``[unit]`` (0..L). Do not modify it."""
        return self._weights

    @property
    def saved_prefix(self) -> np.ndarray:
        """Prefix sums of ``ACT``, ``[share, unit]`` (0..B, 0..L). Do not modify it."""
        return self._saved

    def forward_s(self, device: ClusterDevice, start: int, end: int, share: int) -> float:
        """``t_f``: the forward of units ``[start, end)`` on ``share`` samples on ``device``."""
        row = self._compute(device).forward[share]
        return float(row[end] - row[start])

    def backward_s(self, device: ClusterDevice, start: int, end: int, share: int) -> float:
        """``t_b``: the backward of units ``[start, end)`` on ``share`` samples on ``device``."""
        row = self._compute(device).backward[share]
        return float(row[end] - row[start])

    def step_times(self, device: ClusterDevice, start: int, end: int) -> np.ndarray:
        """``t_f + t_b`` of units ``[start, end)`` on ``device`` for every share ``0..B``."""
        tables = self._compute(device)
        return (
            tables.forward[:, end]
            - tables.forward[:, start]
            + tables.backward[:, end]
            - tables.backward[:, start]
        )

    # -- memory (eq. 3) -----------------------------------------------------------------

    def weight_bytes(self, start: int, end: int) -> float:
        """The weights of units ``[start, end)``: what an all-reduce exchanges."""
        return float(self._weights[end] - self._weights[start])

    def static_bytes(self, start: int, end: int) -> float:
        """``MOD + OPT``: weights, accumulated gradients and optimizer state."""
        return (2 + self.state_copies) * self.weight_bytes(start, end)

    def saved_bytes(self, start: int, end: int, share: int) -> float:
        """``ACT``: what units ``[start, end)`` keep for their backward, for ``share`` samples."""
        row = self._saved[share]
        return float(row[end] - row[start])

    def running_bytes(
        self, starts: np.ndarray | int, ends: np.ndarray | int, shares: np.ndarray | int
    ) -> np.ndarray:
        """``F``: the peak of a running forward of stages ``[starts, ends)`` on ``shares``
        samples (element-wise): linear between profiled sizes, through zero below the
        smallest and proportional above the largest, as :func:`at_batch_sizes` reads."""
        values = np.moveaxis(self._running[:, starts, ends], 0, -1)  # [..., size]
        shape = np.broadcast_shapes(values.shape[:-1], np.shape(shares))
        values = np.broadcast_to(values, (*shape, values.shape[-1]))
        ys = np.broadcast_to(np.asarray(shares, dtype=np.float64), shape)
        sizes = self._sizes
        xp = np.concatenate(([0.0], sizes))
        k = np.clip(np.searchsorted(xp, ys, side="right") - 1, 0, len(xp) - 2)
        low = np.take_along_axis(values, np.maximum(k - 1, 0)[..., None], -1)[..., 0]
        low = np.where(k == 0, 0.0, low)
        high = np.take_along_axis(values, k[..., None], -1)[..., 0]
        inside = low + (ys - xp[k]) / (xp[k + 1] - xp[k]) * (high - low)
        return np.where(ys > sizes[-1], values[..., -1] * ys / sizes[-1], inside)

    def memory_bytes(self, start: int, end: int, share: int, warmup: int) -> float:
        """Asteroid's eq. 3 with the running forward or the optimizer's step: ``MOD +
        OPT + K x ACT(share) + max(F(share), step)`` with ``K = warmup``."""
        return self.static_bytes(start, end) + self._activations(start, end, warmup)[share]

    def _activations(self, start: int, end: int, warmup: int) -> list[float]:
        """``K x ACT(y) + max(F(y), step)`` of units ``[start, end)`` at every share
        ``0..B`` (never decreasing)."""
        key = (start, end, warmup)
        row = self._activation_rows.get(key)
        if row is None:
            shares = np.arange(self.microbatch_size + 1)
            saved = self._saved[:, end] - self._saved[:, start]
            running = self.running_bytes(start, end, shares)
            transient = np.maximum(running, self.step_copies * self.weight_bytes(start, end))
            row = self._activation_rows[key] = (warmup * saved + transient).tolist()
        return row

    def max_share(self, device: ClusterDevice, start: int, end: int, warmup: int) -> int:
        """The most samples ``device`` can run of units ``[start, end)`` with ``warmup``
        micro-batches in flight (capped at B); -1 if even the weights do not fit."""
        if device.memory_bytes is None:
            return self.microbatch_size
        room = device.memory_bytes - self.static_bytes(start, end)
        if room < 0:
            return -1
        return bisect.bisect_right(self._activations(start, end, warmup), room) - 1

    def max_shares(
        self, device: ClusterDevice, starts: np.ndarray, ends: np.ndarray, warmup: int
    ) -> np.ndarray:
        """:meth:`max_share` of the stages ``[starts[r], ends[r])`` at once (the same
        arithmetic and the same binary search, so the same answers)."""
        starts, ends = np.asarray(starts), np.asarray(ends)
        b = self.microbatch_size
        if device.memory_bytes is None:
            return np.full(starts.shape, b, dtype=np.int64)
        weights = self._weights[ends] - self._weights[starts]
        room = device.memory_bytes - (2 + self.state_copies) * weights
        step = self.step_copies * weights
        # bisect.bisect_right over the shares 0..B, row by row
        lo = np.zeros(starts.shape, dtype=np.int64)
        hi = np.full(starts.shape, b + 1, dtype=np.int64)
        while True:
            searching = lo < hi
            if not searching.any():
                break
            mid = (lo + hi) // 2
            at = np.minimum(mid, b)
            need = warmup * (self._saved[at, ends] - self._saved[at, starts])
            below = room < need + np.maximum(self.running_bytes(starts, ends, at), step)
            hi = np.where(searching & below, mid, hi)
            lo = np.where(searching & ~below, mid + 1, lo)
        return np.where(room < 0, -1, lo - 1)

    # -- communication ------------------------------------------------------------------

    def bandwidth_bps(self, u: str, v: str) -> float:
        """:meth:`ClusterSpec.bandwidth_bps`, remembered: the planners ask for it often."""
        bw = self._bandwidth.get((u, v))
        if bw is None:
            bw = self._bandwidth[u, v] = self.cluster.bandwidth_bps(u, v)
        return bw

    def min_bandwidth_bps(self, senders: Sequence[str], receivers: Sequence[str]) -> float:
        """The slowest link from a sender to a receiver (distinct devices only)."""
        links = [self.bandwidth_bps(u, v) for u in senders for v in receivers if u != v]
        return min(links, default=math.inf)

    def allreduce_s(self, devices: Sequence[str], start: int, end: int) -> float:
        """Asteroid's eq. 5: a ring all-reduce of the stage's gradients over ``devices``."""
        n = len(devices)
        if n < 2:
            return 0.0
        bandwidth = self.min_bandwidth_bps(devices, devices)
        volume = 2.0 * (n - 1) / n * self.weight_bytes(start, end) * 8.0
        return volume / bandwidth if bandwidth != math.inf else 0.0

    def boundary_bytes(self, end: int, samples: int | None = None) -> float:
        """The output of unit ``end - 1`` for ``samples`` samples (default: a micro-batch)."""
        y = self.microbatch_size if samples is None else samples
        return float(self._out[y, end - 1])

    def transfer_s(
        self, senders: Sequence[str], receivers: Sequence[str], end: int
    ) -> tuple[float, float]:
        """(activations forward, gradients back) between two consecutive stages' groups.

        ``end`` is the boundary: the sending stage's last unit is ``end - 1``.
        """
        bits = self.boundary_bytes(end) * 8.0
        forward = self.min_bandwidth_bps(senders, receivers)
        backward = self.min_bandwidth_bps(receivers, senders)
        return (
            bits / forward if forward != math.inf else 0.0,
            bits / backward if backward != math.inf else 0.0,
        )


# -- a stage's group, and the round (eq. 4-8) -------------------------------------------


@dataclass(frozen=True)
class GroupCost:
    """A stage on a device group with given shares: eq. 8's E_f, E_b, eq. 5, eq. 3."""

    devices: tuple[str, ...]
    shares: tuple[int, ...]
    forward_s: float
    backward_s: float
    allreduce_s: float
    memory_bytes: tuple[float, ...]  # per device, eq. 3

    @property
    def step_s(self) -> float:
        return self.forward_s + self.backward_s


def group_cost(
    costs: TrainingCosts,
    devices: Sequence[ClusterDevice],
    start: int,
    end: int,
    shares: Sequence[int],
    warmup: int,
) -> GroupCost:
    """The costs of units ``[start, end)`` on ``devices`` running ``shares`` samples each."""
    names = tuple(d.name for d in devices)
    pairs = list(zip(devices, shares, strict=True))
    return GroupCost(
        devices=names,
        shares=tuple(shares),
        forward_s=max(costs.forward_s(d, start, end, y) for d, y in pairs),
        backward_s=max(costs.backward_s(d, start, end, y) for d, y in pairs),
        allreduce_s=costs.allreduce_s(names, start, end),
        memory_bytes=tuple(costs.memory_bytes(start, end, y, warmup) for y in shares),
    )


def evaluate_group(
    costs: TrainingCosts,
    devices: Sequence[ClusterDevice],
    start: int,
    end: int,
    warmup: int,
    *,
    block: int = 1,
) -> GroupCost | None:
    """Algorithm 1's shares for units ``[start, end)`` on ``devices``, and their costs.

    None when the group cannot run the stage: a device cannot hold the
    stage's weights and optimizer state, or the group's memory cannot hold
    ``warmup`` micro-batches' activations.
    """
    caps = [costs.max_share(d, start, end, warmup) for d in devices]
    if min(caps) < 0 or sum(caps) < costs.microbatch_size:
        return None
    if len(devices) == 1:  # Algorithm 1 has nothing to balance
        return group_cost(costs, devices, start, end, (costs.microbatch_size,), warmup)
    times = [costs.step_times(d, start, end).tolist() for d in devices]
    shares = allocate_microbatch(times, caps, costs.microbatch_size, block=block)
    if shares is None:
        return None
    return group_cost(costs, devices, start, end, shares, warmup)


def estimate_round_s(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    allreduce_s: Sequence[float],
    num_microbatches: int,
) -> float:
    """Asteroid's HPP-round latency (eq. 4-6) of a pipeline given as its steps.

    Steps alternate: execution step (a stage), communication step (the
    transfer to the next stage), execution step, ...; ``forward_s[s]`` and
    ``backward_s[s]`` are E_f^s and E_b^s for one micro-batch, ``allreduce_s[s]``
    is T_a^s (0 for communication steps). The dominant step ``dm`` is the one
    with the largest aligned execution time ``M (E_f^s + E_b^s) + sum_{i<s}
    (E_f^i + E_b^i)`` (the one with the fewest bubbles; eq. 11 compares these);
    eq. 6 then gives every step's execution phase ``T_e^s`` from it, eq. 5 the
    waiting phase ``T_w^s = sum_{i<s} E_f^i``, and the round is the largest
    ``T_w^s + T_e^s + T_a^s`` (eq. 4).
    """
    m = num_microbatches
    steps = [f + b for f, b in zip(forward_s, backward_s, strict=True)]
    before = [0.0]
    for e in steps:
        before.append(before[-1] + e)
    aligned = [m * steps[s] + before[s] for s in range(len(steps))]
    dm = max(range(len(steps)), key=lambda s: (aligned[s], -s))
    waiting = 0.0
    worst = 0.0
    for s in range(len(steps)):
        if s < dm:
            execution = m * steps[dm] + (before[dm] - before[s])  # eq. 6, s < dm
        else:
            execution = m * steps[dm] - (before[s] - before[dm])  # eq. 6, s >= dm
        worst = max(worst, waiting + execution + allreduce_s[s])
        waiting += forward_s[s]
    return worst


# -- predictions for any plan -----------------------------------------------------------


def stage_costs(
    costs: TrainingCosts, stages: Sequence[TrainStage]
) -> tuple[list[GroupCost], list[tuple[float, float]]]:
    """Each stage's group costs at its shares, and each link's (forward, backward) transfer."""
    cluster = costs.cluster
    groups = [
        group_cost(
            costs, [cluster.device(d) for d in s.devices], s.start, s.end, s.shares, s.warmup
        )
        for s in stages
    ]
    links = [costs.transfer_s(a.devices, b.devices, a.end) for a, b in pairwise(stages)]
    return groups, links


def estimate_stages_round_s(
    groups: Sequence[GroupCost], links: Sequence[tuple[float, float]], num_microbatches: int
) -> float:
    """:func:`estimate_round_s` of stages and the links between them."""
    forward, backward, allreduce = [], [], []
    for s, group in enumerate(groups):
        if s > 0:  # the communication step in front of this stage
            forward.append(links[s - 1][0])
            backward.append(links[s - 1][1])
            allreduce.append(0.0)
        forward.append(group.forward_s)
        backward.append(group.backward_s)
        allreduce.append(group.allreduce_s)
    return estimate_round_s(forward, backward, allreduce, num_microbatches)


def predict_training(plan: TrainingPlan, costs: TrainingCosts) -> dict[str, float]:
    """What ``plan`` costs under this model; works for any plan, a planner's or a user's.

    ``round_s`` (one mini-batch) comes from the schedule simulator
    (:func:`zpipe.planner.schedules.simulate`) run on the stages' eq. 8
    times, the links' transfer times and eq. 5's all-reduces;
    ``estimate_round_s`` is the planners' closed form (eq. 4-6). Also:
    ``samples_per_s``, ``bubble_fraction``, ``memory_violations`` (devices whose
    eq. 3 memory exceeds what they have), and per stage ``stage{i}_forward_s``,
    ``stage{i}_backward_s``, ``stage{i}_allreduce_s``, ``stage{i}_send_forward_s``
    and ``stage{i}_send_backward_s`` (to and from the next stage),
    ``stage{i}_memory_bytes`` (the group's fullest device) and
    ``stage{i}_peak_microbatches`` (activations held at once, from the simulator).
    """
    if plan.num_units != costs.num_units or plan.microbatch_size != costs.microbatch_size:
        raise ConfigError(
            f"the plan is for {plan.num_units} units and micro-batches of "
            f"{plan.microbatch_size}, the cost model for {costs.num_units} and "
            f"{costs.microbatch_size}"
        )
    groups, links = stage_costs(costs, plan.stages)
    m = plan.num_microbatches
    multi = any(len(s.devices) > 1 for s in plan.stages)
    actions = pipeline_actions(
        plan.schedule,
        num_stages=plan.num_stages,
        num_microbatches=m,
        warmups=plan.warmups,
        data_parallel=multi,
    )
    result = simulate(
        actions,
        [g.forward_s for g in groups],
        [g.backward_s for g in groups],
        [f for f, _ in links],
        [b for _, b in links],
        [g.allreduce_s for g in groups],
    )
    pred: dict[str, float] = {
        "round_s": result.round_s,
        "estimate_round_s": estimate_stages_round_s(groups, links, m),
        "samples_per_s": plan.minibatch_size / result.round_s if result.round_s > 0 else math.inf,
        "bubble_fraction": result.bubble_fraction,
        "num_stages": float(plan.num_stages),
        "num_devices": float(len(plan.devices)),
    }
    violations = 0
    for i, (stage, group) in enumerate(zip(plan.stages, groups, strict=True)):
        link = links[i] if i < len(links) else (0.0, 0.0)
        pred[f"stage{i}_forward_s"] = group.forward_s
        pred[f"stage{i}_backward_s"] = group.backward_s
        pred[f"stage{i}_allreduce_s"] = group.allreduce_s
        pred[f"stage{i}_send_forward_s"] = link[0]
        pred[f"stage{i}_send_backward_s"] = link[1]
        pred[f"stage{i}_memory_bytes"] = max(group.memory_bytes)
        pred[f"stage{i}_peak_microbatches"] = float(result.peak_live_activations[i])
        for name, need in zip(stage.devices, group.memory_bytes, strict=True):
            cap = costs.cluster.device(name).memory_bytes
            violations += cap is not None and need > cap
    pred["memory_violations"] = float(violations)
    return pred
