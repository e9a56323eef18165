"""A run's timeline as a Chrome trace-event file, for Perfetto or chrome://tracing.

Each stage is one process of the trace (named after the stage, in plan order)
with one thread per track: ``recv`` (the data port taking a message), ``compute``
(inference, or training's forward, backward, all-reduce and optimizer step) and
``send`` (handing a result to the link), and ``copy`` for a stage that sent copies
without draining (asynchronous runs; a ``flush``, a wait at a flush point, and a
copy's ``snapshot`` are drawn on ``compute``). Each span is a complete event ("ph":
"X") named after its phase and micro-batch, with the micro-batch in ``args``.

Every stage stamps its spans with its own clock; a stage that measured its
clock's offset from the coordinator's (heartbeat round trips) is shifted onto
the coordinator's clock, so the tracks of different devices line up (to about
half the best round trip). Times start at the run's first span.

The format: https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
(the "JSON Object Format", ``{"traceEvents": [...], "displayTimeUnit": "ms"}``).
A recovery of an inference stream is marked with global instants: the stage's
failure and the new plan running.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from zpipe.log import get_logger

log = get_logger("zpipe.client")

TRACKS = ("recv", "compute", "send")
# drawn only for a stage that has such spans: copies made without draining
OPTIONAL_TRACKS = ("copy",)
# which track a phase is drawn on
TRACK_OF = {
    "recv": "recv",
    "send": "send",
    "compute": "compute",
    "forward": "compute",
    "backward": "compute",
    "allreduce": "compute",
    "step": "compute",
    "flush": "compute",
    "snapshot": "compute",
    "copy": "copy",
}


def _spans(timeline: Mapping[str, Any]) -> list[tuple[int, str, float, float]]:
    """The well-formed spans of one stage's timeline (a peer's bad entry is skipped)."""
    spans = []
    for entry in timeline.get("spans") or []:
        if not isinstance(entry, list) or len(entry) != 4:
            continue
        mb, phase, start, end = entry
        if (
            isinstance(mb, int)
            and phase in TRACK_OF
            and isinstance(start, (int, float))
            and isinstance(end, (int, float))
            and math.isfinite(start)
            and math.isfinite(end)
            and end >= start
        ):
            spans.append((mb, str(phase), float(start), float(end)))
    return spans


def _offset(timeline: Mapping[str, Any]) -> float:
    offset = timeline.get("offset_s")
    if isinstance(offset, (int, float)) and math.isfinite(offset):
        return float(offset)
    return 0.0  # not measured (an older coordinator): the stage's own clock


def recovery_marks(report: Any) -> list[tuple[str, float]]:
    """The instants to mark in a run's trace: for each recovery whose notice carried the
    coordinator's clock, the stage's failure and the new plan running."""
    marks: list[tuple[str, float]] = []
    for recovery in getattr(report, "recoveries", None) or []:
        clock = recovery.get("clock")
        if not isinstance(clock, (int, float)) or not math.isfinite(clock):
            continue
        dead = recovery.get("dead")
        took = recovery.get("recovered_s")
        if isinstance(took, (int, float)) and math.isfinite(took):
            marks.append((f"stage {dead} failed", float(clock) - float(took)))
        replayed = recovery.get("replayed", 0)
        marks.append((f"re-planned without {dead} ({replayed} replayed)", float(clock)))
    return marks


def chrome_trace(
    timelines: Mapping[str, Mapping[str, Any]],
    *,
    run: int = 0,
    marks: Sequence[tuple[str, float]] = (),
) -> dict[str, Any]:
    """The trace-event document of every stage's timeline (stage name -> its timeline,
    as the run report carries it), in the order given; ``marks``: (name, time on the
    coordinator's clock) drawn as instants across every track (recoveries)."""
    shifted: dict[str, list[tuple[int, str, float, float]]] = {}
    for stage, timeline in timelines.items():
        offset = _offset(timeline)
        spans = sorted(_spans(timeline), key=lambda s: (s[2], s[3]))
        shifted[stage] = [(mb, ph, a + offset, b + offset) for mb, ph, a, b in spans]
    starts = [s[2] for spans in shifted.values() for s in spans]
    origin = min(starts) if starts else 0.0
    events: list[dict[str, Any]] = []
    for pid, (stage, spans) in enumerate(shifted.items(), start=1):
        timeline = timelines[stage]
        events.append(_meta("process_name", pid, 0, {"name": stage}))
        events.append(_meta("process_sort_index", pid, 0, {"sort_index": pid}))
        used = {TRACK_OF[phase] for _, phase, _, _ in spans}
        for tid, track in enumerate(TRACKS + OPTIONAL_TRACKS, start=1):
            if track in TRACKS or track in used:
                events.append(_meta("thread_name", pid, tid, {"name": track}))
                events.append(_meta("thread_sort_index", pid, tid, {"sort_index": tid}))
        for mb, phase, start, end in spans:
            name = phase if mb < 0 else f"{phase} mb{mb}"
            events.append(
                {
                    "name": name,
                    "cat": phase,
                    "ph": "X",
                    "ts": round((start - origin) * 1e6, 3),
                    "dur": round((end - start) * 1e6, 3),
                    "pid": pid,
                    "tid": (TRACKS + OPTIONAL_TRACKS).index(TRACK_OF[phase]) + 1,
                    "args": {"mb": mb},
                }
            )
        dropped = timeline.get("dropped")
        if isinstance(dropped, int) and dropped > 0:
            # the ring kept only the newest spans: say so where the stage's track starts
            events.append(
                {
                    "name": f"{dropped} older spans dropped",
                    "ph": "i",
                    "s": "p",
                    "ts": round((spans[0][2] - origin) * 1e6, 3) if spans else 0.0,
                    "pid": pid,
                    "tid": 1,
                }
            )
    for name, at in marks:
        events.append(
            {"name": name, "ph": "i", "s": "g", "ts": round((at - origin) * 1e6, 3), "pid": 0}
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "run": run,
            "clock": "coordinator",
            "stages": list(timelines),
            # each stage's clock offset to the coordinator's, and the round trip that
            # measured it (None: not measured, the stage's own clock is used)
            "offset_s": {stage: timelines[stage].get("offset_s") for stage in timelines},
            "offset_rtt_s": {stage: timelines[stage].get("rtt_s") for stage in timelines},
        },
    }


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def write_trace(
    path: str | Path,
    timelines: Mapping[str, Mapping[str, Any]],
    *,
    run: int = 0,
    marks: Sequence[tuple[str, float]] = (),
) -> Path:
    """Write :func:`chrome_trace` to ``path``; returns it."""
    target = Path(path)
    if not timelines:
        log.warning("trace_empty", path=str(target), reason="no stage sent a timeline")
    target.write_text(json.dumps(chrome_trace(timelines, run=run, marks=marks)))
    return target
