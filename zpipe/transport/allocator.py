"""Keep freed message memory in the process instead of returning it to the kernel.

libzmq allocates every large incoming message in its I/O thread; by default
glibc unmaps or trims the freed block at once, so the next message of the same
size page-faults all of its pages in again (17-52 faults per 1 MB message were
seen here). Raising glibc's mmap and trim thresholds lets the allocator reuse
those pages. Measured in ``bench/transport.py``; costs up to ``retain_mb`` of
resident memory that the process does not strictly need.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def retain_freed_memory(retain_mb: int = 256) -> bool:
    """Ask glibc to keep up to ``retain_mb`` of freed memory; False where that is not glibc."""
    if retain_mb <= 0 or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # musl and others have no mallopt
    retain = retain_mb << 20
    ok = mallopt(_M_MMAP_THRESHOLD, min(retain, 32 << 20))  # older glibc refuses more than 32 MiB
    ok &= mallopt(_M_TRIM_THRESHOLD, retain)
    return bool(ok)
