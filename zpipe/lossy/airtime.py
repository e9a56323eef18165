"""What each timeslot costs on the air, recovery copies and acknowledgements included.

Section VI sizes one timeslot as the worst forward compute, plus the airtime
of the largest message at 250 kb/s (equation 4), plus a 100 ms margin:
``tau = C + A + m`` (:func:`zpipe.lossy.schedule.timeslot_ms`). That is one
transmission per timeslot. A recovery scheme puts more on the air, and this
module charges it, slot by slot, so a scheme that retransmits finishes fewer
mini-batches in the same simulated time:

- a sending device broadcasts its result once per *round*; all devices send in
  parallel within the slot (the paper's model: one message's airtime per slot
  whatever the number of senders and receivers);
- with no recovery every sender makes one round: the slot is ``C + A + m``,
  exactly today's;
- r-TX sends every message ``copies`` times: ``copies`` rounds;
- ACK resends until every receiver's acknowledgement came back or the
  attempts are spent (:func:`zpipe.lossy.links.deliver`, the same seeded
  decisions the training uses): a sender makes as many rounds as its worst
  receiver needed, and each acknowledgement (an 11-byte 802.15.4 ACK frame,
  sent one after another to that sender) costs ``a``;
- a slot lasts until its busiest sender is done::

      duration(t) = C + m + max(A, max over senders s in t of (rounds_s A + acks_s a))

So a slot where nobody crosses a link still costs ``C + A + m`` (the fixed
slot of the paper), and the extra copies and acknowledgements add to it.
Lossless runs deliver everything once (like :class:`~zpipe.lossy.engine.LinkChannel`).
Test-time inference happens off the training clock.

A timeslot's messages depend on who owns what, not on the values, so the
whole clock is known before training: :func:`plan_clock` for a number of
mini-batches, :func:`data_within_budget` for a time budget.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from zpipe._errors import ConfigError
from zpipe.lossy.links import Direction, Recovery, deliver
from zpipe.lossy.partition import Allocation
from zpipe.lossy.schedule import (
    LINK_BITS_PER_S,
    PassKind,
    compute_margin_ms,
    message_airtime_ms,
    pass_offset,
    pipeline_period,
)

#: an IEEE 802.15.4 immediate ACK: 5-byte MPDU + 6 bytes of preamble, SFD and length
ACK_FRAME_BITS = 11 * 8
ACK_AIRTIME_MS = ACK_FRAME_BITS / LINK_BITS_PER_S * 1000.0
#: a tolerance on budgets: N timeslots' time given back as a budget must fit N slots
_BUDGET_RTOL = 1e-9


@dataclass(frozen=True)
class LinkCosts:
    """What decides each message's transmissions: the links, the seed, the scheme."""

    prr: npt.NDArray[np.float64]
    seed: int
    recovery: Recovery = field(default_factory=Recovery)
    lossless: bool = False

    @property
    def single_round(self) -> bool:
        """Every sender makes one round and nobody acknowledges: the paper's slot."""
        return self.lossless or self.recovery.scheme == "none"


@dataclass(frozen=True)
class SlotClock:
    """Durations of a run's timeslots, in seconds."""

    base_s: float
    message_s: float
    durations_s: npt.NDArray[np.float64]
    starts_s: npt.NDArray[np.float64] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        starts = np.concatenate([[0.0], np.cumsum(self.durations_s)])
        object.__setattr__(self, "starts_s", starts)

    @property
    def n_slots(self) -> int:
        return int(self.durations_s.shape[0])

    @property
    def total_s(self) -> float:
        return float(self.starts_s[-1])

    @property
    def airtime_s(self) -> float:
        """Time on the air: every slot's duration less its compute and margin."""
        return float(self.total_s - self.base_s * self.n_slots)

    def time_at(self, slot: int) -> float:
        """Seconds from the start to the beginning of ``slot`` (``n_slots``: the end)."""
        return float(self.starts_s[min(max(slot, 0), self.n_slots)])


