"""Deprecated alias of :mod:`zpipe.planner.async_schedule` (moved in 0.2.0; see CHANGELOG.md)."""

from __future__ import annotations

import sys

import zpipe.planner.async_schedule as _moved

sys.modules[__name__] = _moved
