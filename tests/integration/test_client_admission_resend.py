"""A client sends its ``run_request`` and ``run_go`` again to a restarted coordinator.

A coordinator SIGKILLed during admission (after the assignments, before
``run_ready``) lost the request with its process; the client waited for the
answer until its deadline, 30 + 300 + 10 = 340 s (issue 33, bench/chaos.py).
Once the connection is made again, the client now sends what had no answer, with
the same request id (the coordinator answers a copy once:
tests/unit/coordinator/test_coordinator_admission.py). A ROUTER on loopback TCP
stands in for the coordinator and is closed and bound again for the restart.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from zpipe.client import ClientConnection
from zpipe.client.control import ControlChannel
from zpipe.client.session import RunSession
from zpipe.config import Timeouts
from zpipe.protocol import REGISTRY
from zpipe.protocol.client_control import RunReady, RunRequest, RunStarted
from zpipe.transport.codec import decode, encode
from zpipe.transport.sockets import SocketOptions

WAIT_S = 60.0  # generous: the copy comes once the reconnection is seen


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


def _session(context: zmq.asyncio.Context, endpoint: str) -> RunSession:
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.ROUTING_ID, b"client-1")
    dealer.setsockopt(zmq.RECONNECT_IVL, 50)
    dealer.connect(endpoint)
    timeouts = Timeouts(coordinator_silence_s=120.0)
    channel = ControlChannel(dealer, SocketOptions(), timeouts)
    sink = context.socket(zmq.PULL)  # unused: no run is watched here
    connection = ClientConnection(
        context, channel, sink, "inproc://unused", timeouts=timeouts, options=SocketOptions()
    )
    return RunSession(connection, what="stream")


async def _close(session: RunSession, *routers: zmq.asyncio.Socket | None) -> None:
    await session.control.close()
    session.connection.sink.close(linger=0)
    for router in routers:
        if router is not None:
            router.close(linger=0)


async def _received(router: zmq.asyncio.Socket) -> tuple[bytes, object]:
    identity, *frames = await asyncio.wait_for(router.recv_multipart(), WAIT_S)
    return identity, REGISTRY.parse(decode(frames))


REQUEST = RunRequest(
    model={"family": "mlp", "config": {}},
    stages=2,
    dtype="float32",
    sink_endpoint="tcp://127.0.0.1:6000",
    wait_for_stages_s=10.0,
)
READY = RunReady(
    run=5, plan={}, first_endpoint="tcp://s0:1", first_stage="s0", last_stage="s1", epoch=2
)


async def _restart(
    router: zmq.asyncio.Socket, context: zmq.asyncio.Context, endpoint: str
) -> zmq.asyncio.Socket:
    router.close(linger=0)  # SIGKILLed: its connection drops
    await asyncio.sleep(0.2)  # gone a moment (not a deadline)
    return _router(context, endpoint)  # the restarted coordinator, on its port


async def test_the_run_request_goes_again_with_its_id_and_is_answered(
    context: zmq.asyncio.Context,
) -> None:
    router = _router(context, "tcp://127.0.0.1:*")
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    session = _session(context, endpoint)
    restarted = None
    try:
        asked = asyncio.ensure_future(
            session.request_run(REQUEST, wait_for_stages_s=10.0, doing="start the run")
        )
        _, first = await _received(router)
        assert isinstance(first, RunRequest) and first.request_id
        restarted = await _restart(router, context, endpoint)
        identity, copy = await _received(restarted)  # the request, sent again
        assert isinstance(copy, RunRequest) and copy.request_id == first.request_id
        await restarted.send_multipart([identity, *encode(READY.to_message())])
        ready = await asyncio.wait_for(asked, WAIT_S)
        assert ready.run == 5 and session.run == 5 and session.epoch == 2
    finally:
        await _close(session, router, restarted)


async def test_each_request_has_its_own_id(context: zmq.asyncio.Context) -> None:
    """A training run's resume is a new request: never taken for a copy of the last."""
    router = _router(context, "tcp://127.0.0.1:*")
    session = _session(context, router.getsockopt_string(zmq.LAST_ENDPOINT))
    try:
        ids = []
        for _ in range(2):
            asked = asyncio.ensure_future(
                session.request_run(REQUEST, wait_for_stages_s=10.0, doing="start the run")
            )
            identity, request = await _received(router)
            assert isinstance(request, RunRequest)
            ids.append(request.request_id)
            await router.send_multipart([identity, *encode(READY.to_message())])
            await asyncio.wait_for(asked, WAIT_S)
        assert ids[0] and ids[1] and ids[0] != ids[1]
    finally:
        await _close(session, router)


async def test_run_go_goes_again_after_a_restart(context: zmq.asyncio.Context) -> None:
    router = _router(context, "tcp://127.0.0.1:*")
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    session = _session(context, endpoint)
    session.run, session.epoch = 5, 2
    restarted = None
    try:
        went = asyncio.ensure_future(session.go())
        _, first = await _received(router)
        assert first.KIND == "run_go"  # type: ignore[attr-defined]
        restarted = await _restart(router, context, endpoint)
        identity, copy = await _received(restarted)
        assert copy.KIND == "run_go" and copy.run == 5  # type: ignore[attr-defined]
        started = RunStarted(run=5, epoch=2)
        await restarted.send_multipart([identity, *encode(started.to_message())])
        await asyncio.wait_for(went, WAIT_S)
    finally:
        await _close(session, router, restarted)
