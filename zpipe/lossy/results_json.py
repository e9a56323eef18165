"""Strict JSON for experiment results: a non-finite number becomes ``null``.

Python's ``json`` writes ``NaN`` and ``Infinity`` bare, which strict parsers
(browsers, ``jq``, most languages) refuse. A diverged run's loss, or a curve
interval without a finished mini-batch, is written as ``null`` instead, so
``results.json`` is valid JSON whatever the runs did.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np


def finite_or_none(value: Any) -> Any:
    """``value`` with every NaN or infinity (at any depth) replaced by ``None``."""
    if isinstance(value, bool) or value is None or isinstance(value, str | int):
        return value
    if isinstance(value, float | np.floating):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.ndarray):
        return finite_or_none(value.tolist())
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_none(v) for v in value]
    return value


def dumps_strict(payload: Any, *, indent: int | None = None) -> str:
    """JSON text with no bare ``NaN``/``Infinity`` (they become ``null``)."""
    return json.dumps(finite_or_none(payload), indent=indent, allow_nan=False)


def write_results(path: Path, payload: Any, *, indent: int | None = None) -> Path:
    path.write_text(dumps_strict(payload, indent=indent))
    return path
