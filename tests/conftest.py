"""Shared fixtures: one local cluster for every multi-process test that can share it.

Process start-up and ``import torch`` cost seconds each on two cores, so the
cluster is started once per session and every test uses tiny models.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from zpipe.cluster import DeviceSpec, LocalCluster


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    devices = [
        DeviceSpec("s0"),
        DeviceSpec("s1", slowdown=1.5),
        DeviceSpec("s2", bandwidth_mbps=400.0),
    ]
    with LocalCluster(devices, heartbeat_interval_s=0.5, log_level="info") as running:
        yield running
