"""The timeslot pipeline (EdgePipe equation 2, Theorem 1, Tables II-III).

Time is cut into equal timeslots. Mini-batch ``i`` (1-based, the paper's
data id) runs its forward pass of layer ``l`` (0-based, layer 0 is the input,
whose "forward" only sends the input slice on) in timeslot ``(i-1) T + l``
and its backward pass of layer ``l >= 1`` in timeslot ``(i-1) T + 2L - 1 - l``,
so each pass consumes what the previous one sent a timeslot earlier: a
message's deadline is the end of the timeslot it was sent in. The input layer
computes nothing in backward (the paper's one stall per mini-batch).

``T`` is the smallest period at which no device has two passes in the same
timeslot. For groups of equal size ``M`` this is ``2M`` and reproduces
equation 2's per-device sequence exactly (device of ``SN[w, h]`` starts after
``sum(len(group) for earlier groups)`` stalls, then alternates ``FW`` of its
layers ascending and ``BW`` of ``i - P + w`` descending); with one group
(horizontal, naive) it is ``2L - 1``. The total for ``N`` mini-batches is
``(N - 1) T + 2L - 1``, which is Theorem 1's ``2L + 2M(N - 1) - n_cut``.

hybrid, L = 6, P = 3, M = 2 (1-based layers, data id after the colon)::

    t        0     1     2     3     4     5     6     7     8     9    10
    SN[1,h]  F1:1  F2:1  .     .     F1:2  F2:2  .     .     F1:3  F2:3  B2:1
    SN[2,h]  .     .     F3:1  F4:1  .     .     F3:2  F4:2  B4:1  B3:1  F3:3
    SN[3,h]  .     .     .     .     F5:1  F6:1  B6:1  B5:1  F5:2  F6:2  B6:2

The duration of a timeslot follows section VI: the worst forward compute of
any device in any layer, plus the worst transmission time of one message at
250 kb/s with 32 bits a value (equation 4), plus a 100 ms margin. Compute
time is a multiply-accumulate count times a rate calibrated on Table II (a
Raspberry Pi 2 computes the 784 x 128 input layer in 341.42 ms).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from zpipe._errors import ConfigError
from zpipe.lossy.partition import Allocation

PassKind = Literal["F", "B"]

#: ms per multiply-accumulate on a Raspberry Pi 2 (Table II: 784 x 128 in 341.42 ms)
PI2_MS_PER_MAC = 341.42 / (784 * 128)
#: IEEE 802.15.4 rate (equation 4)
LINK_BITS_PER_S = 250_000.0
BITS_PER_VALUE = 32
MARGIN_MS = 100.0


@dataclass(frozen=True, order=True)
class PassEvent:
    """One pass of one layer for one mini-batch, run by every owner of the layer."""

    timeslot: int
    kind: PassKind
    layer: int
    data: int


def device_passes(alloc: Allocation, super_neuron: int) -> list[tuple[PassKind, int]]:
    """The passes a super neuron's device runs per mini-batch."""
    out: list[tuple[PassKind, int]] = []
    for layer in alloc.super_neurons[super_neuron].layers:
        out.append(("F", layer))
        if layer >= 1:
            out.append(("B", layer))
    return out


def pass_offset(kind: PassKind, layer: int, n_layers: int) -> int:
    """Timeslot of a pass relative to its mini-batch's first timeslot."""
    return layer if kind == "F" else 2 * n_layers - 1 - layer


def pipeline_period(alloc: Allocation) -> int:
    """Timeslots between consecutive mini-batches (equation 2's ``2 M``)."""
    n_layers = alloc.n_layers
    offsets = [
        [pass_offset(kind, layer, n_layers) for kind, layer in device_passes(alloc, k)]
        for k in range(alloc.n_devices)
    ]
    period = max(len(o) for o in offsets)
    while any(len({x % period for x in o}) != len(o) for o in offsets):
        period += 1
    return period


def total_timeslots(alloc: Allocation, n_data: int) -> int:
    """Timeslots to train ``n_data`` mini-batches."""
    if n_data < 1:
        raise ConfigError(f"need at least one mini-batch, got {n_data}")
    return (n_data - 1) * pipeline_period(alloc) + 2 * alloc.n_layers - 1


def theorem1_timeslots(n_layers: int, max_layers: int, n_data: int, *, horizontal: bool) -> int:
    """Theorem 1: ``2L + 2 M (N - 1) - n_cut`` (``n_cut`` = 1, or ``N`` for horizontal)."""
    n_cut = n_data if horizontal else 1
    return 2 * n_layers + 2 * max_layers * (n_data - 1) - n_cut


