"""Errors of recovery: what cannot be repaired, and why.

    PipelineError (zpipe._errors)
    └── RecoveryError          recovery cannot produce a runnable pipeline
        └── WeightsLostError   some units' weights have no live holder at the wanted version

Bad input (a malformed plan, a negative period) is a :class:`~zpipe._errors.ConfigError`.
"""

from __future__ import annotations

from collections.abc import Iterable

from zpipe._errors import PipelineError


class RecoveryError(PipelineError):
    """Recovery cannot produce a runnable pipeline (no survivors, nothing to plan over)."""


class WeightsLostError(RecoveryError):
    """No live device, and not the coordinator, holds these units at the wanted version."""

    def __init__(self, units: Iterable[int], version: int | None) -> None:
        self.units = tuple(sorted(set(units)))
        self.version = version
        which = "any version" if version is None else f"version {version}"
        super().__init__(
            f"no live holder has units {format_units(self.units)} at {which}: every device "
            "that held them failed and no replica covers them; restore the run from a "
            "checkpoint, or replicate to the coordinator (global replication) more often"
        )


def format_units(units: Iterable[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``0-2, 5, 7-8``: short enough for an error message."""
    ordered = sorted(set(units))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ", ".join(parts)
