"""The coordinator's failures as typed errors, where the client can tell which they are.

``run_failed`` carries only a text (the wire has no error type), so the client
recognises the shapes the coordinator's errors are written in: lost units
(``units [a, b) are lost: ...``, :class:`~zpipe.UnitsLostError`'s own text),
stages that died or are gone while the coordinator awaited them
(:class:`~zpipe.StageLostError`), and too few stages or
no plan that fits (:class:`~zpipe.InfeasiblePlanError`). Anything else stays a
:class:`~zpipe.PipelineError` that quotes the coordinator.

Notices (``stage_failed``, ``run_replanned``) come numbered within their run and
are sent again until acknowledged, so a client cut off when one went still gets
it; :class:`NoticeFilter` lets each number through once.
"""

from __future__ import annotations

import re

from zpipe._errors import (
    InfeasiblePlanError,
    PipelineError,
    StageFailedError,
    StageLostError,
    UnitsLostError,
    ZpipeError,
)
from zpipe.protocol.client_control import RunReplanned, StageFailed

_UNITS_LOST = re.compile(r"units \[(\d+), (\d+)\) are lost: (.*)", re.DOTALL)
_STAGES_GONE = re.compile(r"stages \[(.*?)\] are gone")
# a stage that died while the coordinator awaited its reply (StageLostError's own text,
# or the older "died")
_STAGE_DIED = re.compile(r"stage '([^']+)' (?:died|failed): (.*)", re.DOTALL)
# a stage whose connection was gone when the coordinator sent it a request
# (PeerGoneError's own text): a killed stage not yet found dead, or a link cut
_NOT_CONNECTED = re.compile(r"^(\S+) is not connected: could not send \S+$")
# a run_request the live stages cannot serve: too few of them, or no plan fits them
_INFEASIBLE = (
    re.compile(r"\d+ stages registered, \d+ needed after waiting"),
    re.compile(r"stages \[.*?\] are not registered after waiting"),
    re.compile(r"fits? every (device's|stage into its device's) memory"),
    re.compile(r"\bshort: "),
)


def run_failed_error(error: str, doing: str) -> ZpipeError:
    """The error for a ``run_failed`` reply whose text is ``error``; ``doing`` says what
    the client asked for ("start the run", "gather the trained weights")."""
    found = _UNITS_LOST.search(error)
    if found is not None:
        return UnitsLostError((int(found[1]), int(found[2])), found[3])
    gone = _STAGES_GONE.search(error)
    if gone is not None:
        names = re.findall(r"'([^']*)'", gone[1]) or [gone[1]]
        return StageLostError(", ".join(names), f"gone while the client waited to {doing}")
    died = _STAGE_DIED.search(error)
    if died is not None:
        return StageLostError(died[1], died[2])
    if any(pattern.search(error) for pattern in _INFEASIBLE):
        return InfeasiblePlanError(f"the coordinator could not {doing}: {error}")
    return PipelineError(f"the coordinator could not {doing}: {error}")


def stage_not_connected(error: str) -> str | None:
    """The stage a ``run_failed`` text says was not connected when the coordinator
    sent it a request, if that is what it says: a run_request refused so is worth
    asking again (the coordinator now waits for that stage to be back)."""
    found = _NOT_CONNECTED.match(error)
    return None if found is None else found[1]


class NoticeFilter:
    """Which notices are new: each (run, seq) once; a notice without ``seq`` (from an
    older coordinator, never sent again) always."""

    def __init__(self) -> None:
        self._seen: set[tuple[int, int]] = set()

    def first_time(self, notice: StageFailed | RunReplanned) -> bool:
        if notice.seq is None:
            return True
        key = (notice.run, notice.seq)
        if key in self._seen:
            return False
        self._seen.add(key)
        return True


def stage_failed_error(notice: StageFailed) -> StageFailedError:
    """A ``stage_failed`` notice: the coordinator declared one of the run's stages dead."""
    return StageFailedError(notice.stage, notice.reason)
