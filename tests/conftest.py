"""Shared fixtures: one local cluster for every multi-process test that can share it.

Process start-up and ``import torch`` cost seconds each on two cores, so the
cluster is started once per session and every test uses tiny models.

``--cpu-burners N`` runs the session under load: N busy-loop processes (say twice
the cores) compete with the stages and the coordinator for the whole session, so
a test that only passes when its processes are scheduled promptly fails here.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from zpipe.cluster import DeviceSpec, LocalCluster

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


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    devices = [
        DeviceSpec("s0"),
        DeviceSpec("s1", slowdown=1.5),
        DeviceSpec("s2", bandwidth_mbps=400.0),
    ]
    with LocalCluster(devices, heartbeat_interval_s=0.5, log_level="info") as running:
        yield running


@pytest.fixture(scope="session")
def async_recovery_cluster() -> Iterator[LocalCluster]:
    """Three stages (a, b, c) that asynchronous recovery tests kill and start again;
    quick failure detection (tests/test_async_recovery*.py share it)."""
    with LocalCluster(
        [DeviceSpec(name) for name in ("a", "b", "c")],
        heartbeat_interval_s=0.5,
        suspect_after=6,
        probe_intervals=4,
    ) as running:
        yield running
