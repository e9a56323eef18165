"""Reading a process's JSON log lines in tests."""

from __future__ import annotations

import json
from typing import Any


def logged(text: str, event: str) -> list[dict[str, Any]]:
    """The JSON log lines of ``event`` in ``text``, in order (other lines skipped)."""
    out = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == event:
            out.append(record)
    return out
