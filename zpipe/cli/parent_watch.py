"""Shut a process down when the process that started it dies (``--parent-pid``).

A :class:`zpipe.cluster.LocalCluster` starts a coordinator and stage processes as
its children. Killed with SIGKILL (a test runner's time-out, an out-of-memory kill,
``kill -9``), its owner cannot stop them, and they would run on for ever, holding
ports, memory and cores: a failed test of the suite once left a coordinator and two
stages running for the rest of the run. Linux's ``PR_SET_PDEATHSIG`` follows the
*thread* that started a child (a cluster started from a worker thread would lose
its stages when that thread ends), so the child looks at its parent instead: once
``os.getppid()`` is no longer the PID it was started by, that process has died
(the child was re-parented), and it shuts down as SIGTERM would make it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

# How often the parent is looked at: a dead owner's processes go within about this.
PARENT_LOOK_S = 1.0


def parent_is_gone(parent_pid: int) -> bool:
    """Whether this process is no longer the child of ``parent_pid`` (it died)."""
    return os.getppid() != parent_pid


async def watch_parent(
    parent_pid: int, on_gone: Callable[[], None], *, interval_s: float = PARENT_LOOK_S
) -> None:
    """Call ``on_gone`` once when ``parent_pid`` stops being this process's parent;
    cancel the task to stop watching. A parent already gone is seen at once."""
    # polled: nothing announces a parent's death to a child (short of a signal tied
    # to a thread, above) that an event could wait on
    while True:
        if parent_is_gone(parent_pid):
            on_gone()
            return
        await asyncio.sleep(interval_s)
