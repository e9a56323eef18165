"""What bench/hostile.py judges in each attack class's window. Pure: snapshots in,
figures out (the bench takes the snapshots from /proc, the logs and the stream).

A class's window runs from just before its first attack to the stream's next output
after its last one. Across it the bench compares two :class:`Snapshot`s: processes
that stopped (crashes), new ``stage_dead`` lines for stages that were not the class's
own fakes (false deaths), outputs and mismatched outputs of the stream (its
exactness), log bytes written (finding 8), and the peak resident memory sampled
meanwhile against each process's idle value.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# peak resident memory over idle that a class may cause (the hostile-peers goal)
RSS_GOAL = 2.0


@dataclass(frozen=True)
class Snapshot:
    """What the bench sees at one moment."""

    outputs: int  # the stream's outputs so far
    mismatches: int  # of which differ from a single-process run
    deaths: tuple[str, ...]  # stages the coordinator declared dead so far, in order
    alive: Mapping[str, bool]  # process name -> still running
    log_bytes: Mapping[str, int] = field(default_factory=dict)  # process name -> log size


def stream_marks(data: bytes) -> tuple[int, int]:
    """The stream client's marks file (one byte per output: ``1`` exact, ``0`` not):
    outputs and mismatches so far."""
    return len(data), data.count(b"0")


def stage_deaths(log: str) -> tuple[str, ...]:
    """The stages a coordinator's JSON log declared dead, in order."""
    out = []
    for line in log.splitlines():
        if '"stage_dead"' in line and line.startswith("{"):
            try:
                out.append(str(json.loads(line).get("stage")))
            except ValueError:  # a line cut by a crash
                continue
    return tuple(out)


def rss_ratios(peak_kib: Mapping[str, int], idle_kib: Mapping[str, int | None]) -> dict[str, float]:
    """Peak over idle resident memory of every process with both figures."""
    out = {}
    for name, peak in peak_kib.items():
        idle = idle_kib.get(name)
        if peak and idle:
            out[name] = round(peak / idle, 3)
    return out


def window_figures(
    before: Snapshot,
    after: Snapshot,
    *,
    peak_kib: Mapping[str, int],
    idle_kib: Mapping[str, int | None],
    resumed_s: float | None,
    expected_deaths: Iterable[str] = (),
) -> dict[str, Any]:
    """What one class did, judged: its ``crashes``, ``hangs`` (1 when the stream gave
    no output after the class: ``resumed_s`` None), ``false_deaths`` (stages declared
    dead that are not in ``expected_deaths``), the stream's ``stream_exact`` across
    the window, its peak over idle memory and the log bytes each process wrote."""
    expected = set(expected_deaths)
    crashed = sorted(n for n, up in before.alive.items() if up and not after.alive.get(n, False))
    new_deaths = list(after.deaths[len(before.deaths) :])
    false = [d for d in new_deaths if d not in expected]
    ratios = rss_ratios(peak_kib, idle_kib)
    worst = max(ratios, key=ratios.__getitem__) if ratios else None
    log_bytes = {
        name: size - before.log_bytes.get(name, 0)
        for name, size in after.log_bytes.items()
        if size - before.log_bytes.get(name, 0) > 0
    }
    mismatched = after.mismatches - before.mismatches
    figures: dict[str, Any] = {
        "crashes": len(crashed),
        "hangs": int(resumed_s is None),
        "false_deaths": len(false),
        "stream_exact": mismatched == 0 and resumed_s is not None,
        "stream_outputs": after.outputs - before.outputs,
        "stream_resumed_s": resumed_s,
        "peak_over_idle_rss": ratios[worst] if worst else None,
        "peak_over_idle_process": worst,
        "log_bytes": log_bytes,
        "log_bytes_total": sum(log_bytes.values()),
    }
    if crashed:
        figures["crashed"] = crashed
    if false:
        figures["false_dead"] = false
    if new_deaths and not false:
        figures["expected_deaths"] = new_deaths
    return figures


def class_goals_met(entry: Mapping[str, Any]) -> bool:
    """The goals every class must meet: 0 crashes, 0 hangs, 0 false deaths, the stream
    exact, peak memory under :data:`RSS_GOAL` x idle, and the class's own check
    (``refused``: what must be refused was) where it has one."""
    ratio = entry.get("peak_over_idle_rss")
    return (
        entry.get("crashes", 0) == 0
        and entry.get("hangs", 0) == 0
        and entry.get("false_deaths", 0) == 0
        and bool(entry.get("stream_exact"))
        and (ratio is None or ratio < RSS_GOAL)
        and entry.get("refused", True) is not False
    )


def merge(total: dict[str, Any], figures: Mapping[str, Any]) -> None:
    """Add one target's window to its class's entry (a class attacks several ports)."""
    for key in ("crashes", "hangs", "false_deaths", "stream_outputs", "log_bytes_total"):
        total[key] = total.get(key, 0) + figures[key]
    total["stream_exact"] = total.get("stream_exact", True) and figures["stream_exact"]
    resumed = [r for r in (total.get("stream_resumed_s"), figures["stream_resumed_s"]) if r]
    total["stream_resumed_s"] = max(resumed) if resumed else figures["stream_resumed_s"]
    ratio = figures["peak_over_idle_rss"]
    if ratio is not None and ratio > (total.get("peak_over_idle_rss") or 0.0):
        total["peak_over_idle_rss"] = ratio
        total["peak_over_idle_process"] = figures["peak_over_idle_process"]
    logs = total.setdefault("log_bytes", {})
    for name, size in figures["log_bytes"].items():
        logs[name] = logs.get(name, 0) + size
    for key in ("crashed", "false_dead", "expected_deaths"):
        if key in figures:
            total.setdefault(key, []).extend(figures[key])


_EVENT = re.compile(r'"event": "([^"]{1,80})"')


def log_events(text: str, top: int = 3) -> dict[str, int]:
    """The ``top`` events of a stretch of JSON log by the bytes their lines take
    (finding 8: which lines a flood makes a process write)."""
    sizes: dict[str, int] = {}
    for line in text.splitlines():
        match = _EVENT.search(line)
        name = match.group(1) if match else "(not json)"
        sizes[name] = sizes.get(name, 0) + len(line) + 1
    ranked = sorted(sizes.items(), key=lambda item: (-item[1], item[0]))
    return dict(ranked[:top])
