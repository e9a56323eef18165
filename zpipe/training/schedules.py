"""Deprecated alias of :mod:`zpipe.planner.schedules` (moved in 0.2.0; see CHANGELOG.md)."""

from __future__ import annotations

import sys
import warnings

import zpipe.planner.schedules as _moved

warnings.warn(
    f"{__name__} is deprecated: import {_moved.__name__}", DeprecationWarning, stacklevel=2
)
sys.modules[__name__] = _moved
