"""A client drops the coordinator's ``progress`` notice about its presence.

The coordinator sends one to a run's client to learn whether it is still
connected (coordinator/admission.py). It is no news about what the client
waits for: a wait that takes progress notices of that run must not run on
because of it. A ROUTER on loopback TCP stands in for the coordinator.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from zpipe._errors import TransportTimeout
from zpipe.client.control import ControlChannel
from zpipe.config import Timeouts
from zpipe.protocol.client_control import PRESENCE, Progress, Replicate, Replicated
from zpipe.transport.codec import encode
from zpipe.transport.sockets import SocketOptions

WAIT_S = 60.0


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.term()


async def test_a_presence_notice_does_not_extend_a_wait(context: zmq.asyncio.Context) -> None:
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
    channel = ControlChannel(dealer, SocketOptions(), Timeouts())
    timeout_s = 1.5
    try:
        asked = asyncio.ensure_future(
            channel.ask(
                Replicate(run=7, step=2),
                expect=(Replicated,),
                timeout_s=timeout_s,
                awaited="replicated",
                progress_run=7,
            )
        )
        identity, *_ = await asyncio.wait_for(router.recv_multipart(), WAIT_S)
        started = time.monotonic()
        presence = encode(Progress(run=7, awaited=PRESENCE).to_message())

        async def keep_looking() -> None:  # as often as a busy coordinator might
            while True:
                await router.send_multipart([identity, *presence])
                await asyncio.sleep(0.2)

        looking = asyncio.ensure_future(keep_looking())
        try:
            with pytest.raises(TransportTimeout):
                await asyncio.wait_for(asked, 20 * timeout_s)
        finally:
            looking.cancel()
        # a real progress notice would have run the wait on for as long as they came
        assert time.monotonic() - started < 10 * timeout_s
    finally:
        await channel.close()
        router.close(linger=0)
