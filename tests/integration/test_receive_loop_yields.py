"""A receive loop under a flood gives the event loop back (issue 33, finding 6).

A message already queued is taken without waiting, so a loop that drops what it
reads never yielded while its queue held more: a probe-port flood starved the
stage's heartbeats until a live stage was declared dead. Here the queue is filled
before the loop starts, and a task that runs on every pass of the event loop
records how far the loop had got: it must see the loop part-way through the
flood, not only once it ran dry (which is all it saw before). Nothing depends on
timing: the flood is queued in full first, over inproc.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest
import zmq
import zmq.asyncio

from zpipe._errors import ProtocolError
from zpipe.stage.linkprobe import ProbeResponder
from zpipe.stage.supervision import serve_messages
from zpipe.transport.codec import Message, encode
from zpipe.transport.emulation import LinkSpec
from zpipe.transport.ratelimit import PeerRateLimiter
from zpipe.transport.sockets import SocketOptions, new_context, open_socket, recv_frames

# room for the whole flood, queued before the loop starts
OPTIONS = SocketOptions(send_hwm=100_000, recv_hwm=100_000)
FLOOD = 1000


@pytest.fixture
def context() -> Iterator[zmq.asyncio.Context]:
    ctx = new_context()
    yield ctx
    ctx.term()


async def observe_until(progress: Callable[[], int], done: int) -> list[int]:
    """``progress()`` on every pass of the event loop until it reaches ``done``."""
    seen: list[int] = []
    while not seen or seen[-1] < done:
        seen.append(progress())
        await asyncio.sleep(0)
    return seen


async def test_the_probe_port_yields_while_a_flood_is_queued(
    context: zmq.asyncio.Context,
) -> None:
    router = open_socket(context, zmq.ROUTER, OPTIONS)
    router.bind("inproc://probe")
    dealer = open_socket(context, zmq.DEALER, OPTIONS)
    dealer.connect("inproc://probe")
    responder = ProbeResponder(
        socket=router,
        link=LinkSpec(),
        name="s0",
        send_timeout_s=2.0,
        max_message_bytes=OPTIONS.max_message_bytes,
        # one message, then (almost) never another: every later one is dropped
        limiter=PeerRateLimiter(rate_per_s=1e-9, burst=1),
    )
    burst = 1
    # not a probe kind: each is refused (past the peer's burst, by the rate limit)
    junk = [bytes(f) for f in encode(Message("probe", {"nonce": 1}))]
    try:
        for _ in range(FLOOD):
            await dealer.send_multipart(junk)
        task = asyncio.create_task(responder.serve())
        seen = await asyncio.wait_for(
            observe_until(lambda: responder.limiter.dropped_total, FLOOD - burst), 60
        )
        assert any(0 < n < FLOOD - burst for n in seen), (
            f"the loop never yielded during the flood: {seen[:5]}"
        )
        assert not task.done()
    finally:
        await responder.close()
        dealer.close(linger=0)
        router.close(linger=0)


async def test_a_receive_loop_that_drops_everything_yields_while_a_flood_is_queued(
    context: zmq.asyncio.Context,
) -> None:
    pull = open_socket(context, zmq.PULL, OPTIONS)
    pull.bind("inproc://data")
    push = open_socket(context, zmq.PUSH, OPTIONS)
    push.connect("inproc://data")
    dropped = 0

    async def receive() -> list[zmq.Frame]:
        return await recv_frames(pull, timeout_s=None, peer="upstream", awaited="data")

    async def handle(frames: list[zmq.Frame]) -> None:
        raise ProtocolError("not from the assigned upstream")

    def on_error(frames: list[zmq.Frame], exc: Exception) -> None:
        nonlocal dropped
        dropped += 1

    try:
        for _ in range(FLOOD):
            await push.send(b"x" * 16)
        task = asyncio.create_task(serve_messages(receive, handle, on_error))
        seen = await asyncio.wait_for(observe_until(lambda: dropped, FLOOD), 60)
        assert any(0 < n < FLOOD for n in seen), f"never yielded during the flood: {seen[:5]}"
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        push.close(linger=0)
        pull.close(linger=0)
