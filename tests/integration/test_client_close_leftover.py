"""A client closes even when a run's socket was left open: a caller that raises
inside ``async for ... in client.infer_stream(...)`` leaves the stream's async
generator, which owns its PUSH, to be closed only at the loop's shutdown, after
``PipelineClient.__aexit__`` closed the connection (found by bench/hostile.py: the
context's ``term()`` waited for that socket for ever)."""

from __future__ import annotations

import asyncio
import threading

import zmq

from zpipe.client import ClientConnection
from zpipe.config import Timeouts
from zpipe.transport.ports import free_tcp_port
from zpipe.transport.sockets import SocketOptions


def test_close_returns_with_a_runs_push_still_open_and_a_message_queued() -> None:
    closed = threading.Event()
    leftover: list[zmq.Socket[bytes]] = []

    async def scenario() -> None:
        connection = ClientConnection.open(
            f"tcp://127.0.0.1:{free_tcp_port()}",  # nobody there: nothing is answered
            keys_dir=None,
            key_name="client",
            sink_bind="tcp://127.0.0.1:0",
            advertise_host=None,
            timeouts=Timeouts(),
            options=SocketOptions(),
        )
        # a first stage that never came up: the message stays queued in the PUSH
        push = connection.push_to(f"tcp://127.0.0.1:{free_tcp_port()}", None, "s0")
        await push.send_multipart([b"a micro-batch nobody takes"])
        leftover.append(push)
        await connection.close()  # the run's PUSH is still open: its owner never closed it
        closed.set()

    # in a thread of its own, so that a close that waits for ever fails this test
    # instead of hanging the run
    worker = threading.Thread(target=lambda: asyncio.run(scenario()), daemon=True)
    worker.start()
    assert closed.wait(60), "the client's close waited on a socket it did not close"
    worker.join(10)
    assert leftover[0].closed  # closed unsent, with the abandoned run
