"""Session-wide options of every lane (tests/unit, tests/integration, tests/cluster).

``--cpu-burners N`` runs the session under load: N busy-loop processes (say twice
the cores) compete with the stages and the coordinator for the whole session, so
a test that only passes when its processes are scheduled promptly fails here.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import settings

from tests._support.lane_order import slowest_files_first

# No per-example deadline: a property test's examples are timed, and on a loaded
# two-core machine one that takes 15 ms alone took 700 ms (a flaky failure of a
# planner test). Speed is measured in bench/, never asserted in tests.
settings.register_profile("zpipe", deadline=None)
settings.load_profile("zpipe")

# A process that only burns CPU; it exits on its own if the session dies without
# stopping it (its parent gone, its stdin closes), so no burner outlives a run.
_BURNER = """
import os, sys, threading

def exit_when_orphaned() -> None:
    sys.stdin.buffer.read()  # returns once the session's end of the pipe closes
    os._exit(0)

threading.Thread(target=exit_when_orphaned, daemon=True).start()
while True:
    pass
"""


def _by_file(config: pytest.Config) -> bool:
    """Whether xdist hands out whole files (``--dist loadfile``, CI's second command)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:  # an xdist worker: its own --dist is always "no"
        return bool(workerinput.get("zpipe_by_file"))
    return getattr(config.option, "dist", "no") == "loadfile"


@pytest.hookimpl(optionalhook=True)  # xdist's hook: a worker is about to start
def pytest_configure_node(node: Any) -> None:
    # the workers collect, so they are the ones to order the files
    node.workerinput["zpipe_by_file"] = _by_file(node.config)


def pytest_configure(config: pytest.Config) -> None:
    if _by_file(config):
        # xdist takes the files in the order collected (the order set below), not
        # its own (the most tests first), which left the slow one-test files for last
        config.option.loadscopereorder = False


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _by_file(config):
        # the slowest files first (tests/_support/lane_order.py): the lanes end on
        # short files instead of one worker running a long one alone
        items[:] = slowest_files_first(items)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-burners",
        type=int,
        default=0,
        metavar="N",
        help="run N busy-loop processes for the whole session (a load test: twice the "
        "cores oversubscribes the CPU); default 0",
    )


@pytest.fixture(scope="session", autouse=True)
def cpu_burners(request: pytest.FixtureRequest) -> Iterator[list[subprocess.Popen[bytes]]]:
    count = int(request.config.getoption("--cpu-burners"))
    if count < 0:
        raise pytest.UsageError(f"--cpu-burners must be >= 0, got {count}")
    burners = [
        subprocess.Popen([sys.executable, "-c", _BURNER], stdin=subprocess.PIPE)
        for _ in range(count)
    ]
    try:
        yield burners
    finally:
        for burner in burners:
            burner.kill()
        for burner in burners:
            burner.wait(timeout=10)
