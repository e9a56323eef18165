"""A data port without a receive mark keeps its memory bounded (issue 33).

A stage's data port has no ``RCVHWM`` (libzmq's abort: ``zpipe.stage.ports``), so
while the stage computes and reads nothing, libzmq queues all an admitted peer
sends. Empty messages cost libzmq some 64 bytes for 2 on the wire, past what a
connection's byte budget sees: the guard's process rule cuts such a flood, and a
peer that reconnects and floods again is cut again, its first flood still queued
(the baseline of the rule does not move up to what the cut connection left behind).
"""

from __future__ import annotations

import asyncio
import socket as pysocket
import sys
import threading
import time

import pytest
import zmq

from bench._hostile_wire import zmtp_handshake
from zpipe.stage.ports import guard_data_port, unmark_data_port
from zpipe.transport.conn_budget import DATA_PORT_RSS_GROWTH
from zpipe.transport.conn_guard import resident_bytes
from zpipe.transport.sockets import ReceiveLimits, new_context, open_socket

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO, statm")

WAIT_S = 60.0  # generous: a loaded machine; the waits end on cuts
FLOOD_WIRE_BYTES = 32 << 20  # 16 M empty messages: about 1 GiB inside libzmq, uncut
CHUNK = b"\x00\x00" * (1 << 19)  # ZMTP 3: a last frame of length 0, 512 Ki times


def _flood(host: str, port: int, sent: list[int]) -> None:
    """Start a raw ZMTP PUSH (NULL mechanism) that sends empty messages until it has
    sent FLOOD_WIRE_BYTES or its connection stops taking them (a cut connection is
    left with a closed window: its sends wait out the socket's timeout); appends
    what it sent to ``sent``."""

    def send() -> None:
        total = 0
        with pysocket.create_connection((host, port), timeout=WAIT_S) as raw:
            # a step at a time: greeting, READY and frames written without waiting for
            # the port's steps were at times never read (the flood stuck at 3 MiB, in the
            # kernel's buffers, until its 60 s timeout: no cut, no growth)
            zmtp_handshake(raw, "PUSH")
            try:
                while total < FLOOD_WIRE_BYTES:
                    raw.sendall(CHUNK)
                    total += len(CHUNK)
            except OSError:  # cut, or its window stayed closed
                pass
        sent.append(total)

    threading.Thread(target=send, daemon=True).start()


async def test_a_data_port_that_reads_nothing_cuts_floods_of_empty_messages() -> None:
    context = new_context()
    limits = ReceiveLimits.for_largest_message(8 << 20)  # 16 x 8 MiB per connection
    data_in = open_socket(context, zmq.PULL, limits=limits)
    unmark_data_port(data_in)
    guard = guard_data_port(data_in, limits)
    port = data_in.bind_to_random_port("tcp://127.0.0.1")
    assert guard.budget.per_connection_bytes is not None
    assert guard.budget.per_connection_bytes > FLOOD_WIRE_BYTES  # only the process rule
    before = resident_bytes()
    assert before is not None
    peak = before
    sent: list[int] = []
    try:
        # the second: a reconnect at once, the first flood still queued and unread
        for flood in (1, 2):
            _flood("127.0.0.1", port, sent)
            deadline = time.monotonic() + WAIT_S
            while len(guard.cuts) < flood and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
                peak = max(peak, resident_bytes() or 0)
            assert len(guard.cuts) == flood, (flood, sent, (peak - before) >> 20)
        for _ in range(25):  # a little longer: what arrives after the cut
            await asyncio.sleep(0.02)
            peak = max(peak, resident_bytes() or 0)
        assert [c.reason for c in guard.cuts] == ["memory", "memory"]
        grown = peak - before
        # the rule's growth and what arrives between two looks, not two floods' worth
        # (uncut, each is about 1 GiB)
        assert grown < DATA_PORT_RSS_GROWTH + (256 << 20), grown >> 20
    finally:
        guard.stop()
        data_in.close(linger=0)
        context.term()
