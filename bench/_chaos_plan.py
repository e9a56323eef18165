"""The pure parts of ``bench/chaos.py``: the seeded fault schedules (one per
workload), the exactly-once and in-order check of an inference stream across a round's
attempts, which faults a failed run is charged to, and the summary's figures. No
processes, no sockets: unit-tested on their own."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

# Every fault kind the soak knows, in a fixed order (the schedule's draws depend on it).
FAULT_KINDS = (
    "stage_kill",  # SIGKILL of a stage, then a new process under its name registers again
    "stage_stop",  # SIGSTOP of a stage for a while, then SIGCONT
    # SIGSTOP of a stage that never resumes: SIGKILLed while stopped, a new process
    # registers under its name (a hung device power-cycled; the path of a stop that
    # does not rejoin)
    "stage_hang",
    "coordinator_restart",  # SIGKILL of the coordinator, restarted from --state-dir
    "cpu_burner",  # a process that spins on a core for a while
    "malformed_burst",  # garbage and poison messages at a stage's and the coordinator's ports
    "link_cut",  # a stage's or the coordinator's link down for a while (netns harness)
    "bandwidth_drop",  # a link's rate cut to a tenth with tc tbf (netns harness)
)
NETWORK_KINDS = frozenset({"link_cut", "bandwidth_drop"})
# Kinds that hit the whole machine, not one workload's cluster: a failure of either
# workload can be theirs.
MACHINE_KINDS = frozenset({"cpu_burner"})
MACHINE = "machine"


@dataclass(frozen=True)
class Fault:
    """One scheduled fault: ``at_s`` seconds after the soak starts, of ``kind``, aimed
    at the ``target``-th candidate (modulo how many there are then), lasting
    ``hold_s`` where the kind has a duration (a stop, a burner, a cut), drawn in the
    stream of ``workload`` (whose cluster it hits, unless it hits the machine)."""

    at_s: float
    kind: str
    target: int
    hold_s: float
    workload: str = ""

    @property
    def scope(self) -> str:
        """Whose rounds this fault can break: its workload's, or (a burner) anyone's."""
        return MACHINE if self.kind in MACHINE_KINDS else self.workload


def schedule(
    seed: int | str,
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
    rng = random.Random(seed)  # a str seed is hashed the same way in every process
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


def schedules(
    seed: int,
    duration_s: float,
    min_gap_s: float,
    max_gap_s: float,
    kinds: Sequence[str],
    workloads: Sequence[str],
) -> dict[str, list[Fault]]:
    """One independent fault stream per workload (each at ``min_gap_s``..``max_gap_s``
    apart, seeded from ``seed`` and the workload's name): the streams may overlap in
    time, two faults on two clusters at once, a harder soak than one stream."""
    streams: dict[str, list[Fault]] = {}
    for workload in workloads:
        stream_seed = f"chaos:{seed}:{workload}"
        faults = schedule(stream_seed, duration_s, min_gap_s, max_gap_s, kinds)
        streams[workload] = [replace(f, workload=workload) for f in faults]
    return streams


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


def refused_at_start(error: str | None, drawn: int, hung: bool) -> bool:
    """Whether an attempt was refused before it began: it ended in a definite error
    (not a hang cut off by the round's timeout) before the client took a single input
    from the caller (the coordinator could not start the run: a stage in it had just
    died, say). Nothing was accepted, so nothing is lost: the client knows and tries
    the same inputs again, as a Jepsen client treats a definite failure of a request."""
    return error is not None and drawn == 0 and not hung


def score_round(
    attempts: Sequence[tuple[str | None, int, bool, Sequence[int | None]]],
    count: int,
    *,
    finished: bool = True,
) -> dict[str, Any]:
    """One round of ``count`` inputs tried in ``attempts`` (error, inputs drawn, hung,
    the input index each output answered), every attempt but the last refused: every
    output of every attempt is checked together, so an output of a refused attempt
    would count as a duplicate of the retry's. ``finished`` false: the soak ended
    while the last attempt was refused (nothing was accepted: neither ok nor failed).
    ``ok`` when the last attempt succeeded and every input was answered exactly once,
    in order; ``exactly_once`` when every input was, whatever the last attempt's end."""
    outputs = [index for *_, found in attempts for index in found]
    check = exactly_once_in_order(outputs, count)
    last_error, last_drawn, last_hung, _ = attempts[-1]
    last_refused = refused_at_start(last_error, last_drawn, last_hung)
    refusals = sum(1 for e, d, h, _ in attempts[:-1] if refused_at_start(e, d, h))
    if refusals != len(attempts) - 1:
        raise ValueError("only the last attempt of a round may be other than refused")
    abandoned = last_refused and not finished
    ok = not last_refused and last_error is None and bool(check["ok"])
    return {
        **check,
        "ok": ok,
        # the outputs alone, whatever the attempt's end (an error after the last
        # output, say: a failure of the round, charged to its fault, not a loss)
        "exactly_once": bool(check["ok"]),
        "attempts": len(attempts),
        "refusals": refusals + (1 if last_refused else 0),
        "abandoned": abandoned,
        "failed": not ok and not abandoned,
    }


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


def charge_by_workload(
    injected: Sequence[tuple[float, str]], failed: Sequence[tuple[float, float, str]]
) -> tuple[set[int], int]:
    """:func:`charge_failures` where each workload's failed rounds (started, ended,
    workload) are charged only to the faults that could reach them: those of its own
    stream and those that hit the machine (``injected``: (time, scope), ascending).
    Returns the faults not survived (positions in ``injected``) and how many failed
    rounds no fault could be charged with (a bug without a fault: reported apart)."""
    not_survived: set[int] = set()
    uncharged = 0
    for workload in sorted({w for *_, w in failed}):
        reach = [i for i, (_, scope) in enumerate(injected) if scope in (workload, MACHINE)]
        rounds = [(s, e) for s, e, w in failed if w == workload]
        for started, ended in rounds:
            hit = charge_failures([injected[i][0] for i in reach], [(started, ended)])
            if not hit:
                uncharged += 1
            not_survived.update(reach[j] for j in hit)
    return not_survived, uncharged


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


def counts_by(
    faults: Sequence[dict[str, Any]], not_survived: set[int], key: str
) -> dict[str, dict[str, int]]:
    """Faults injected and survived, grouped by each fault's ``key`` (kind, workload)."""
    counts: dict[str, dict[str, int]] = {}
    for i, fault in enumerate(faults):
        row = counts.setdefault(str(fault[key]), {"injected": 0, "survived": 0})
        row["injected"] += 1
        if i not in not_survived:
            row["survived"] += 1
    return counts


def summary_figures(
    faults: Sequence[dict[str, Any]],
    not_survived: set[int],
    skipped: dict[str, str],
) -> dict[str, Any]:
    """The fault counts of the summary line: injected, survived, and per kind."""
    return {
        "faults_injected": len(faults),
        "faults_survived": len(faults) - len(not_survived),
        "per_kind": counts_by(faults, not_survived, "kind"),
        "kinds_skipped": dict(skipped),
    }
