"""Receive limits hold a plan's largest frame on CURVE links too.

libzmq checks MAXMSGSIZE against a frame's size on the wire, which CurveZMQ makes
33 bytes larger; a limit of exactly the largest frame dropped that frame on keyed
links (the connection is closed, the sender's message is lost, a run waits out its
deadline).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from zpipe.transport import security
from zpipe.transport.sockets import ReceiveLimits, apply_receive_limits


async def _arrives(limits: ReceiveLimits, size: int, keys: Path | None) -> bool:
    """Whether one frame of ``size`` bytes crosses a PUSH -> PULL link under ``limits``."""
    ctx = zmq.asyncio.Context()
    auth = None
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    try:
        for sock in (pull, push):
            sock.setsockopt(zmq.LINGER, 0)
        apply_receive_limits(pull, limits)
        if keys is not None:
            server, client = security.load_keypair(keys, "sink"), security.load_keypair(keys, "a")
            auth = security.CurveAuthenticator(ctx, security.PeerAllowList([client.public]))
            auth.start()
            security.secure_server(pull, server)
            security.secure_client(push, client, server.public)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        await asyncio.wait_for(push.send(bytes(size)), 10.0)
        # a frame over the limit closes the connection: nothing ever arrives
        return await pull.poll(3000) != 0 and len(await pull.recv()) == size
    finally:
        push.close(0)
        pull.close(0)
        if auth is not None:
            auth.stop()
        ctx.term()


@pytest.mark.parametrize("largest", [1000, 100_000, 4 << 20])
@pytest.mark.parametrize("keyed", [False, True], ids=["open", "curve"])
def test_the_largest_frame_arrives_and_a_larger_one_does_not(
    largest: int, keyed: bool, tmp_path: Path
) -> None:
    keys = None
    if keyed:
        security.generate_keys(tmp_path, ["sink", "a"])
        keys = tmp_path
    limits = ReceiveLimits.for_largest_message(largest)
    assert asyncio.run(_arrives(limits, largest, keys))
    # the allowance is for CURVE's framing, not more: a frame past it is refused both ways
    assert not asyncio.run(_arrives(limits, limits.max_message_bytes + 1, keys))
