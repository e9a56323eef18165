"""A client whose coordinator endpoint is held by another kind of socket says so.

The after_failure flake of ``bench/ftpipehd.py --quick``: the port a local cluster
had picked for its coordinator was taken first by a PULL (the client's own sink binds
port 0). The client's DEALER connected to the PULL, which refused the handshake, and
libzmq did not connect again: the log said ``coordinator_disconnected`` and, 60 s
later, ``coordinator_lost``, and nothing about why. A connection dropped before its
handshake is now logged as ``coordinator_handshake_refused`` when it happens; one
that completed its handshake and dropped later (a restarted coordinator) is not.
"""

from __future__ import annotations

import asyncio
import time

import zmq
import zmq.asyncio
from structlog.testing import capture_logs

from tests._support.stand_in_coordinator import bind_router, endpoint_of
from zpipe.client.control import ControlChannel
from zpipe.config import Timeouts
from zpipe.transport.sockets import SocketOptions

DEADLINE_S = 30.0  # a loaded machine: the monitor's events come when the loop runs


def _channel(context: zmq.asyncio.Context, endpoint: str) -> ControlChannel:
    """The control channel as a client opens it: watching before it connects."""
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    channel = ControlChannel(dealer, SocketOptions(), Timeouts())
    dealer.connect(endpoint)
    return channel


async def _until_disconnected(channel: ControlChannel) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not channel.disconnected:
        assert time.monotonic() < deadline, "the connection never dropped"
        await asyncio.sleep(0.02)


async def test_a_pull_at_the_coordinators_endpoint_is_reported_as_a_refused_handshake(
    context: zmq.asyncio.Context,
) -> None:
    squatter = context.socket(zmq.PULL)
    squatter.setsockopt(zmq.LINGER, 0)
    port = squatter.bind_to_random_port("tcp://127.0.0.1")
    with capture_logs() as logs:
        channel = _channel(context, f"tcp://127.0.0.1:{port}")
        try:
            await _until_disconnected(channel)
        finally:
            await channel.close()
            squatter.close()
    refused = [e for e in logs if e["event"] == "coordinator_handshake_refused"]
    assert len(refused) == 1, logs
    assert refused[0]["endpoint"] == f"tcp://127.0.0.1:{port}".encode()


async def test_a_coordinator_that_went_away_after_its_handshake_is_not_called_refused(
    context: zmq.asyncio.Context,
) -> None:
    router = bind_router(context)
    with capture_logs() as logs:
        channel = _channel(context, endpoint_of(router))
        try:
            deadline = time.monotonic() + DEADLINE_S
            while channel._handshaken is not True:
                assert time.monotonic() < deadline, "the handshake never finished"
                await asyncio.sleep(0.02)
            router.close(linger=0)
            await _until_disconnected(channel)
        finally:
            await channel.close()
            router.close(linger=0)  # again, if a failed check left it open: term() waits
    events = [e["event"] for e in logs]
    assert "coordinator_disconnected" in events
    assert "coordinator_handshake_refused" not in events
