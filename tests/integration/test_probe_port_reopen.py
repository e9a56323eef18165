"""A stage's probe port closed and bound again (how a probe flood's backlog is dropped:
:meth:`zpipe.stage.ports.StagePorts.reopen_probe_in`) keeps its endpoint, its keys and
its guard, and a prober that was connected before reconnects by itself."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from zpipe.protocol import REGISTRY
from zpipe.protocol.peer import LinkPing, LinkPong
from zpipe.stage.config import StageConfig
from zpipe.stage.linkprobe import ProbeResponder
from zpipe.stage.ports import StageKeys, StagePorts
from zpipe.transport import security
from zpipe.transport.codec import decode, encode
from zpipe.transport.emulation import LinkSpec
from zpipe.transport.keys import generate_keys, load_keypair
from zpipe.transport.sockets import new_context

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO")

WAIT_S = 60.0  # generous: a loaded machine; the waits end on replies


async def _pong(sock: zmq.asyncio.Socket, nonce: int) -> None:
    await sock.send_multipart(encode(LinkPing(nonce=nonce).to_message()))
    while True:
        frames = await asyncio.wait_for(sock.recv_multipart(copy=False), WAIT_S)
        reply = REGISTRY.parse(decode(frames))
        if isinstance(reply, LinkPong) and reply.nonce == nonce:
            return


async def test_a_reopened_keyed_probe_port_answers_on_the_same_endpoint(tmp_path: Path) -> None:
    generate_keys(tmp_path, ["coordinator", "s0", "prober"])
    prober_keys = load_keypair(tmp_path, "prober")
    context = new_context()
    config = StageConfig(
        name="s0",
        coordinator="tcp://127.0.0.1:9",
        data_bind="tcp://127.0.0.1:0",
        probe_bind="tcp://127.0.0.1:0",
        keys_dir=tmp_path,
    )
    keys = StageKeys.load(context, config)
    assert keys.probe_allow is not None
    keys.probe_allow.allow(prober_keys.public, "prober")
    ports = StagePorts.open(context, config, keys)
    responder = ProbeResponder(
        socket=ports.probe_in,
        link=LinkSpec(),
        name="s0",
        send_timeout_s=WAIT_S,
        max_message_bytes=config.socket_options.max_message_bytes,
    )
    serving = asyncio.create_task(responder.serve())
    prober = context.socket(zmq.DEALER)
    prober.setsockopt(zmq.LINGER, 0)
    security.secure_client(prober, prober_keys, security.load_keypair_public(tmp_path, "s0"))
    handshakes = prober.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    prober.connect(ports.probe_endpoint)
    try:
        await _pong(prober, 1)
        assert await handshakes.poll(int(WAIT_S * 1000)), "no handshake"
        await handshakes.recv_multipart()
        old_socket, old_guard, bound = ports.probe_in, ports.probe_guard, ports.probe_bound
        # as the responder does (ProbeResponder._drop_backlog): the reader swaps sockets
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        fresh = await ports.reopen_probe_in()
        responder.socket = fresh
        serving = asyncio.create_task(responder.serve())
        assert old_socket.closed and fresh is ports.probe_in
        assert ports.probe_bound == bound
        assert fresh.getsockopt_string(zmq.LAST_ENDPOINT) == bound
        assert fresh.getsockopt(zmq.CURVE_SERVER) == 1
        assert fresh.getsockopt(zmq.RCVHWM) == 0  # still no mark: libzmq's abort
        assert ports.probe_guard is not None and ports.probe_guard is not old_guard
        # the same DEALER, connected before: it reconnects and is admitted again (a
        # ping sent before it saw the old connection go would be lost with it)
        assert await handshakes.poll(int(WAIT_S * 1000)), "the prober never got back in"
        await _pong(prober, 2)
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        prober.disable_monitor()
        handshakes.close(linger=0)
        prober.close(linger=0)
        ports.close()
        keys.stop()
        context.term()
