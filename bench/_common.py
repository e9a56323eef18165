"""Tiny helpers shared by the benchmarks: one JSON object per line on stdout."""

from __future__ import annotations

import json
import sys
from typing import Any


def emit(obj: dict[str, Any]) -> None:
    """Print ``obj`` as one JSON line and flush, so a reader sees it at once."""
    sys.stdout.write(json.dumps(obj, sort_keys=False) + "\n")
    sys.stdout.flush()


def summary(bench: str, **ratios: Any) -> dict[str, Any]:
    """Emit and return the one closing summary object of benchmark ``bench``."""
    obj: dict[str, Any] = {"bench": bench, "summary": True, **ratios}
    emit(obj)
    return obj
