"""The integration lane: real sockets (ZeroMQ over inproc:// and tcp:// on 127.0.0.1,
plain TCP) inside the test's own process; no process is started.

Every test here is marked ``integration`` (``-m integration`` selects the lane,
``-m "not integration"`` leaves it out). Starting a process fails the test
(tests/_support/lane_guard.py): such a test belongs in tests/cluster/.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from tests._support.lane_guard import PROCESSES, guarded_phase
from tests._support.stand_in_coordinator import bind_router

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


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    """A ZeroMQ context of the test's own, ended after it (a module may define its own)."""
    context = zmq.asyncio.Context()
    yield context
    context.term()


@pytest.fixture
def router(context: zmq.asyncio.Context) -> Iterator[zmq.asyncio.Socket]:
    """A ROUTER on a free loopback port that stands in for the coordinator
    (tests/_support/stand_in_coordinator.py)."""
    router = bind_router(context)
    yield router
    router.close(linger=0)
