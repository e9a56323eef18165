"""The integration lane: real sockets (ZeroMQ over inproc:// and tcp:// on 127.0.0.1,
plain TCP) inside the test's own process; no process is started.

Every test here is marked ``integration`` (``-m integration`` selects the lane,
``-m "not integration"`` leaves it out). Starting a process fails the test
(tests/_support/lane_guard.py): such a test belongs in tests/cluster/.
"""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from tests._support.lane_guard import PROCESSES, guarded_phase

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in item.path.resolve().parents:
            item.add_marker(pytest.mark.integration)


def _phase() -> Generator[None, Any, Any]:
    return (yield from guarded_phase(PROCESSES, "the integration lane", "tests/cluster/"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _phase())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _phase())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _phase())