class AirtimeLedger:
    """The airtime of every slot as mini-batches are added in order ``1, 2, ...``.

    Mini-batch ``i`` only touches slots from ``(i - 1) T`` on, so once ``i`` is
    added every slot before ``i T`` is final.
    """

    def __init__(self, alloc: Allocation, links: LinkCosts, *, period: int) -> None:
        from zpipe.lossy.shard import Topology

        if period < 1:
            raise ConfigError(f"pipeline period must be >= 1, got {period}")
        self.alloc = alloc
        self.links = links
        self.period = period
        self.message_ms = message_airtime_ms(alloc)
        self._topology = Topology(alloc)
        self._air_ms: list[float] = []
        self._added = 0
        # r-TX's cost does not depend on the mini-batch: remember it per (pass, sender).
        self._memo: dict[tuple[PassKind, int, int], float] = {}
        last = alloc.n_layers - 1
        self._passes: list[tuple[PassKind, int]] = [("F", layer) for layer in range(last + 1)]
        self._passes += [("B", layer) for layer in range(last, 0, -1)]

    @property
    def added(self) -> int:
        return self._added

    def add_next(self) -> None:
        """Charge the passes of the next mini-batch."""
        self._added += 1
        data = self._added
        n_layers = self.alloc.n_layers
        for kind, layer in self._passes:
            slot = (data - 1) * self.period + pass_offset(kind, layer, n_layers)
            while len(self._air_ms) <= slot:
                self._air_ms.append(self.message_ms)
            for sender, _ in self._topology.owners[layer]:
                cost = self._sender_cost_ms(kind, layer, sender, data)
                if cost > self._air_ms[slot]:
                    self._air_ms[slot] = cost

    def air_ms(self, start: int, stop: int) -> list[float]:
        """Airtime of slots ``[start, stop)`` (an untouched slot costs one message)."""
        out = self._air_ms[start:stop]
        return out + [self.message_ms] * (stop - start - len(out))

    def _sender_cost_ms(self, kind: PassKind, layer: int, sender: int, data: int) -> float:
        if self.links.single_round:
            return self.message_ms
        recovery = self.links.recovery
        if recovery.scheme == "rtx":
            key = (kind, layer, sender)
            if key not in self._memo:
                crosses = any(True for _ in self._messages(kind, layer, sender))
                self._memo[key] = recovery.copies * self.message_ms if crosses else 0.0
            return self._memo[key]
        rounds = acks = 0
        prr = self.links.prr
        for dst, key_layer, direction in self._messages(kind, layer, sender):
            d = deliver(
                self.links.seed,
                sender,
                dst,
                key_layer,
                data,
                direction,
                prr=float(prr[sender, dst]),
                prr_back=float(prr[dst, sender]),
                recovery=recovery,
            )
            rounds = max(rounds, d.data_tx)
            acks += d.ack_tx
        return rounds * self.message_ms + acks * ACK_AIRTIME_MS

    def _messages(self, kind: PassKind, layer: int, sender: int) -> Iterator[tuple[int, int, int]]:
        """``(receiver, drop-key layer, direction)`` of what a pass sends across links
        (the messages :class:`zpipe.lossy.shard.DeviceShard` posts)."""
        topo = self._topology
        if kind == "F":
            direction = Direction.FORWARD if layer < topo.last else Direction.SHARE
            receivers = topo.receivers[layer]
        else:
            direction = Direction.BACKWARD
            receivers = [d for d, _ in topo.owners[layer - 1]] if layer >= 2 else []
        for dst in receivers:
            if dst != sender:
                yield dst, layer, int(direction)


def end_slot(alloc: Allocation, n_data: int, period: int) -> int:
    """Timeslots ``n_data`` mini-batches take at ``period`` (Theorem 1 when pipelined)."""
    return (n_data - 1) * period + 2 * alloc.n_layers - 1


def plan_clock(
    alloc: Allocation, links: LinkCosts, n_data: int, *, period: int | None = None
) -> SlotClock:
    """The slot durations of training ``n_data`` mini-batches."""
    if n_data < 1:
        raise ConfigError(f"need at least one mini-batch, got {n_data}")
    period = pipeline_period(alloc) if period is None else period
    base_s = compute_margin_ms(alloc) / 1000.0
    n_slots = end_slot(alloc, n_data, period)
    ledger = AirtimeLedger(alloc, links, period=period)
    if links.single_round:
        air = np.full(n_slots, ledger.message_ms)
    else:
        for _ in range(n_data):
            ledger.add_next()
        air = np.asarray(ledger.air_ms(0, n_slots), dtype=np.float64)
    return SlotClock(base_s, ledger.message_ms / 1000.0, base_s + air / 1000.0)


def data_within_budget(
    alloc: Allocation,
    links: LinkCosts,
    budget_s: float,
    *,
    period: int | None = None,
    max_data: int,
) -> int:
    """How many mini-batches finish within ``budget_s`` (at least one).

    A budget of exactly ``N`` mini-batches' time gives ``N`` (up to a relative
    ``1e-9``, so the float product read back does not lose the last one).
    Refuses a budget that would need more than ``max_data`` mini-batches.
    """
    if not budget_s > 0 or not np.isfinite(budget_s):
        raise ConfigError(f"budget must be a positive number of seconds, got {budget_s}")
    period = pipeline_period(alloc) if period is None else period
    limit = budget_s * (1.0 + _BUDGET_RTOL)
    base_ms = compute_margin_ms(alloc)
    ledger = AirtimeLedger(alloc, links, period=period)

    def too_many() -> ConfigError:
        return ConfigError(
            f"a budget of {budget_s:g} s fits more than {max_data} mini-batches; "
            "give a shorter budget"
        )

    if links.single_round:
        slot_s = (base_ms + ledger.message_ms) / 1000.0
        slots = int(limit // slot_s)
        first = 2 * alloc.n_layers - 1
        n = 1 if slots < first else 1 + (slots - first) // period
        if n > max_data:
            raise too_many()
        return n
    final_ms = 0.0  # airtime of the slots no later mini-batch touches
    final_upto = 0
    n = 0
    while True:
        if n + 1 > max_data:
            raise too_many()
        ledger.add_next()
        end = end_slot(alloc, n + 1, period)
        settled = (n + 1) * period
        final_ms += sum(ledger.air_ms(final_upto, settled))
        final_upto = settled
        total_ms = base_ms * end + final_ms + sum(ledger.air_ms(settled, end))
        if total_ms / 1000.0 > limit:
            return max(n, 1)
        n += 1
