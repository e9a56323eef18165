"""GPipe with vertical allocation: Fig. 7's micro-batch baseline (section VI).

GPipe splits each mini-batch into ``K`` micro-batches (the paper: as many as
devices), pipelines the micro-batches through the layers, runs their
backward passes, and applies one synchronous update per mini-batch (the
*flush*): every forward of a mini-batch uses the same weights and the next
mini-batch starts only after the update. Lossless, that is plain mini-batch
SGD, so a lossless GPipe run reaches the weights of the sequential reference.

The timeslot model is :mod:`zpipe.lossy.schedule`'s: one pass of one layer
per timeslot, all owners of a layer running it together, a message consumed
one timeslot after it was sent, and no device running two passes in one
timeslot. Within a mini-batch the passes are placed greedily, earliest
first: forwards in micro-batch order, then backwards in reverse micro-batch
order (GPipe's). With one device per layer (vertical, ``N >= L``) the
forward of layer ``l`` for micro-batch ``j`` (both 0-based) lands in timeslot
``l + j`` and its backward in ``(L + K - 1) + (L - 1 - l) + (K - 1 - j)``, so
a mini-batch takes ``2L - 1 + 2(K - 1)`` timeslots, and ``N`` of them ``N``
times that (the flush leaves no overlap). ``K = 1`` is model parallelism
without pipelining (:func:`zpipe.lossy.schedule.sequential_period`).

Timeslot duration, as section VI derives GPipe's: the compute is vertical's
divided by the number of micro-batches, but each micro-batch still sends a
whole message (equation 4 sizes a message by neurons, not rows), so the
airtime and the margin stay: ``C / K + A + m``. Over a mini-batch that is
``K`` times the communication ("more communication overhead ... with a factor
of the number of splits").

Micro-batch ``j`` of mini-batch ``i`` is step ``(i - 1) K + j + 1`` for the
links' seeded drop decisions and the engine's inboxes. Its rows are
``numpy.array_split`` of the mini-batch's rows; its gradient is the mean over
its own rows, so its learning rate is scaled by its share of the mini-batch's
rows (the sum of the updates is the mini-batch mean's). Recovery schemes are
not modelled for GPipe (its baseline in the paper sends once).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from zpipe._errors import ConfigError
from zpipe.lossy.airtime import SlotClock
from zpipe.lossy.partition import Allocation
from zpipe.lossy.schedule import (
    MARGIN_MS,
    PI2_MS_PER_MAC,
    PassKind,
    message_airtime_ms,
    worst_forward_macs,
)

#: a tolerance on budgets: N mini-batches' time given back as a budget gives N
_BUDGET_RTOL = 1e-9


@dataclass(frozen=True, order=True)
class MicroPass:
    """One pass of one layer for one micro-batch (0-based ``micro``) of a mini-batch."""

    timeslot: int
    kind: PassKind
    layer: int
    micro: int


def _owner_sets(alloc: Allocation) -> list[frozenset[int]]:
    return [
        frozenset(k for k, sn in enumerate(alloc.super_neurons) if sn.slice_of(layer) is not None)
        for layer in range(alloc.n_layers)
    ]


def gpipe_template(alloc: Allocation, micro: int) -> list[MicroPass]:
    """One mini-batch's passes, in timeslot order, starting at timeslot 0."""
    if micro < 1:
        raise ConfigError(f"GPipe needs at least one micro-batch, got {micro}")
    owners = _owner_sets(alloc)
    busy: dict[int, set[int]] = {}  # super neuron -> occupied timeslots
    placed: dict[tuple[PassKind, int, int], int] = {}

    def place(kind: PassKind, layer: int, j: int, earliest: int) -> None:
        slot = earliest
        while any(slot in busy.get(k, ()) for k in owners[layer]):
            slot += 1
        for k in owners[layer]:
            busy.setdefault(k, set()).add(slot)
        placed[(kind, layer, j)] = slot

    last = alloc.n_layers - 1
    for j in range(micro):
        for layer in range(last + 1):
            place("F", layer, j, placed[("F", layer - 1, j)] + 1 if layer else 0)
    for j in reversed(range(micro)):
        for layer in range(last, 0, -1):
            after = placed[("F", last, j)] if layer == last else placed[("B", layer + 1, j)]
            place("B", layer, j, after + 1)
    return sorted(MicroPass(slot, kind, layer, j) for (kind, layer, j), slot in placed.items())


