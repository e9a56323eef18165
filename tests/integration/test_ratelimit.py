"""Per-peer token buckets (fake clock), and the probe port dropping a flooder's excess."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from zpipe._errors import ConfigError
from zpipe.stage.linkprobe import ProbeResponder
from zpipe.transport.codec import Message, encode
from zpipe.transport.emulation import LinkSpec
from zpipe.transport.ratelimit import PeerRateLimiter, TokenBucket
from zpipe.transport.sockets import (
    SocketOptions,
    bind_endpoint,
    decode_frames,
    new_context,
    open_socket,
)


def test_a_bucket_allows_its_burst_then_its_rate() -> None:
    bucket = TokenBucket.full(rate_per_s=10.0, burst=3.0, now=0.0)
    assert [bucket.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert not bucket.take(0.05)  # half a token so far
    assert bucket.take(0.1)
    assert not bucket.take(0.1)
    assert [bucket.take(100.0) for _ in range(4)] == [True, True, True, False]  # never above burst


def test_a_flooding_peer_is_limited_and_another_peer_is_not() -> None:
    limiter = PeerRateLimiter(rate_per_s=100.0, burst=10.0)
    served = sum(limiter.allow(b"flood", now=i * 1e-4) for i in range(10_000))  # 1 s of flood
    assert 10 <= served <= 10 + 100 + 1
    assert limiter.dropped_total == 10_000 - served
    assert all(limiter.allow(b"prober", now=1.0) for _ in range(10))


def test_drops_are_reported_at_once_then_at_most_every_interval() -> None:
    limiter = PeerRateLimiter(rate_per_s=1.0, burst=1.0, report_every_s=5.0)
    assert limiter.report_due(0.0) is None  # nothing dropped
    limiter.allow(b"a", 0.0)
    assert not limiter.allow(b"a", 0.0)
    first = limiter.report_due(0.0)
    assert first is not None and (first.dropped, first.worst_peer) == (1, b"a")
    for _ in range(50):
        limiter.allow(b"a", 1.0)
        limiter.allow(b"b", 1.0)
    assert limiter.report_due(1.0) is None  # too soon after the first
    later = limiter.report_due(5.0)
    assert later is not None and later.dropped == 49 + 49 and later.over_s == 5.0
    assert limiter.report_due(20.0) is None  # nothing new


def test_forgotten_peers_bound_the_memory_of_a_connection_flood() -> None:
    limiter = PeerRateLimiter(max_peers=8)
    for i in range(1000):
        limiter.allow(i.to_bytes(4, "big"), now=0.0)
    assert len(limiter._buckets) == 8


def test_a_limit_must_make_sense() -> None:
    with pytest.raises(ConfigError):
        PeerRateLimiter(rate_per_s=0.0)


async def test_the_probe_port_drops_a_floods_excess_and_answers_another_prober() -> None:
    context = new_context()
    options = SocketOptions()
    router = open_socket(context, zmq.ROUTER, options)
    endpoint = bind_endpoint(router, "tcp://127.0.0.1:0")
    responder = ProbeResponder(
        socket=router,
        link=LinkSpec(),
        name="s0",
        send_timeout_s=2.0,
        max_message_bytes=options.max_message_bytes,
        limiter=PeerRateLimiter(rate_per_s=0.001, burst=5.0),
    )
    task = asyncio.create_task(responder.serve())
    flooder = open_socket(context, zmq.DEALER, options, zmtp_heartbeat=False)
    flooder.setsockopt(zmq.SNDHWM, 1000)
    prober = open_socket(context, zmq.DEALER, options, zmtp_heartbeat=False)
    try:
        flooder.connect(endpoint)
        prober.connect(endpoint)
        for nonce in range(200):
            await flooder.send_multipart(encode(Message("link_ping", {"nonce": nonce})))
        await prober.send_multipart(encode(Message("link_ping", {"nonce": 999})))
        reply = decode_frames(await asyncio.wait_for(prober.recv_multipart(copy=False), 10), 2**20)
        assert (reply.kind, reply.body["nonce"]) == ("link_pong", 999)
        deadline = asyncio.get_running_loop().time() + 30
        while responder.limiter.dropped_total < 195:  # every flood message was read
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        pongs = 0
        while await flooder.poll(200):
            await flooder.recv_multipart()
            pongs += 1
        assert pongs == 5  # its burst, nothing more
        assert not task.done()
    finally:
        task.cancel()
        await responder.close()
        for sock in (flooder, prober, router):
            sock.close(linger=0)
        context.term()
