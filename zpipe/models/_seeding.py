"""Seeded construction: a unit's initial weights depend only on (seed, unit index).

That is what lets a stage build units 7..12 alone and still get exactly the
weights that units 7..12 have inside a full build. Seeded weights agree across
processes and machines that run the same torch version (its init functions
decide how random numbers become weights); a weights file pins them otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

# A large odd multiplier keeps (seed, index) pairs apart for any index < 1_000_003.
_MULTIPLIER = 1_000_003
_MODULUS = 2**63


def unit_seed(seed: int, index: int) -> int:
    return (seed * _MULTIPLIER + index) % _MODULUS


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block under torch.manual_seed(seed), leaving the caller's RNG untouched."""
    # devices=[]: only the CPU generator; forking CUDA generators would warn or init CUDA.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