def gpipe_period(alloc: Allocation, micro: int) -> int:
    """Timeslots per mini-batch, flush included (the next one starts after)."""
    return max(p.timeslot for p in gpipe_template(alloc, micro)) + 1


def split_micro(rows: npt.NDArray[np.int64], micro: int) -> list[npt.NDArray[np.int64]]:
    """A mini-batch's rows cut into ``micro`` contiguous parts (sizes differ by <= 1)."""
    if not 1 <= micro <= len(rows):
        raise ConfigError(f"cannot split {len(rows)} rows into {micro} micro-batches")
    return [np.asarray(part) for part in np.array_split(rows, micro)]


def step_id(data: int, j: int, micro: int) -> int:
    """The 1-based step number of micro-batch ``j`` (0-based) of mini-batch ``data``."""
    return (data - 1) * micro + j + 1


def gpipe_timeslot_ms(
    alloc: Allocation, micro: int, *, ms_per_mac: float = PI2_MS_PER_MAC
) -> float:
    """``C / K + A + m``: compute split over micro-batches, a whole message each."""
    return worst_forward_macs(alloc) * ms_per_mac / micro + message_airtime_ms(alloc) + MARGIN_MS


def gpipe_clock(alloc: Allocation, micro: int, n_data: int) -> SlotClock:
    """Every timeslot of ``n_data`` mini-batches lasts the same (one send each)."""
    if n_data < 1:
        raise ConfigError(f"need at least one mini-batch, got {n_data}")
    air_ms = message_airtime_ms(alloc)
    base_ms = gpipe_timeslot_ms(alloc, micro) - air_ms
    n_slots = n_data * gpipe_period(alloc, micro)
    durations = np.full(n_slots, (base_ms + air_ms) / 1000.0)
    return SlotClock(base_ms / 1000.0, air_ms / 1000.0, durations)


def gpipe_data_within(alloc: Allocation, micro: int, budget_s: float, *, max_data: int) -> int:
    """How many mini-batches finish within ``budget_s`` (at least one)."""
    if not budget_s > 0 or not np.isfinite(budget_s):
        raise ConfigError(f"budget must be a positive number of seconds, got {budget_s}")
    per_batch_s = gpipe_period(alloc, micro) * gpipe_timeslot_ms(alloc, micro) / 1000.0
    n = max(1, int(budget_s * (1.0 + _BUDGET_RTOL) // per_batch_s))
    if n > max_data:
        raise ConfigError(
            f"a budget of {budget_s:g} s fits more than {max_data} mini-batches; "
            "give a shorter budget"
        )
    return n


@dataclass(frozen=True)
class GPipeStep:
    """A pass of the whole run: the template's pass shifted to its mini-batch."""

    timeslot: int
    kind: PassKind
    layer: int
    data: int
    micro: int
    step: int


def gpipe_steps(alloc: Allocation, micro: int, n_data: int) -> list[GPipeStep]:
    """Every pass of ``n_data`` mini-batches, in timeslot order."""
    template: Sequence[MicroPass] = gpipe_template(alloc, micro)
    period = max(p.timeslot for p in template) + 1
    return [
        GPipeStep(
            (i - 1) * period + p.timeslot,
            p.kind,
            p.layer,
            i,
            p.micro,
            step_id(i, p.micro, micro),
        )
        for i in range(1, n_data + 1)
        for p in template
    ]
