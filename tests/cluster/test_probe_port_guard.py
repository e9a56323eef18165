"""The probe port's guard against a real flood: a connection of small messages is cut
once it holds a megabyte, and its routing id is remembered (so its backlog can be
dropped unread), while a prober whose link burst (32 MiB) waits unread meanwhile is
left alone (zpipe.transport.conn_budget.probe_port_budget)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
from collections import Counter

import pytest
import zmq

from zpipe.stage.ports import guard_probe_port, open_probe_listener, probe_port_limits
from zpipe.transport.conn_guard import FEW_CONNECTIONS_LOOK_S, bytes_received
from zpipe.transport.sockets import SocketOptions, new_context, recv_frames

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO")

WAIT_S = 60.0  # generous: a loaded machine; the waits end on counts and cuts
MIB = 1 << 20

ATTACKER = """
import sys, time
import zmq
context = zmq.Context()
sock = context.socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.setsockopt(zmq.SNDTIMEO, 0)
sock.connect(sys.argv[1])
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    try:
        sock.send(b"p" * 40)
    except zmq.Again:
        time.sleep(0.001)
sock.close(linger=0)
context.term()
"""


async def _until(condition: object, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not within {WAIT_S} s: {what}"
        await asyncio.sleep(0.02)


async def test_a_small_message_flood_is_cut_and_a_waiting_link_burst_is_not() -> None:
    context = new_context()
    options = SocketOptions()
    limits = probe_port_limits(options)
    probe_in = open_probe_listener(context, options, limits, None)
    endpoint = f"tcp://127.0.0.1:{probe_in.bind_to_random_port('tcp://127.0.0.1')}"
    guard = guard_probe_port(probe_in, limits)
    taken: Counter[bytes] = Counter()
    prober_fd: list[int] = []  # the stage's end of the prober's connection
    reading = asyncio.Event()
    reading.set()

    async def read() -> None:
        while True:
            await reading.wait()
            frames = await recv_frames(probe_in, timeout_s=None, peer="any", awaited="probes")
            taken[frames[0].bytes] += 1
            if frames[0].bytes == b"prober":
                prober_fd.append(int(frames[1].get(zmq.SRCFD)))
            await asyncio.sleep(0)  # as the stage's loops yield: a flood starves no task

    reader = asyncio.create_task(read())
    prober_context = zmq.Context()
    prober = prober_context.socket(zmq.DEALER)
    prober.setsockopt(zmq.LINGER, 0)
    prober.setsockopt(zmq.ROUTING_ID, b"prober")
    drops = prober.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    prober.connect(endpoint)
    attacker = await asyncio.create_subprocess_exec(
        sys.executable, "-c", ATTACKER, endpoint, str(WAIT_S)
    )
    try:
        # the flood is read from for a while (its messages' mean is known) ...
        await _until(lambda: sum(n for r, n in taken.items() if r != b"prober") > 1000, "flood")
        # ... and a prober's pings and first burst (4 x 64 KiB and its end) too, as
        # zpipe.stage.linkprobe.measure_link sends them
        for _ in range(6):
            prober.send(b"i" * 30)
        for _ in range(4):
            prober.send(bytes(64 << 10))
        prober.send(b"e" * 30)
        await _until(lambda: taken[b"prober"] == 11, "the prober's first burst")
        # then the stage reads nothing (busy) while its next burst, 32 MiB, arrives
        reading.clear()
        sender = threading.Thread(target=lambda: [prober.send(bytes(MIB)) for _ in range(32)])
        sender.start()
        await asyncio.to_thread(sender.join, WAIT_S)
        fd = prober_fd[-1]
        first_burst = 6 * 32 + 4 * ((64 << 10) + 9) + 32
        await _until(lambda: (bytes_received(fd) or 0) > first_burst + 32 * MIB, "32 MiB in")
        # a look of the guard's rules now, the burst all held: the prober is not cut
        cuts = guard.look(time.monotonic() + FEW_CONNECTIONS_LOOK_S)
        assert fd not in {c.fd for c in cuts}, cuts
        reading.set()
        await _until(lambda: any(c.reason == "small messages" for c in guard.cuts), "a cut")
        await _until(lambda: taken[b"prober"] == 11 + 32, "the prober's 32 MiB burst")
        assert {c.reason for c in guard.cuts} == {"small messages"}, guard.cuts
        assert not drops.poll(0), "the prober's connection was cut"
        assert not guard.was_cut(b"prober")
        flooders = [r for r in taken if r != b"prober"]
        assert any(guard.was_cut(r) for r in flooders)
    finally:
        attacker.kill()
        await attacker.wait()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        prober.disable_monitor()
        drops.close(linger=0)
        prober.close(linger=0)
        prober_context.term()
        guard.stop()
        probe_in.close(linger=0)
        context.term()
