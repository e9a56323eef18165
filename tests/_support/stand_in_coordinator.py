"""A ROUTER on loopback TCP that stands in for the coordinator, and a client's
connection to it: the set-up the integration lane's client tests share
(admission resend, requests that wait for a restart, refused runs, ``end-run``).

The test reads what the client sent (:func:`received`) and answers it
(:func:`answer`) with typed messages; a restart is the router closed (the
process SIGKILLed: its connection drops) and bound again on the same port.
"""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from zpipe.client import ClientConnection
from zpipe.client.control import ControlChannel
from zpipe.client.session import RunSession
from zpipe.config import Timeouts
from zpipe.protocol import REGISTRY, WireMessage
from zpipe.protocol.client_control import RunReady, RunRequest
from zpipe.transport.codec import decode, encode
from zpipe.transport.sockets import SocketOptions

WAIT_S = 60.0  # generous: every await here should end well before it

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


def bind_router(
    context: zmq.asyncio.Context, endpoint: str = "tcp://127.0.0.1:*"
) -> zmq.asyncio.Socket:
    """The coordinator's stand-in, bound to ``endpoint`` (a free port by default)."""
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)
    return router


def endpoint_of(router: zmq.asyncio.Socket) -> str:
    return router.getsockopt_string(zmq.LAST_ENDPOINT)


def control_channel(
    context: zmq.asyncio.Context,
    endpoint: str,
    timeouts: Timeouts,
    *,
    reconnect_ivl_ms: int | None = None,
) -> ControlChannel:
    """A client's control channel to the stand-in, as ``client-1``; ``reconnect_ivl_ms``
    makes it reconnect quickly after a restart."""
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.ROUTING_ID, b"client-1")
    if reconnect_ivl_ms is not None:
        dealer.setsockopt(zmq.RECONNECT_IVL, reconnect_ivl_ms)
    dealer.connect(endpoint)
    return ControlChannel(dealer, SocketOptions(), timeouts)


def client_connection(
    context: zmq.asyncio.Context,
    endpoint: str,
    timeouts: Timeouts | None = None,
    *,
    reconnect_ivl_ms: int | None = None,
) -> ClientConnection:
    """A client's connection to the stand-in (:func:`control_channel`); its sink is
    never watched."""
    timeouts = timeouts if timeouts is not None else Timeouts()
    channel = control_channel(context, endpoint, timeouts, reconnect_ivl_ms=reconnect_ivl_ms)
    sink = context.socket(zmq.PULL)  # unused: no run is watched here
    return ClientConnection(
        context, channel, sink, "inproc://unused", timeouts=timeouts, options=SocketOptions()
    )


def client_session(context: zmq.asyncio.Context, endpoint: str, timeouts: Timeouts) -> RunSession:
    """A stream's session over a connection that reconnects within 50 ms."""
    connection = client_connection(context, endpoint, timeouts, reconnect_ivl_ms=50)
    return RunSession(connection, what="stream")


async def close_session(session: RunSession, *routers: zmq.asyncio.Socket | None) -> None:
    """Close what :func:`client_session` opened (not the shared context) and the routers."""
    await session.control.close()
    session.connection.sink.close(linger=0)
    for router in routers:
        if router is not None:
            router.close(linger=0)


async def restart(
    router: zmq.asyncio.Socket, context: zmq.asyncio.Context, down_s: float = 0.2
) -> zmq.asyncio.Socket:
    """The stand-in SIGKILLed (its connection drops), down ``down_s``, then bound
    again on its port: the restarted coordinator."""
    endpoint = endpoint_of(router)
    router.close(linger=0)
    await asyncio.sleep(down_s)  # how long it is gone (not a deadline)
    return bind_router(context, endpoint)


async def received(router: zmq.asyncio.Socket) -> tuple[bytes, WireMessage]:
    """The next message a client sent the stand-in, with the client's identity."""
    identity, *frames = await asyncio.wait_for(router.recv_multipart(), WAIT_S)
    return identity, REGISTRY.parse(decode(frames))


async def answer(router: zmq.asyncio.Socket, identity: bytes, message: WireMessage) -> None:
    await router.send_multipart([identity, *encode(message.to_message())])


async def start_run(connection: ClientConnection, router: zmq.asyncio.Socket) -> RunSession:
    """A stream's run started through the stand-in (run 5, epoch 2)."""
    session = RunSession(connection, what="stream")
    asked = asyncio.ensure_future(
        session.request_run(REQUEST, wait_for_stages_s=10.0, doing="start the run")
    )
    identity, _ = await received(router)
    await answer(router, identity, READY)
    await asyncio.wait_for(asked, WAIT_S)
    return session
