"""Resident memory and CPU time of a process, as ``bench/generate.py`` measures them
(Linux ``/proc``).

``VmHWM`` is a process's peak resident set; writing ``5`` to its ``clear_refs``
resets that peak to the present resident set (Linux 4.0+, the process's owner), so a
peak can be taken over one phase (the timed runs) rather than the process's life
(a model load's transient copies left out).
"""

from __future__ import annotations

import os


def status_kib(key: str, pid: int | None = None) -> int | None:
    """``VmRSS``, ``VmHWM``... of process ``pid`` (this one by default) in KiB; None
    where unknown."""
    try:
        with open(f"/proc/{pid or os.getpid()}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def reset_peak(pid: int | None = None) -> bool:
    """Reset ``pid``'s ``VmHWM`` to its present resident set; False where it cannot be."""
    try:
        with open(f"/proc/{pid or os.getpid()}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def cpu_s(pid: int | None = None) -> float | None:
    """User + system CPU seconds of process ``pid`` (this one by default, all its
    threads) so far; None where unknown. Ticks of ``/proc/PID/stat``: 10 ms apart."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # after the command's closing parenthesis: state is field 3, utime 14, stime 15
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
