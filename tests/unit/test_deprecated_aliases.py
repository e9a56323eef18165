"""The modules moved in 0.2.0 keep their old names for one release, with a warning."""

from __future__ import annotations

import importlib
import sys

import pytest

MOVED = [
    ("zpipe.training.schedules", "zpipe.planner.schedules"),
    ("zpipe.training.async_schedule", "zpipe.planner.async_schedule"),
    ("zpipe.recovery.capacity", "zpipe.planner.capacity"),
]


@pytest.mark.parametrize(("old", "new"), MOVED)
def test_an_old_module_name_is_the_new_module_and_warns(old: str, new: str) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=new):
        aliased = importlib.import_module(old)
    assert aliased is importlib.import_module(new)
    sys.modules.pop(old, None)  # the next import warns again
