"""A local cluster's coordinator port, and a coordinator that exits while the cluster
waits for its stages.

The flake these pin (``bench/ftpipehd.py --quick``'s after_failure part): the cluster
picked a free port, closed it, and started the coordinator on it; before the
coordinator had started and bound it, the port was handed out to another socket
bound to port 0 (here: a PULL, as the client's own sink is). The coordinator could
not bind and exited; the client, connected to the PULL (which refuses a DEALER's
handshake; libzmq does not try again), logged ``coordinator_disconnected`` at once
and ``coordinator_lost`` 60 s later.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from zpipe._errors import PipelineError
from zpipe.cluster import AsyncLocalCluster, DeviceSpec, LocalCluster


@pytest.fixture
def squatted_port() -> Iterator[int]:
    """A port held by a PULL socket of this process, as the client's sink holds one."""
    context = zmq.Context()
    squatter = context.socket(zmq.PULL)
    squatter.setsockopt(zmq.LINGER, 0)
    port = squatter.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield port
    finally:
        squatter.close()
        context.term()


def test_cluster_starts_when_the_port_it_would_have_picked_is_taken(
    squatted_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The old cluster picked the coordinator's port with free_tcp_port: hand it the
    # taken port, as the race did. (The cluster no longer picks a port at all: the
    # coordinator binds port 0 and says which it got, so there is nothing to patch.)
    monkeypatch.setattr(
        "zpipe.cluster.local.free_tcp_port", lambda *_: squatted_port, raising=False
    )
    with LocalCluster([DeviceSpec("only")], heartbeat_interval_s=0.5) as cluster:
        assert cluster.coordinator_endpoint.startswith("tcp://127.0.0.1:")
        assert not cluster.coordinator_endpoint.endswith(f":{squatted_port}")
        members = cluster.wait_for_stages(1, timeout_s=120)
        assert [m["name"] for m in members] == ["only"]
        assert (cluster.log_dir / "coordinator.endpoint").read_text().strip() == (
            cluster.coordinator_endpoint
        )


def test_a_coordinator_that_exits_while_stages_are_awaited_fails_the_wait_at_once() -> None:
    async def scenario() -> None:
        async with AsyncLocalCluster([DeviceSpec("only")], heartbeat_interval_s=0.5) as cluster:
            # two stages of a one-stage cluster: only the coordinator's exit ends this
            waiting = asyncio.ensure_future(cluster.wait_for_stages(2, timeout_s=600))
            await asyncio.sleep(0)  # the wait has begun: its first look found all running
            await asyncio.to_thread(cluster.kill, "coordinator")
            # well within the client's coordinator_silence_s (60 s), which the old wait
            # ran into (CoordinatorLostError)
            with pytest.raises(Exception) as raised:
                await asyncio.wait_for(waiting, timeout=45)
            assert "the coordinator exited with -9 while 2 stages were awaited" in str(
                raised.value
            ), repr(raised.value)

    asyncio.run(scenario())


# A restarted coordinator binds the port it had (the stages and the client know only
# that endpoint). From the kill until it listens again (a second or two of starting)
# the port was free, for any socket bound to port 0 to take.


def _port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def test_a_killed_coordinator_port_is_held_until_the_restarted_one_listens() -> None:
    with LocalCluster([DeviceSpec("only")], heartbeat_interval_s=0.5) as cluster:
        cluster.wait_for_stages(1, timeout_s=120)
        endpoint = cluster.coordinator_endpoint
        # The stage dies first: its connections end on its side (TIME_WAIT there), so
        # no closed connection of the coordinator's blocks the port for a minute,
        # which would otherwise keep it from sockets bound to port 0 for that long.
        cluster.kill("only")
        cluster.kill("coordinator")
        # nobody listens there now, and nobody else can bind the port
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", _port_of(endpoint)))
        assert taken.value.errno == errno.EADDRINUSE
        cluster.restart_coordinator()
        cluster.start_stage(DeviceSpec("only"))
        # the stage registers with the new coordinator, on the endpoint it had
        members = cluster.wait_for_stages(1, timeout_s=120)
        assert [m["name"] for m in members] == ["only"]
        assert cluster.coordinator_endpoint == endpoint
        # and the hold is let go once the new coordinator listens
        deadline = time.monotonic() + 60
        while any(t.name == "coordinator-port-hold" for t in threading.enumerate()):
            assert time.monotonic() < deadline, "the port hold was never let go"
            time.sleep(0.05)


def test_a_restart_whose_port_was_taken_meanwhile_fails_at_once_naming_it() -> None:
    with LocalCluster([DeviceSpec("only")], heartbeat_interval_s=0.5) as cluster:
        cluster.wait_for_stages(1, timeout_s=120)
        endpoint = cluster.coordinator_endpoint
        # a coordinator that died on its own (not killed through the cluster): no hold
        coordinator = cluster.processes["coordinator"]
        os.kill(coordinator.pid, signal.SIGKILL)
        coordinator.wait(timeout=30)
        context = zmq.Context()
        squatter = context.socket(zmq.PULL)
        squatter.setsockopt(zmq.LINGER, 0)
        squatter.bind(endpoint)  # as a socket bound to port 0 could have been given it
        try:
            # not a coordinator that exits unseen while the client waits 60 s for it
            with pytest.raises(PipelineError, match="another socket took the port"):
                cluster.restart_coordinator()
        finally:
            squatter.close()
            context.term()
