"""A client whose coordinator is gone for good gives up after the silence timeout.

Issue 33 finding 11: after its coordinator was SIGKILLed (and not restarted),
``LocalCluster.fit()`` waited on: a replica's request has a deadline of
4 x result_s + reply_s (490 s by default). The control channel now counts the
coordinator lost once its connection has been gone for ``coordinator_silence_s``
(what a stage waits too), and every request and run fails then, with a
:class:`CoordinatorLostError`; a coordinator restarted within it is waited for.
A ROUTER on loopback TCP stands in for the coordinator (disconnections are only
reported on real connections).
"""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from tests._support.client_session import _check, _connection, _never_called, _session
from tests._support.stand_in_coordinator import bind_router, control_channel, endpoint_of
from zpipe._errors import CoordinatorLostError, TransportTimeout
from zpipe.client.control import ControlChannel
from zpipe.config import Timeouts
from zpipe.protocol.client_control import Checkpoint
from zpipe.protocol.stage_control import WeightsRequest
from zpipe.transport.codec import Message, encode

ASK_S = 120.0  # far past the silence: a request that ends sooner ended by the loss


def _channel(context: zmq.asyncio.Context, endpoint: str, silence_s: float) -> ControlChannel:
    timeouts = Timeouts(coordinator_silence_s=silence_s)
    return control_channel(context, endpoint, timeouts, reconnect_ivl_ms=50)


async def _first_request(router: zmq.asyncio.Socket) -> list[bytes]:
    return await asyncio.wait_for(router.recv_multipart(), 30)


def _ask(channel: ControlChannel, *, resend: bool = False) -> asyncio.Future[Checkpoint]:
    return asyncio.ensure_future(
        channel.ask(
            WeightsRequest(run=3, step=4),
            expect=(Checkpoint,),
            timeout_s=ASK_S,
            awaited="the trained weights",
            resend_on_reconnect=resend,
        )
    )


async def test_a_request_to_a_coordinator_gone_for_good_fails_after_the_silence(
    context: zmq.asyncio.Context,
) -> None:
    router = bind_router(context)
    channel = _channel(context, endpoint_of(router), silence_s=0.5)
    try:
        asked = _ask(channel)
        await _first_request(router)
        router.close(linger=0)  # SIGKILLed: the connection drops, nobody comes back
        with pytest.raises(CoordinatorLostError, match="the trained weights") as caught:
            await asyncio.wait_for(asked, ASK_S / 2)
        assert isinstance(caught.value, TransportTimeout)  # callers that catch timeouts
        assert channel.lost.is_set()
    finally:
        await channel.close()


async def test_a_coordinator_restarted_within_the_silence_is_waited_for(
    context: zmq.asyncio.Context,
) -> None:
    router = bind_router(context)
    endpoint = endpoint_of(router)
    channel = _channel(context, endpoint, silence_s=60.0)
    try:
        asked = _ask(channel, resend=True)
        await _first_request(router)
        router.close(linger=0)
        await asyncio.sleep(0.2)  # the old process is gone a moment (not a deadline)
        restarted = bind_router(context, endpoint)  # took its run over from disk
        try:
            identity, *_ = await _first_request(restarted)  # the request, sent again
            reply = Message("checkpoint", {"run": 3, "step": 4, "keys": []})
            await restarted.send_multipart([identity, *encode(reply)])
            assert (await asyncio.wait_for(asked, ASK_S / 2)).step == 4
            assert not channel.lost.is_set()
        finally:
            restarted.close(linger=0)
    finally:
        await channel.close()


async def test_a_run_fails_with_the_loss_of_its_coordinator(
    context: zmq.asyncio.Context,
) -> None:
    sink = context.socket(zmq.PULL)
    sink.bind("inproc://sink-coordinator-lost")
    session = _session(_connection(context, sink))
    try:
        session.watch(_check, _never_called, awaited="results")
        session.control.lost.set()  # the channel counted the coordinator lost
        with pytest.raises(CoordinatorLostError, match="stream of run 7"):
            await session.race(asyncio.Event().wait(), timeout_s=ASK_S / 2)
    finally:
        await session.close()
        sink.close(linger=0)
