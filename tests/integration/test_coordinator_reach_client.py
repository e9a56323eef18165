"""The shell's ``ReachClient``: whether a run's client is still connected.

The coordinator's ROUTER has ``ROUTER_MANDATORY``: a send to a routing id whose
connection dropped fails at once (EHOSTUNREACH), which is how admission finds a
SIGKILLed client gone (tests/unit/coordinator/test_coordinator_admission.py).
Sockets on loopback TCP in one process.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from zpipe.coordinator.bulk_links import BulkLinks
from zpipe.coordinator.commands import ReachClient
from zpipe.coordinator.shell_sends import ShellSends
from zpipe.protocol import REGISTRY
from zpipe.protocol.client_control import PRESENCE, Progress
from zpipe.transport.codec import decode
from zpipe.transport.sockets import SocketOptions, open_socket

WAIT_S = 60.0
ROUTE = b"client-1"


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.term()


async def test_reach_is_true_for_a_connected_client_false_once_it_is_gone(
    context: zmq.asyncio.Context,
) -> None:
    router = open_socket(context, zmq.ROUTER, SocketOptions())
    router.bind("tcp://127.0.0.1:*")
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.ROUTING_ID, ROUTE)
    dealer.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
    sends = ShellSends(
        bulk_links=BulkLinks(), send_s=5.0, feed=lambda e: None, spawn=lambda c: None
    )
    sends.router = router
    job = ReachClient(ROUTE, Progress(run=3, awaited=PRESENCE), 5.0)
    try:
        await dealer.send(b"hello")  # the ROUTER knows the route once it heard from it
        await asyncio.wait_for(router.recv_multipart(), WAIT_S)
        assert await sends.reach(job) is True
        got = REGISTRY.parse(decode(await asyncio.wait_for(dealer.recv_multipart(), WAIT_S)))
        assert got == Progress(run=3, awaited=PRESENCE)
        dealer.close(linger=0)  # as a killed process's connection drops
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while await sends.reach(job):  # the ROUTER drops the route once it sees the close
            assert asyncio.get_running_loop().time() < deadline, "still reachable"
            await asyncio.sleep(0.01)
        assert await sends.reach(ReachClient(b"never-connected", job.message, 5.0)) is False
    finally:
        dealer.close(linger=0)
        router.close(linger=0)
