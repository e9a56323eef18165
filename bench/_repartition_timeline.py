"""Where a live re-partition run loses against its bound: the run as a timeline.

Pure arithmetic for ``bench/training_async.py``'s repartition section, from the
client's loss arrival times (seconds from the run's start), the looks
(``TrainReport.repartitions``: ``at``, ``moved``) and the moment the slowing device
changes speed. Each phase's period is the median gap between consecutive losses:

* ``before``: from the first move's loss to the change (the cuts the first looks found);
* ``slow``: from the change to the look that answers it (the old cuts on the slowed
  device: what detection costs);
* ``after``: from the loss that follows that move on.

``detect_s`` is the change to the look that moves (its request: the loss before
it), ``move_s`` the look's request to the next loss (the flush, fetches and
commit), ``lost_s`` the time the slow phase cost against moving at the change
itself (its mini-batches at the slow period instead of the after period) plus the
move's pause beyond one after-period. With ``drains`` (each look's ``drain_s``, the
client's pause and the losses in flight coming back after a look made while the
pipeline ran decided to move), ``detect_s`` splits in two: ``decide_s``, the change
to that look's answer (what detection costs), and ``drain_s`` (what the mini-batches
already in flight cost: they pass the slow device on the old cuts before any move),
with ``decided_batches``, the losses back between the change and the answer.
Against the bound's periods
(``bound_periods_s``: the best cuts' periods before and after the change, in
seconds), ``after_over_bound`` is the after period's share of the bound's speed
(1: as fast as the cost model's best cuts).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Mapping, Sequence
from typing import Any


def _median_gap(times: Sequence[float], low: float, high: float) -> float | None:
    gaps = [b - a for a, b in itertools.pairwise(times) if low < a and b <= high]
    return statistics.median(gaps) if gaps else None


def repartition_timeline(
    arrivals: Sequence[float],
    looks: Sequence[Mapping[str, Any]],
    change_s: float,
    *,
    bound_periods_s: tuple[float, float] | None = None,
    drains: Mapping[int, float] | None = None,
) -> dict[str, Any]:
    """The phases of one FTPipeHD run (see the module notes). ``arrivals``: each
    mini-batch's loss time (index = mini-batch); ``looks``: ``at`` (the look before
    mini-batch ``at``) and ``moved``; ``change_s``: when the device slowed, on the
    same clock; ``bound_periods_s``: the cost model's best periods before and
    after the change."""
    times = list(arrivals)
    moves = [int(look["at"]) for look in looks if look.get("moved") and 0 < look["at"] < len(times)]
    first_move = times[moves[0]] if moves else times[0]
    answer = next((at for at in moves if times[at - 1] >= change_s), None)
    out: dict[str, Any] = {
        "change_s": round(change_s, 3),
        "looks_after_change": sum(
            1 for look in looks if 0 < look["at"] < len(times) and times[look["at"] - 1] >= change_s
        ),
        "detect_at": answer,
    }
    before = _median_gap(times, first_move, change_s)
    if answer is None:
        slow = _median_gap(times, change_s, times[-1])
        out.update(before_s=before, slow_s=slow, after_s=None, detect_s=None, move_s=None)
        out["lost_s"] = None
        return _rounded(out, bound_periods_s)
    asked, resumed = times[answer - 1], times[answer]
    slow = _median_gap(times, change_s, asked)
    after = _median_gap(times, resumed, times[-1])
    out.update(
        before_s=before,
        slow_s=slow,
        after_s=after,
        detect_s=asked - change_s,
        move_s=resumed - asked,
        slow_batches=sum(1 for t in times if change_s < t <= asked),
    )
    drain = (drains or {}).get(answer)
    if drain is not None:
        decided = asked - drain
        out.update(
            decide_s=decided - change_s,
            drain_s=drain,
            decided_batches=sum(1 for t in times if change_s < t <= decided),
        )
    lost = None
    if after is not None:
        slow_batches = out["slow_batches"]
        lost = max(asked - change_s - slow_batches * after, 0.0) + max(resumed - asked - after, 0.0)
    out["lost_s"] = lost
    return _rounded(out, bound_periods_s)


def _rounded(out: dict[str, Any], bound_periods_s: tuple[float, float] | None) -> dict[str, Any]:
    if bound_periods_s is not None:
        best_before, best_after = bound_periods_s
        out["bound_before_s"], out["bound_after_s"] = best_before, best_after
        if out.get("before_s"):
            out["before_over_bound"] = best_before / out["before_s"]
        if out.get("after_s"):
            out["after_over_bound"] = best_after / out["after_s"]
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}
