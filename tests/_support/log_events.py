"""Reading a process's JSON log lines in tests."""

from __future__ import annotations

from typing import Any

from zpipe.log import read_events


def logged(text: str, event: str) -> list[dict[str, Any]]:
    """The JSON log lines of ``event`` in ``text``, in order (other lines skipped)."""
    return read_events(text, event)
