"""Which rows of a micro-batch each device of a data-parallel group computes, and
which rows go from a device of one group to a device of the next (Asteroid's
Fig. 10), as pure functions.

A group shares every micro-batch by its plan's shares: device k computes a
contiguous block of rows whose size is proportional to ``shares[k]``. When two
neighbouring groups split the micro-batch differently, each sending device
sends each receiving device exactly the rows they have in common, so every row
crosses once, and a receiver concatenates its pieces in row order.

With the micro-batch of the plan (``sum(shares)`` rows) the blocks are exactly
the shares; a smaller or larger micro-batch (the last one of an uneven split)
is divided in the same proportions, rounding by largest remainder, so senders
and receivers agree without telling each other.
"""

from __future__ import annotations

from collections.abc import Sequence

from zpipe._errors import ConfigError


def split_rows(total: int, shares: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous ``[lo, hi)`` row blocks of a ``total``-row micro-batch, one per share."""
    if total < 0:
        raise ConfigError(f"a micro-batch has a non-negative number of rows, got {total}")
    if not shares or any(s < 0 for s in shares) or sum(shares) <= 0:
        raise ConfigError(f"shares must be non-negative with a positive sum, got {list(shares)}")
    weight = sum(shares)
    exact = [total * s / weight for s in shares]
    sizes = [int(x) for x in exact]
    # Largest remainder first; ties go to the earlier device, so every party agrees.
    order = sorted(range(len(shares)), key=lambda k: (-(exact[k] - sizes[k]), k))
    for k in order[: total - sum(sizes)]:
        sizes[k] += 1
    blocks, lo = [], 0
    for size in sizes:
        blocks.append((lo, lo + size))
        lo += size
    return blocks


def route(
    total: int, sender_shares: Sequence[int], receiver_shares: Sequence[int]
) -> list[tuple[int, int, int, int]]:
    """``(sender, receiver, lo, hi)`` for every non-empty overlap of their row blocks."""
    pieces = []
    senders = split_rows(total, sender_shares)
    receivers = split_rows(total, receiver_shares)
    for s, (a, b) in enumerate(senders):
        for r, (c, d) in enumerate(receivers):
            lo, hi = max(a, c), min(b, d)
            if lo < hi:
                pieces.append((s, r, lo, hi))
    return pieces
