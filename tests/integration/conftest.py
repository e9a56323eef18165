"""The integration lane: real sockets (ZeroMQ over inproc:// and tcp:// on 127.0.0.1,
plain TCP) inside the test's own process; no process is started.

Every test here is marked ``integration`` (``-m integration`` selects the lane,
``-m "not integration"`` leaves it out).
"""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in item.path.resolve().parents:
            item.add_marker(pytest.mark.integration)
