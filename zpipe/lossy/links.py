"""Which messages a lossy link delivers: a pure, reproducible decision.

Every decision is a function of ``(seed, src, dst, layer, step, direction,
attempt)`` and the link's reception ratio, never of a shared random stream.
So the in-process simulation and a later multi-process run drop exactly the
same messages, whatever order the processes run in: the simulation asks the
function directly (:func:`deliver`), while a stage hands every copy to its
emulated link (:class:`zpipe.transport.emulation.KeyedLinks`), which is given the
same function as its keyed loss decision (:func:`seeded_link_loss`) and drops
the copy itself. Both run one recovery procedure (:func:`deliver_over`) over
"does this copy arrive", so they count the same transmissions too.

The hash is SplitMix64 over the fields: stable across platforms, Python and
numpy versions, and a few microseconds per message.

Recovery schemes (EdgePipe Fig. 9(f)):

- ``none``: one transmission;
- ``rtx``: the message is sent ``copies`` times (the paper: twice); it arrives
  if any copy does;
- ``ack``: send, and resend until the receiver's acknowledgement comes back or
  ``max_attempts`` transmissions (the timeslot's deadline) are spent; an
  acknowledgement crosses the reverse link and can be lost too, which costs a
  needless retransmission.

Every transmission is counted (:class:`Traffic`), acknowledgements apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Literal

import numpy as np
import numpy.typing as npt

from zpipe._errors import ConfigError
from zpipe.transport.emulation import KeyedLoss, LossKey

#: Puts one copy on its link and says whether it arrived.
Transmit = Callable[[LossKey], bool]

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


class Direction(IntEnum):
    """What a message carries; part of its drop key."""

    FORWARD = 0  # a slice of a layer's outputs, to the next layer's owners
    BACKWARD = 1  # a partial gradient sum, to the previous layer's owners
    SHARE = 2  # an output-layer slice of logits, to the other output owners
    TEST_FORWARD = 3  # forward during a (lossy) test pass
    TEST_SHARE = 4  # output sharing during a test pass
    ACK = 5  # an acknowledgement of a data message (ACK scheme)
    PROBE = 6  # a link-measurement probe (EdgePipe: 50 per link)


RecoveryScheme = Literal["none", "rtx", "ack"]
RECOVERY_SCHEMES: tuple[RecoveryScheme, ...] = ("none", "rtx", "ack")


@dataclass(frozen=True)
class Recovery:
    """A recovery scheme and its parameters."""

    scheme: RecoveryScheme = "none"
    copies: int = 2
    max_attempts: int = 4

    def __post_init__(self) -> None:
        if self.scheme not in RECOVERY_SCHEMES:
            raise ConfigError(
                f"unknown recovery {self.scheme!r}; choose one of {', '.join(RECOVERY_SCHEMES)}"
            )
        if self.copies < 1:
            raise ConfigError(f"r-TX copies must be >= 1, got {self.copies}")
        if self.max_attempts < 1:
            raise ConfigError(f"ACK max attempts must be >= 1, got {self.max_attempts}")


@dataclass(frozen=True)
class Delivery:
    """The fate of one logical message."""

    delivered: bool
    data_tx: int
    ack_tx: int


def splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def drop_uniform(
    seed: int, src: int, dst: int, layer: int, step: int, direction: int, attempt: int = 0
) -> float:
    """A uniform number in ``[0, 1)`` fixed by the message's identity.

    ``layer`` is the layer of the action that sends (forward: the layer whose
    outputs travel; backward: the layer whose gradient is being propagated
    down); ``step`` is the data (mini-batch) id, or a test batch id.
    """
    h = splitmix64(seed & _MASK)
    for field in (src, dst, layer, step, int(direction), attempt):
        if field < 0:
            raise ConfigError(f"drop-key fields must be non-negative, got {field}")
        h = splitmix64(h ^ field)
    return (h >> 11) * (1.0 / (1 << 53))


def copy_lost(seed: int, key: LossKey, prr: float) -> bool:
    """Whether the transmission ``key`` names is lost on a link of reception ratio ``prr``."""
    return not drop_uniform(seed, *key) < prr


def seeded_link_loss(seed: int, prr: npt.NDArray[np.float64]) -> KeyedLoss:
    """The keyed loss decision of a run's links (``prr[a, b]``: device a to b): what
    an emulated link is given, and what :func:`deliver` asks."""
    ratios = np.asarray(prr, dtype=np.float64)

    def lost(key: LossKey) -> bool:
        return copy_lost(seed, key, float(ratios[key.src, key.dst]))

    return lost


def deliver(
    seed: int,
    src: int,
    dst: int,
    layer: int,
    step: int,
    direction: int,
    *,
    prr: float,
    prr_back: float | None = None,
    recovery: Recovery = Recovery(),
) -> Delivery:
    """Whether a message from ``src`` to ``dst`` arrives, and what it cost.

    ``prr`` is the reception ratio ``src -> dst``; ``prr_back`` (``dst ->
    src``, default the same) matters only for ACK's acknowledgements. A
    message to oneself never touches a link.
    """
    back = prr if prr_back is None else prr_back

    def arrives(key: LossKey) -> bool:
        return not copy_lost(seed, key, prr if key.src == src else back)

    return deliver_over(arrives, src, dst, layer, step, direction, recovery=recovery)


def ack_key(data: LossKey) -> LossKey:
    """The drop key of the acknowledgement of the copy ``data`` names: the reverse link,
    the same layer, step and copy, and the data's direction shifted into the ACK space,
    so an acknowledgement's fate never correlates with its data message's."""
    return LossKey(
        data.dst, data.src, data.layer, data.step, int(Direction.ACK) * 8 + data.kind, data.copy
    )


def deliver_over(
    transmit: Transmit,
    src: int,
    dst: int,
    layer: int,
    step: int,
    direction: int,
    *,
    recovery: Recovery = Recovery(),
) -> Delivery:
    """A recovery scheme's transmissions of one message, each copy handed to
    ``transmit`` (which says whether it arrived): whether the message arrives, and
    what it cost. An acknowledgement is a copy on the reverse link."""
    if src == dst:
        return Delivery(True, 0, 0)

    def copy(attempt: int) -> bool:
        return transmit(LossKey(src, dst, layer, step, int(direction), attempt))

    if recovery.scheme == "none":
        return Delivery(copy(0), 1, 0)
    if recovery.scheme == "rtx":
        # every copy goes on the link, even after one has arrived
        arrived = [copy(attempt) for attempt in range(recovery.copies)]
        return Delivery(any(arrived), recovery.copies, 0)
    delivered = False
    acks = 0
    for attempt in range(recovery.max_attempts):
        if copy(attempt):
            delivered = True
            acks += 1
            if transmit(ack_key(LossKey(src, dst, layer, step, int(direction), attempt))):
                return Delivery(True, attempt + 1, acks)
    return Delivery(delivered, recovery.max_attempts, acks)


@dataclass
class Traffic:
    """Counts of logical messages and of the transmissions they cost."""

    messages: int = 0
    delivered: int = 0
    data_tx: int = 0
    ack_tx: int = 0

    def add(self, d: Delivery) -> None:
        self.messages += 1
        self.delivered += int(d.delivered)
        self.data_tx += d.data_tx
        self.ack_tx += d.ack_tx

    @property
    def delivery_rate(self) -> float:
        return self.delivered / self.messages if self.messages else 1.0

    @property
    def tx_factor(self) -> float:
        """Transmissions (data and acknowledgements) per logical message."""
        return (self.data_tx + self.ack_tx) / self.messages if self.messages else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "messages": self.messages,
            "delivered": self.delivered,
            "data_tx": self.data_tx,
            "ack_tx": self.ack_tx,
            "delivery_rate": self.delivery_rate,
            "tx_factor": self.tx_factor,
        }
