"""What an asynchronous run's recovery supports, and the cuts such a run went through.

An ``async-1f1b`` run with ``recover`` keeps global replicas at flush points and,
after a stage dies, resumes on the survivors with the staleness of the depth it
started with (:mod:`zpipe.coordinator.runs.async_replicas`). That is exact only where
a weight version names the same weights whatever the stages are: vertical sync
on (every stage forwards a batch with the first stage's version).

With weight aggregation, stage ``i`` of ``n`` averages ``n - i`` versions every
``multiple * (n - i)`` backwards. A recovery onto ``n' < n`` stages keeps the
windows of the depth, as it keeps the staleness: stage ``j`` of the survivors
averages ``n - j`` versions every ``multiple * (n - j)`` backwards counted from the
run's start (:mod:`zpipe.planner.async_schedule`); a replica carries the newest
``n`` versions of every unit, which any of those windows reads. A unit that moves
to another stage index (a recovery, a re-partition) follows that index's window,
so the recovered run is not the uninterrupted one, but it is exactly the
single-process reference of the cuts it went through.

Recovery and live re-partitioning (``repartition``) share the flush points, and
interleave so that a recovery never restores units onto cuts the run had left:

- a look that moves units is followed at once, at the same flush, by a replica
  (of the run's replication kind); the replica then records the new cuts, so a
  later death re-plans the survivors from the measured cuts and every unit's
  holder is where the unit now lives (a stage's own snapshot, its backup, the
  coordinator's copy);
- a death during a re-partition's phases (the look, the flush, the fetches, the
  commit) fails the re-partition, and the client waits for the coordinator's
  word of the death: the run then recovers from the last replica, taken before
  that look (the stages' snapshots from the failed phases are never used), and
  replays from there;
- a resumed run does not look again at the mini-batch it resumed from (that look
  was made before the replica it resumes from, as a replica is not taken again
  there); it looks at the steps its settings name after it, on the survivors,
  with a controller of its own (the forced ``bounds`` of the settings, a test
  hook for the pipeline the run started with, do not carry over).

So the whole run is one sequence of cuts, each from a flush on: the moves its
looks made, and each recovery's survivors (:func:`cuts_of_run`), and the
single-process reference with those cuts equals it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from zpipe.planner.async_schedule import ASYNC_SCHEDULE


def async_recovery_refusal(
    *,
    vertical_sync: bool,
    consistency: str,
    rebalance: float | None,
    live_copies: bool = False,
) -> str | None:
    """Why an asynchronous run with these settings cannot recover (None: it can).
    ``consistency="fast"`` (FTPipeHD's recovery,
    :mod:`zpipe.coordinator.runs.async_fast_recovery`) restores the dead's units from
    the copies made without draining, so it needs ``live_copies``."""
    if not vertical_sync:
        return f"{ASYNC_SCHEDULE} recovers with vertical sync only (its versions move)"
    if consistency == "fast" and not live_copies:
        return (
            f"{ASYNC_SCHEDULE} recovers with fast consistency from the copies made without "
            "draining: add live_copies=True (--live-copies), or use exact consistency"
        )
    if consistency not in ("exact", "fast"):
        return f"{ASYNC_SCHEDULE} recovers with exact or fast consistency, not {consistency!r}"
    if rebalance is not None:
        return f"{ASYNC_SCHEDULE} does not rebalance at replicas: use repartition (it recovers too)"
    return None


def cuts_of_run(
    repartitions: Iterable[Mapping[str, Any]], recoveries: Iterable[Mapping[str, Any]]
) -> dict[int, list[int]]:
    """Mini-batch -> the cuts the run trained at from there on: every look that moved
    (``TrainReport.repartitions``: ``at``, ``bounds``, ``moved``) and every recovery
    (``TrainReport.recoveries``: ``resumed_from``, ``bounds``), the recovery winning
    at the same mini-batch (it resumed after the move's replica there) and a later
    recovery from an older replica replacing the recoveries after it. What
    ``train_async_reference(repartitions=...)`` takes."""
    cuts: dict[int, list[int]] = {}
    for look in repartitions:  # the client kept only those not trained again
        if look.get("moved"):
            cuts[int(look["at"])] = [int(b) for b in look["bounds"]]
    resumed: dict[int, list[int]] = {}
    for recovery in recoveries:  # in order: one that went back further replaces the later
        at = int(recovery["resumed_from"])
        resumed = {s: b for s, b in resumed.items() if s < at}
        bounds = recovery.get("bounds")
        if bounds is not None:
            resumed[at] = [int(b) for b in bounds]
    return {**cuts, **resumed}