def sequential_period(alloc: Allocation) -> int:
    """Model parallelism without pipelining (Fig. 7's *Model*): a mini-batch's
    ``2L - 1`` passes finish before the next one starts."""
    return 2 * alloc.n_layers - 1


def data_within(alloc: Allocation, timeslot_s: float, budget_s: float) -> int:
    """How many mini-batches finish within ``budget_s`` (at least one); a budget
    of exactly ``N`` mini-batches' time gives ``N`` despite float rounding."""
    slots = int(budget_s * (1.0 + 1e-9) // timeslot_s)
    first = 2 * alloc.n_layers - 1
    if slots < first:
        return 1
    return 1 + (slots - first) // pipeline_period(alloc)


def events(alloc: Allocation, n_data: int, *, period: int | None = None) -> Iterator[PassEvent]:
    """Every pass of ``n_data`` mini-batches, in timeslot order (``period``: the
    pipeline's, or :func:`sequential_period` for no pipelining)."""
    n_layers = alloc.n_layers
    period = pipeline_period(alloc) if period is None else period
    kinds: list[tuple[PassKind, int]] = [("F", layer) for layer in range(n_layers)]
    kinds += [("B", layer) for layer in range(n_layers - 1, 0, -1)]
    out = [
        PassEvent((i - 1) * period + pass_offset(kind, layer, n_layers), kind, layer, i)
        for i in range(1, n_data + 1)
        for kind, layer in kinds
    ]
    out.sort()
    yield from out


def device_schedule(alloc: Allocation, n_data: int) -> list[list[str]]:
    """Per super neuron, per timeslot: ``"F3:1"`` (forward of 1-based layer 3 for
    mini-batch 1), ``"B4:2"`` or ``"."`` for a stall: the rows of Fig. 4."""
    n_slots = total_timeslots(alloc, n_data)
    rows = [["."] * n_slots for _ in range(alloc.n_devices)]
    owners = {
        layer: [k for k, sn in enumerate(alloc.super_neurons) if sn.slice_of(layer) is not None]
        for layer in range(alloc.n_layers)
    }
    for ev in events(alloc, n_data):
        for k in owners[ev.layer]:
            if rows[k][ev.timeslot] != ".":
                raise AssertionError(f"two passes in timeslot {ev.timeslot} on super neuron {k}")
            rows[k][ev.timeslot] = f"{ev.kind}{ev.layer + 1}:{ev.data}"
    return rows


def max_message_values(alloc: Allocation) -> int:
    """Values in the largest forward or sharing message between two devices
    (equation 4's ``M_pkt``); 0 when nothing crosses a link."""
    biggest = 0
    last = alloc.n_layers - 1
    for layer in range(alloc.n_layers):
        receivers = alloc.owners(layer + 1) if layer < last else alloc.owners(last)
        for device, sl in alloc.owners(layer):
            if any(dst != device for dst, _ in receivers):
                biggest = max(biggest, sl.width)
    return biggest


def worst_forward_macs(alloc: Allocation) -> int:
    """Multiply-accumulates of the heaviest forward pass any device runs."""
    # a slice of a layer costs its share of the layer's (a CNN's convolution layers
    # are owned whole, and cost their kernels' work, not in x out)
    return max(
        -(-alloc.macs(layer) * sl.width // alloc.layer_sizes[layer])
        for layer in range(1, alloc.n_layers)
        for _, sl in alloc.owners(layer)
    )


def compute_margin_ms(alloc: Allocation, *, ms_per_mac: float = PI2_MS_PER_MAC) -> float:
    """The part of a timeslot that is not on the air: worst compute + margin."""
    return worst_forward_macs(alloc) * ms_per_mac + MARGIN_MS


def message_airtime_ms(alloc: Allocation, *, link_bits_per_s: float = LINK_BITS_PER_S) -> float:
    """Equation 4: airtime of the largest message, one transmission."""
    return max_message_values(alloc) * BITS_PER_VALUE / link_bits_per_s * 1000.0


def timeslot_ms(
    alloc: Allocation,
    *,
    ms_per_mac: float = PI2_MS_PER_MAC,
    link_bits_per_s: float = LINK_BITS_PER_S,
    margin_ms: float = MARGIN_MS,
) -> float:
    """Section VI's timeslot: worst compute + worst transmission (eq. 4) + margin."""
    compute = worst_forward_macs(alloc) * ms_per_mac
    comm = max_message_values(alloc) * BITS_PER_VALUE / link_bits_per_s * 1000.0
    return compute + comm + margin_ms
