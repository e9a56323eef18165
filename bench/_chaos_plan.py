"""The pure parts of ``bench/chaos.py``: the seeded fault schedule, the exactly-once
and in-order check of an inference stream, which faults a failed run is charged to,
and the summary's figures. No processes, no sockets: unit-tested on their own."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

# Every fault kind the soak knows, in a fixed order (the schedule's draws depend on it).
FAULT_KINDS = (
    "stage_kill",  # SIGKILL of a stage, then a new process under its name registers again
    "stage_stop",  # SIGSTOP of a stage for a while, then SIGCONT
    "coordinator_restart",  # SIGKILL of the coordinator, restarted from --state-dir
    "cpu_burner",  # a process that spins on a core for a while
    "malformed_burst",  # garbage and poison messages at a stage's and the coordinator's ports
    "link_cut",  # a stage's or the coordinator's link down for a while (netns harness)
    "bandwidth_drop",  # a link's rate cut to a tenth with tc tbf (netns harness)
)
NETWORK_KINDS = frozenset({"link_cut", "bandwidth_drop"})


@dataclass(frozen=True)
class Fault:
    """One scheduled fault: ``at_s`` seconds after the soak starts, of ``kind``, aimed
    at the ``target``-th candidate (modulo how many there are then), lasting
    ``hold_s`` where the kind has a duration (a stop, a burner, a cut)."""

    at_s: float
    kind: str
    target: int
    hold_s: float


def schedule(
    seed: int,
    duration_s: float,
    min_gap_s: float,
    max_gap_s: float,
    kinds: Sequence[str],
    *,
    min_hold_s: float = 1.0,
    max_hold_s: float = 10.0,
) -> list[Fault]:
    """The faults of a soak of ``duration_s``: one every ``min_gap_s``..``max_gap_s``
    seconds (uniform), each of a kind drawn uniformly from ``kinds``. The same seed and
    arguments give the same list; the last fault starts before ``duration_s``."""
    if not kinds:
        return []
    if not 0 < min_gap_s <= max_gap_s:
        raise ValueError(f"need 0 < min gap <= max gap, got {min_gap_s} and {max_gap_s}")
    unknown = sorted(set(kinds) - set(FAULT_KINDS))
    if unknown:
        raise ValueError(f"unknown fault kinds {unknown}")
    rng = random.Random(seed)
    faults: list[Fault] = []
    at = rng.uniform(min_gap_s, max_gap_s)
    while at < duration_s:
        kind = kinds[rng.randrange(len(kinds))]
        faults.append(
            Fault(
                at_s=round(at, 3),
                kind=kind,
                target=rng.randrange(1 << 16),
                hold_s=round(rng.uniform(min_hold_s, max_hold_s), 3),
            )
        )
        at += rng.uniform(min_gap_s, max_gap_s)
    return faults


T = TypeVar("T")


def match_stream(
    received: Sequence[T], expected: Sequence[T], equal: Callable[[T, T], bool]
) -> list[int | None]:
    """For each received output, the index of the first expected output it equals
    (None: it equals none). Inputs are random, so no two expected outputs are equal
    and the index says which input an output answers."""
    found: list[int | None] = []
    for output in received:
        found.append(next((i for i, e in enumerate(expected) if equal(output, e)), None))
    return found


def exactly_once_in_order(indices: Sequence[int | None], count: int) -> dict[str, Any]:
    """How a stream of answered input indices departs from ``0, 1, ..., count - 1``:
    outputs that answer no input (``unknown``), inputs answered twice (``duplicates``)
    or never (``missing``), and answers that arrived after a later input's
    (``out_of_order``). ``ok`` when none of those happened."""
    seen: set[int] = set()
    duplicates = unknown = out_of_order = 0
    last = -1
    for index in indices:
        if index is None:
            unknown += 1
            continue
        if index in seen:
            duplicates += 1
            continue
        seen.add(index)
        if index < last:
            out_of_order += 1
        last = max(last, index)
    missing = sum(1 for i in range(count) if i not in seen)
    ok = not (duplicates or unknown or out_of_order or missing) and len(indices) == count
    return {
        "ok": ok,
        "duplicates": duplicates,
        "missing": missing,
        "unknown": unknown,
        "out_of_order": out_of_order,
    }


def refused_at_start(error: str | None, received: int) -> bool:
    """Whether a round was refused before it began: the coordinator could not start
    the run (a stage named in it had just died, say) and nothing came back. Nothing
    was accepted, so nothing is lost: the client knows and starts again, as a
    Jepsen client treats a definite failure of a request."""
    return error is not None and "could not start the run" in error and received == 0


def charge_failures(
    injected_at: Sequence[float], failed: Sequence[tuple[float, float]]
) -> set[int]:
    """Which faults (by position in ``injected_at``, ascending times) were not survived,
    given the (started, ended) times of the rounds that failed: a round is charged to
    the first fault injected while it ran (later ones met a round already broken; a
    hung round ends only at its timeout, long after), else to the last fault before
    it started (one whose effect lasted), else to none (a bug without a fault)."""
    charged: set[int] = set()
    for started, ended in failed:
        during = [i for i, at in enumerate(injected_at) if started <= at <= ended]
        before = [i for i, at in enumerate(injected_at) if at < started]
        if during:
            charged.add(during[0])
        elif before:
            charged.add(before[-1])
    return charged


def false_deaths(
    deaths: Sequence[tuple[float, str]],
    down: Sequence[tuple[str, float, float]],
    grace_s: float,
) -> list[tuple[float, str]]:
    """The deaths (time, stage) declared for a stage that was up: not inside one of its
    own ``down`` windows (stage, from, to), stretched by ``grace_s`` at the end (a
    death found a little after the process came back is still the fault's)."""
    wrong = []
    for t, name in deaths:
        if not any(n == name and start <= t <= end + grace_s for n, start, end in down):
            wrong.append((t, name))
    return wrong


def summary_figures(
    faults: Sequence[dict[str, Any]],
    not_survived: set[int],
    skipped: dict[str, str],
) -> dict[str, Any]:
    """The fault counts of the summary line: injected, survived, and per kind."""
    per_kind: dict[str, dict[str, int]] = {}
    for i, fault in enumerate(faults):
        row = per_kind.setdefault(str(fault["kind"]), {"injected": 0, "survived": 0})
        row["injected"] += 1
        if i not in not_survived:
            row["survived"] += 1
    return {
        "faults_injected": len(faults),
        "faults_survived": len(faults) - len(not_survived),
        "per_kind": per_kind,
        "kinds_skipped": dict(skipped),
    }
