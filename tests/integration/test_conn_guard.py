"""The connection guard at a data port (issue 33, finding 3): one message of thousands
of 60 kB frames is held whole by libzmq before any check of zpipe's sees a frame;
the guard cuts the connection that holds it, and a peer sending the largest
messages the port allows goes on being served. (The coordinator's case starts a
coordinator process: tests/cluster/test_conn_guard_coordinator.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time

import pytest
import zmq

from zpipe.stage.ports import guard_data_port
from zpipe.transport.sockets import ReceiveLimits, new_context, open_socket, recv_frames

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO")

WAIT_S = 60.0  # generous: a loaded machine; the waits end on events or counts


def _push(
    endpoint: str,
    frames: list[memoryview],
    count: int,
    served: threading.Event,
    drops: list[int] | None = None,
) -> threading.Thread:
    """A thread that sends ``count`` messages of ``frames`` from a PUSH of its own,
    stays connected until ``served`` (closing drops what is still queued), and appends
    to ``drops`` each time that connection dropped."""

    def send() -> None:
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.SNDTIMEO, int(WAIT_S * 1000))
        monitor = push.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        push.connect(endpoint)
        with contextlib.suppress(zmq.ZMQError):
            for _ in range(count):
                push.send_multipart(frames, copy=False)
        # still connected while the port reads: a fixed pause was too short for a
        # starved reader, and closing drops what is queued
        served.wait(WAIT_S)
        while monitor.poll(0) and drops is not None:
            monitor.recv_multipart()
            drops.append(1)
        push.disable_monitor()
        monitor.close(linger=0)
        push.close(linger=0)
        ctx.term()

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(
    ("limits", "legit_bytes"),
    [(ReceiveLimits.before_plan(), 60_000), (ReceiveLimits.for_largest_message(8 << 20), 8 << 20)],
    ids=["idle port", "assigned port"],
)
async def test_a_data_port_cuts_a_message_of_many_frames_and_serves_the_others(
    limits: ReceiveLimits, legit_bytes: int
) -> None:
    """Finding 3: one message of 8,000 frames of 60 kB (480 MB) to a data port. The
    guard cuts that connection long before libzmq holds it all; a peer sending the
    largest messages the port's limits allow, as fast as it can, is never cut and
    every one of its messages arrives."""
    context = new_context()
    data_in = open_socket(context, zmq.PULL, limits=limits)
    guard = guard_data_port(data_in, limits)
    port = data_in.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    frame = memoryview(bytes(60_000))
    legit = [memoryview(b"header"), memoryview(bytes(legit_bytes))]
    legit_count = 20
    received = 0
    served = threading.Event()  # the port has read what it needs: the senders may go
    try:
        # two messages: the first may have arrived whole between two looks (then it is
        # read and discarded for its frame count); the second is cut part-way
        attacker = _push(endpoint, [frame] * 8000, 2, served)
        legit_drops: list[int] = []
        sender = _push(endpoint, legit, legit_count, served, legit_drops)
        deadline = time.monotonic() + WAIT_S
        while received < legit_count and time.monotonic() < deadline:
            frames = await recv_frames(data_in, timeout_s=WAIT_S, peer="any", awaited="data")
            assert len(frames) == 2
            received += 1
        while not guard.cuts and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        served.set()
        await asyncio.to_thread(attacker.join, WAIT_S)
        await asyncio.to_thread(sender.join, WAIT_S)
        assert received == legit_count
        # the attacker (cut, it reconnects and sends its next message: cut again)
        assert guard.cuts and {c.reason for c in guard.cuts} == {"connection"}
        assert legit_drops == [], "the legitimate sender's connection was dropped"
    finally:
        served.set()
        guard.stop()
        data_in.close(linger=0)
        context.term()
