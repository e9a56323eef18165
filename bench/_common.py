"""Tiny helpers shared by the benchmarks: one JSON object per line on stdout."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import FrameType
from typing import Any


def emit(obj: dict[str, Any]) -> None:
    """Print ``obj`` as one JSON line and flush, so a reader sees it at once."""
    sys.stdout.write(json.dumps(obj, sort_keys=False) + "\n")
    sys.stdout.flush()


def summary(bench: str, **ratios: Any) -> dict[str, Any]:
    """Emit and return the one closing summary object of benchmark ``bench``."""
    obj: dict[str, Any] = {"bench": bench, "summary": True, **ratios}
    emit(obj)
    return obj


def loadavg() -> list[float] | None:
    """This machine's 1, 5 and 15 minute load averages, or None where unknown."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def thread_switches() -> int:
    """Voluntary context switches of every thread of this process so far (each is one
    sleep that a hand-off, the network or a wait for the GIL had to end); 0 where
    /proc is missing. Robust under load, unlike wall-clock time."""
    total = 0
    try:
        tasks = list(Path("/proc/self/task").iterdir())
    except OSError:
        return 0
    for task in tasks:
        try:
            status = (task / "status").read_text()
        except OSError:  # a thread that just ended
            continue
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                total += int(line.split()[1])
    return total


def thread_cpu_by_role() -> dict[str, float]:
    """CPU seconds so far of this process's live threads, summed by role: ``main``
    (the interpreter's main thread), ``zmq_io`` (libzmq's I/O threads) and ``other``
    (pyzmq's garbage collector of zero-copy sends, libzmq's reaper, torch's
    threads...). From ``/proc/self/task/*/schedstat`` (nanoseconds, user and system
    time together); empty where that is missing. Threads that ended are not
    counted, so compare two readings only while the same threads live."""
    by_role: dict[str, float] = {}
    main_tid = str(os.getpid())
    try:
        tasks = list(Path("/proc/self/task").iterdir())
    except OSError:
        return by_role
    for task in tasks:
        try:
            ns = int((task / "schedstat").read_text().split()[0])
            name = (task / "comm").read_text().strip()
        except (OSError, ValueError, IndexError):  # a thread that just ended
            continue
        if task.name == main_tid:
            role = "main"
        elif name.startswith("ZMQbg/IO"):
            role = "zmq_io"
        else:
            role = "other"
        by_role[role] = by_role.get(role, 0.0) + ns / 1e9
    return by_role


def on_alarm(signum: int, frame: FrameType | None) -> None:
    """SIGALRM handler for a benchmark's ``--timeout``."""
    raise TimeoutError("the benchmark ran past --timeout")
