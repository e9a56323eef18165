"""The cluster lane: tests that start processes (stages, coordinators, local and
forked clusters, zpipe commands), all marked ``cluster``; and the local clusters
that several of them share.

Process start-up and ``import torch`` cost seconds each on two cores, so a shared
cluster is started once per session (per xdist worker), every test uses tiny
models, and the clusters' processes are forked from a warm interpreter.
``-m cluster`` selects the lane, ``-m "not cluster"`` leaves it out.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import zmq

from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.cluster.local import ZYGOTE_ENV

if TYPE_CHECKING:  # imported by the fixture: it imports torch
    from tests._support.async_fast_recovery import FastRecoveryRun

_HERE = Path(__file__).resolve().parent

# Every cluster's processes are forked from a warm interpreter (zpipe.cluster.zygote):
# a fresh one imports torch for about three seconds of CPU, a few hundred times in
# this lane. ZPIPE_CLUSTER_ZYGOTE=0 in the environment spawns them instead.
os.environ.setdefault(ZYGOTE_ENV, "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in item.path.resolve().parents:
            item.add_marker(pytest.mark.cluster)


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
    quick failure detection (test_async_recovery*.py share it)."""
    with LocalCluster(
        [DeviceSpec(name) for name in ("a", "b", "c")],
        heartbeat_interval_s=0.5,
        suspect_after=6,
        probe_intervals=4,
    ) as running:
        yield running


@pytest.fixture
def fast_recovery(async_recovery_cluster: LocalCluster) -> FastRecoveryRun:
    """One fast-recovery fit on the shared a, b, c; it reads only its own fit's logs
    (tests/_support/async_fast_recovery.py; test_async_fast_recovery*.py)."""
    from tests._support.async_fast_recovery import FastRecoveryRun

    return FastRecoveryRun(async_recovery_cluster)


@pytest.fixture
def squatted_port() -> Iterator[int]:
    """A port held by a PULL socket of this process, as a client's sink holds one (the
    port-race tests: a process must not be handed a port picked before it binds)."""
    context = zmq.Context()
    squatter = context.socket(zmq.PULL)
    squatter.setsockopt(zmq.LINGER, 0)
    port = squatter.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield port
    finally:
        squatter.close()
        context.term()
