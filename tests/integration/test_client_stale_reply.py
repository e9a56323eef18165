"""A reply to an earlier copy of a request never answers the next request.

A client sends a request again when its connection to a restarted coordinator is
made again (``resend_on_reconnect``); the coordinator may then answer both copies.
The second answer of a replica of mini-batch 6 was taken as the answer to the
request for mini-batch 9: an asynchronous client went on feeding before the
stages had flushed for that replica, and they waited for a mini-batch it had
already sent (found restarting a coordinator mid-run,
tests/cluster/test_coordinator_restart_async_run.py). A ROUTER on loopback
stands in for the coordinator.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from zpipe.client.control import ControlChannel
from zpipe.config import Timeouts
from zpipe.protocol.client_control import Replicate, Replicated
from zpipe.transport.codec import decode, encode
from zpipe.transport.sockets import SocketOptions


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.term()


async def test_a_second_answer_to_an_earlier_request_does_not_answer_the_next(
    context: zmq.asyncio.Context,
) -> None:
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.ROUTING_ID, b"client-1")
    dealer.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
    channel = ControlChannel(dealer, SocketOptions(), Timeouts())
    try:

        async def answer(step: int) -> None:
            reply = Replicated(run=3, step=step, tensor_count=1, nbytes=4, error="")
            await router.send_multipart([b"client-1", *encode(reply.to_message())])

        def ask(step: int) -> asyncio.Future[Replicated]:
            return asyncio.ensure_future(
                channel.ask(Replicate(run=3, step=step), expect=(Replicated,),
                            timeout_s=30.0, awaited=f"the replica of {step}")
            )  # fmt: skip

        first = ask(6)
        _, *frames = await asyncio.wait_for(router.recv_multipart(), 30)
        assert decode(frames).body["step"] == 6
        await answer(6)
        await answer(6)  # the answer to the copy sent again after a reconnection
        assert (await asyncio.wait_for(first, 30)).step == 6
        second = ask(9)
        _, *frames = await asyncio.wait_for(router.recv_multipart(), 30)
        assert decode(frames).body["step"] == 9
        await asyncio.sleep(0.2)  # the stale answer is read meanwhile, and passed over
        assert not second.done()
        await answer(9)
        assert (await asyncio.wait_for(second, 30)).step == 9
    finally:
        await channel.close()
        router.close(linger=0)
