"""The unit lane: no processes, no sockets; a test that starts one fails here.

While a test of tests/unit/ sets up, runs and tears down, every way to start a
process (subprocess, os.fork/posix_spawn/system, multiprocessing) and every way to
reach a network (a socket's bind/connect/listen/sendto, a ZeroMQ socket) raises
(tests/_support/lane_guard.py); a test that catches the error still fails at the
end of its phase. A test that needs one of them belongs in tests/integration/ (real
sockets, one process) or tests/cluster/ (processes). The guard is installed only
around the phases of this lane's tests, so a run of the whole suite is not
affected; the session's load generator (``--cpu-burners``) may still start its
processes.

The lane's tensors are tiny: torch computes them on one thread (the pool's threads
only fight the other xdist worker for two cores; its size is restored after each
phase).
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest
import torch

from tests._support.lane_guard import PROCESSES, SOCKETS, guarded_phase

# loky (joblib, under scikit-learn's KMeans) counts the physical cores once per
# process by running lscpu; seed its cache with the logical count, which is what it
# falls back to when lscpu cannot run, so the unit lane starts no process for it.
try:
    from joblib.externals.loky.backend import context as _loky_context
except ImportError:  # scikit-learn (and joblib) not installed: nothing to seed
    pass
else:
    if getattr(_loky_context, "physical_cores_cache", None) is None:
        _loky_context.physical_cores_cache = os.cpu_count() or 1

# matplotlib builds its font cache the first time its font manager is imported, by
# running fc-list; on a machine without the cache (a fresh CI machine) that would be
# the first plotting test's process. Build it here, before any guarded phase.
try:
    import matplotlib.font_manager  # noqa: F401
except ImportError:  # matplotlib not installed: nothing to build
    pass

_FORBIDDEN = [*PROCESSES, *SOCKETS]
_WHERE = "tests/integration/ (sockets) or tests/cluster/ (processes)"


def _phase() -> Generator[None, Any, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return (yield from guarded_phase(_FORBIDDEN, "the unit lane", _WHERE))
    finally:
        torch.set_num_threads(threads)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _phase())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _phase())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _phase())
