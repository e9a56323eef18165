"""Keep freed message memory in the process instead of returning it to the kernel.

libzmq allocates every large incoming message in its I/O thread; by default
glibc unmaps or trims the freed block at once, so the next message of the same
size page-faults all of its pages in again (17-52 faults per 1 MB message were
seen here). Raising glibc's trim threshold and fixing its mmap threshold lets the
allocator reuse those pages. Measured in ``bench/transport.py``; costs up to
``retain_mb`` of resident memory that the process does not strictly need.

The mmap threshold is capped at :data:`MMAP_THRESHOLD_MB`: blocks that large or
larger are mapped apart and unmapped when freed. Above it (32 MiB before), a
stage's tensors of a few MiB came from the heap and one forward left gaps that
the next could not reuse: a ViT stage at 8 images peaked 116-135 MiB above its
weights against 46 MiB of live tensors, past the planner's prediction
(``bench/memory.py``: 59 of 64 stages within 1.0-1.3 at 32 MiB, 64 of 64 at 4).
Messages of 1 MiB still reuse the heap; a 16 MiB message now page-faults a fresh
block on receive, for raw pyzmq and zpipe alike (figures in docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import sys

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_MB = 4
"""Blocks of this many MiB or more are mapped apart (see the module's docstring)."""

_GLIBC_MMAP_THRESHOLD_MAX_MB = 32  # older glibc refuses more


def retain_freed_memory(retain_mb: int = 256, mmap_threshold_mb: int = MMAP_THRESHOLD_MB) -> bool:
    """Ask glibc to keep up to ``retain_mb`` of freed memory and to map blocks of
    ``mmap_threshold_mb`` (at most ``retain_mb``, 32) apart; False where that is not glibc."""
    if retain_mb <= 0 or not sys.platform.startswith("linux"):
        return False
    try:
        # glibc's own name: find_library("c") would start ldconfig in every stage
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False  # musl and others have no mallopt
    threshold_mb = max(1, min(retain_mb, mmap_threshold_mb, _GLIBC_MMAP_THRESHOLD_MAX_MB))
    ok = mallopt(_M_MMAP_THRESHOLD, threshold_mb << 20)
    ok &= mallopt(_M_TRIM_THRESHOLD, retain_mb << 20)
    return bool(ok)
