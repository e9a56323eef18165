"""A request the coordinator may answer twice waits out a restart slower than its deadline.

bench/chaos.py (issue 33, session 41): the stream's coordinator was SIGKILLed as the
stream's last outputs arrived; the client's ``run_end`` waited 20 s for the report
and failed, and the restarted coordinator (importing torch at load 18) listened again
25.6 s after the kill. Every output had arrived exactly once. A request sent again on
reconnection now waits while the connection is down, up to the coordinator's silence
timeout, then goes again with a fresh deadline. A ROUTER on loopback TCP stands in for
the coordinator and is closed and bound again for the restart.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from zpipe._errors import CoordinatorLostError
from zpipe.client import ClientConnection
from zpipe.client.control import ControlChannel
from zpipe.client.session import RunSession
from zpipe.config import Timeouts
from zpipe.protocol import REGISTRY
from zpipe.protocol.client_control import RunStarted
from zpipe.transport.codec import decode, encode
from zpipe.transport.sockets import SocketOptions

WAIT_S = 60.0  # generous: an await that should end well before
REPLY_S = 0.5  # run_go waits twice this: 1 s


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.term()


def _router(context: zmq.asyncio.Context, endpoint: str) -> zmq.asyncio.Socket:
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)
    return router


def _session(context: zmq.asyncio.Context, endpoint: str, silence_s: float) -> RunSession:
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.ROUTING_ID, b"client-1")
    dealer.setsockopt(zmq.RECONNECT_IVL, 50)
    dealer.connect(endpoint)
    timeouts = Timeouts(coordinator_silence_s=silence_s, reply_s=REPLY_S)
    channel = ControlChannel(dealer, SocketOptions(), timeouts)
    sink = context.socket(zmq.PULL)  # unused: no run is watched here
    connection = ClientConnection(
        context, channel, sink, "inproc://unused", timeouts=timeouts, options=SocketOptions()
    )
    session = RunSession(connection, what="stream")
    session.run, session.epoch = 5, 2
    return session


async def _close(session: RunSession, *routers: zmq.asyncio.Socket | None) -> None:
    await session.control.close()
    session.connection.sink.close(linger=0)
    for router in routers:
        if router is not None:
            router.close(linger=0)


async def _received(router: zmq.asyncio.Socket) -> tuple[bytes, object]:
    identity, *frames = await asyncio.wait_for(router.recv_multipart(), WAIT_S)
    return identity, REGISTRY.parse(decode(frames))


async def test_a_restart_slower_than_the_deadline_is_waited_for(
    context: zmq.asyncio.Context,
) -> None:
    router = _router(context, "tcp://127.0.0.1:*")
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    session = _session(context, endpoint, silence_s=60.0)
    restarted = None
    try:
        went = asyncio.ensure_future(session.go())
        _, first = await _received(router)
        assert first.KIND == "run_go"  # type: ignore[attr-defined]
        router.close(linger=0)  # SIGKILLed: its connection drops
        # down three times the request's 1 s deadline (the old code failed at 1 s)
        await asyncio.sleep(3.0)
        assert not went.done()
        restarted = _router(context, endpoint)
        identity, copy = await _received(restarted)  # sent again once connected
        assert copy.KIND == "run_go" and copy.run == 5  # type: ignore[attr-defined]
        await restarted.send_multipart([identity, *encode(RunStarted(run=5, epoch=2).to_message())])
        await asyncio.wait_for(went, WAIT_S)
    finally:
        await _close(session, router, restarted)


async def test_a_coordinator_that_stays_down_is_lost_at_the_silence_timeout(
    context: zmq.asyncio.Context,
) -> None:
    router = _router(context, "tcp://127.0.0.1:*")
    session = _session(context, router.getsockopt_string(zmq.LAST_ENDPOINT), silence_s=3.0)
    try:
        went = asyncio.ensure_future(session.go())
        await _received(router)
        router.close(linger=0)  # gone for good
        with pytest.raises(CoordinatorLostError):
            await asyncio.wait_for(went, WAIT_S)
    finally:
        await _close(session, router)


async def test_a_connected_coordinator_that_does_not_answer_still_times_out(
    context: zmq.asyncio.Context,
) -> None:
    router = _router(context, "tcp://127.0.0.1:*")
    session = _session(context, router.getsockopt_string(zmq.LAST_ENDPOINT), silence_s=60.0)
    try:
        went = asyncio.ensure_future(session.go())
        await _received(router)  # read, never answered: the deadline holds (1 s)
        with pytest.raises(TimeoutError) as raised:
            await asyncio.wait_for(went, WAIT_S)
        assert not isinstance(raised.value, CoordinatorLostError)
    finally:
        await _close(session, router)
