"""What bench/hostile.py reads of its processes from /proc: resident memory, CPU time,
and the peak resident memory sampled while one attack class runs (``VmHWM`` is a
process's peak over its whole life, so it cannot tell one class's window from the
next). Linux only."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path


def rss_kib(pid: int, field: str = "VmRSS") -> int | None:
    """``VmRSS`` or ``VmHWM`` of a process in KiB, or None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` has used so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class RssSampler:
    """Samples the resident memory of named processes every ``interval_s`` in a
    thread, from :meth:`start` to :meth:`stop`; keeps each one's peak."""

    def __init__(self, pids: Mapping[str, int], interval_s: float = 0.1) -> None:
        self.pids = dict(pids)
        self.interval_s = interval_s
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        for name, pid in self.pids.items():
            rss = rss_kib(pid)
            if rss is not None and rss > self.peak.get(name, 0):
                self.peak[name] = rss

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def start(self) -> RssSampler:
        self._sample()
        self._thread.start()
        return self

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join(5.0)
        self._sample()
        return dict(self.peak)


def mib(kib: int | None) -> float | None:
    return None if kib is None else round(kib / 1024, 1)
