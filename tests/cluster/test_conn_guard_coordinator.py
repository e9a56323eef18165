"""The connection guard at a real coordinator process (issue 33, finding 1): a
message of a million 1-byte frames is held whole by libzmq before any check of
zpipe's sees a frame; the guard cuts the connection that holds it, and a stage goes
on being served, and a legitimate large message is not cut."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from zpipe.testing.fake_peers import FakePeers

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO, /proc"),
]

WAIT_S = 60.0  # generous: a loaded machine; the waits end on events or counts
FRAMES = 1_000_000
ATTACK_CONNECTIONS = 3
ATTACK_MESSAGES = 3
# Issue 33's goal was a peak under twice an idle coordinator's resident memory, some
# 240 MiB of growth while it imported torch before listening (it now idles at about 60
# MiB, without torch). How far a flood overshoots before the cut depends on how late
# the guard's timer runs (libzmq allocates a few hundred MB a second under it; each
# message is held whole, some 64 MB): loaded CI runs grew 157, 215 and 292 MiB. The
# test asserts a bound that tells a guarded coordinator from an unguarded one (that
# grew 480-960 MiB), not the goal's figure on a starved machine: bench/hostile.py
# (``frame_amplification``) measures the peak on a quiet one.
GROWTH_BOUND = 400 << 20

# A process of its own: real pyzmq DEALERs, each sending messages of a million
# 1-byte frames, then hanging up (prints how many messages went out).
_ATTACKER = """
import sys, threading, zmq
endpoint, connections, messages, frames = sys.argv[1], *map(int, sys.argv[2:5])
ctx = zmq.Context()
sent = []
def one():
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDTIMEO, 30000)
    s.connect(endpoint)
    message = [b"x"] * frames
    for _ in range(messages):
        try:
            s.send_multipart(message)
            sent.append(1)
        except zmq.ZMQError:
            pass
    s.close()
threads = [threading.Thread(target=one) for _ in range(connections)]
for t in threads: t.start()
for t in threads: t.join()
ctx.term()
print(len(sent), flush=True)
"""


# The same from plain TCP sockets that speak ZMTP as a DEALER by hand, then send the
# frames as one buffer: as fast as the kernel takes bytes, where pyzmq's per-frame
# sends are slow enough on a loaded machine for the coordinator to keep up. The
# handshake waits for each of the coordinator's steps (its greeting, its READY): libzmq
# 4.3.5 failed 8 of 18 handshakes that sent greeting and READY in one write
# (EVENT_HANDSHAKE_FAILED_PROTOCOL: reset before any frame was read), and a flood that
# never got in was not cut. No deadline of its own (one that passed on a starved
# coordinator ended the flood before any cut; the test's deadline ends it): a
# connection ends when the coordinator shuts it (a cut: the end of its stream, looked
# for between non-blocking sends, as a blocking one to a cut connection waited some
# 100 s for the kernel to give up) or resets it, or
# when all its messages went out. Prints the messages sent and the connections admitted.
_ZMTP_ATTACKER = """
import select, socket, sys, threading
from bench._hostile_wire import zmtp_greeting, zmtp_ready
endpoint, connections, messages, frames = sys.argv[1], *map(int, sys.argv[2:5])
host, port = endpoint.rsplit("/", 1)[1].rsplit(":", 1)
message = memoryview(b"\\x01\\x01x" * (frames - 1) + b"\\x00\\x01x")
sent, admitted = [], []
def exactly(conn, n):
    got = b""
    while len(got) < n:
        part = conn.recv(n - len(got))
        if not part:
            raise ConnectionResetError("closed during the handshake")
        got += part
    return got
def send_unless_shut(conn):  # conn is non-blocking: a blocked send would miss the end
    offset = 0
    while offset < len(message):
        readable, writable, _ = select.select([conn], [conn], [])
        if readable and not conn.recv(1 << 16):
            raise ConnectionResetError("shut down by the coordinator")
        if writable:
            try:
                offset += conn.send(message[offset:])
            except BlockingIOError:
                pass
def one():
    conn = socket.create_connection((host, int(port)))
    try:
        greeting = zmtp_greeting()
        conn.sendall(greeting)
        exactly(conn, len(greeting))
        conn.sendall(zmtp_ready("DEALER"))
        flags = exactly(conn, 1)[0]  # the coordinator's READY: a command, short or long
        size = exactly(conn, 1)[0] if flags == 0x04 else int.from_bytes(exactly(conn, 8), "big")
        exactly(conn, size)
        admitted.append(1)
        conn.setblocking(False)
        for _ in range(messages):
            send_unless_shut(conn)
            sent.append(1)
    except OSError:
        pass  # cut
    conn.close()
threads = [threading.Thread(target=one) for _ in range(connections)]
for t in threads: t.start()
for t in threads: t.join()
print(len(sent), len(admitted), flush=True)
"""


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm", "rb") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Coordinator:
    """``python -m zpipe.coordinator`` in a process of its own (its memory is its
    own), its JSON log lines gathered by a thread."""

    def __init__(self) -> None:
        # port 0: where it listens comes with coordinator_listening (a port picked here
        # could be taken before the coordinator bound it)
        self.endpoint = ""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "zpipe.coordinator", "--bind", "tcp://127.0.0.1:0",
             "--log-format", "json"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self.lines: list[dict[str, object]] = []
        self.listening = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                self.lines.append(record)
                if record.get("event") == "coordinator_listening":
                    self.endpoint = str(record["endpoint"])
                    self.listening.set()

    def events(self, name: str) -> list[dict[str, object]]:
        return [r for r in list(self.lines) if r.get("event") == name]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def coordinator() -> Iterator[_Coordinator]:
    coord = _Coordinator()
    try:
        assert coord.listening.wait(WAIT_S), "the coordinator did not start listening"
        yield coord
    finally:
        coord.stop()


@pytest.mark.parametrize("script", [_ATTACKER, _ZMTP_ATTACKER], ids=["pyzmq", "zmtp"])
async def test_a_million_frame_flood_stays_within_the_coordinator_s_memory_budget(
    coordinator: _Coordinator, script: str
) -> None:
    """Three DEALERs send messages of a million 1-byte frames (3 MB on the wire, some
    64 MB inside libzmq each) to a real coordinator while a stage heartbeats: the
    coordinator's resident memory grows by less than an unguarded one's did
    (``GROWTH_BOUND``; before the guard it reached 3-5x an idle 240 MB), it logs the
    cuts, and the stage goes on being served. (Reading the messages that arrived whole
    still costs the coordinator seconds of CPU under load: its heartbeat acks may come
    late.) The attack from pyzmq is slow on a loaded machine (the coordinator may keep
    up with it); the one that speaks ZMTP by hand is not."""
    pid = coordinator.proc.pid
    async with FakePeers(coordinator.endpoint, 1, register_timeout_s=WAIT_S) as peers:
        await asyncio.sleep(1.0)  # settled: what registration allocates is in the idle value
        idle = _rss(pid)
        attacker = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, coordinator.endpoint,
            str(ATTACK_CONNECTIONS), str(ATTACK_MESSAGES), str(FRAMES),
            stdout=subprocess.PIPE,
        )  # fmt: skip
        done = asyncio.create_task(attacker.wait())
        peak = idle
        deadline = time.monotonic() + 5 * WAIT_S
        while not done.done() and time.monotonic() < deadline:
            peak = max(peak, _rss(pid))
            await asyncio.sleep(0.02)
        # two seconds more (what is queued is read meanwhile), and until a cut is logged
        # (an attacker may see its connection drop before the coordinator's log line)
        settled = time.monotonic() + 2.0
        deadline = settled + WAIT_S
        while time.monotonic() < settled or (
            not coordinator.events("connection_cut") and time.monotonic() < deadline
        ):
            peak = max(peak, _rss(pid))
            await asyncio.sleep(0.02)
        if not done.done():
            attacker.kill()
        await asyncio.wait_for(done, WAIT_S)
        assert attacker.stdout is not None
        out = (await asyncio.wait_for(attacker.stdout.read(), WAIT_S)).decode()
        assert coordinator.proc.poll() is None, "the coordinator died"
        grown = peak - idle
        assert grown < GROWTH_BOUND, f"grew {grown >> 20} MiB from {idle >> 20} MiB idle"
        cuts = coordinator.events("connection_cut")
        assert cuts, f"nothing was cut (the attacker's messages sent, connections: {out!r})"
        # a stage's connection (heartbeats) never holds what a cut needs
        assert all(int(str(c["held_bytes"])) >= 1 << 20 for c in cuts), cuts
        # and it is served after the attack: acks go on
        stats = peers.peers[0].stats
        acks = stats.acks
        deadline = time.monotonic() + WAIT_S
        while stats.acks < acks + 3 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        assert stats.acks >= acks + 3


def _disconnects(monitor: zmq.Socket[bytes], wait_s: float) -> int:
    """How many times the monitored socket's connection dropped within ``wait_s``."""
    drops = 0
    end = time.monotonic() + wait_s
    while (left := end - time.monotonic()) > 0:
        if not monitor.poll(int(left * 1000)):
            break
        if recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
            drops += 1
    return drops


def test_a_legitimate_large_message_to_the_coordinator_is_not_cut(
    coordinator: _Coordinator,
) -> None:
    """A 64 MiB frame (a replica's tensor sent whole) takes long to arrive under load,
    but it is under the control port's budget: the connection stays up."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    monitor = dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        dealer.connect(coordinator.endpoint)
        big = bytearray(64 << 20)
        for _ in range(2):
            dealer.send_multipart([b"\x93junk", memoryview(big)], copy=False)
        assert _disconnects(monitor, 10.0) == 0
        assert not coordinator.events("connection_cut")
    finally:
        dealer.disable_monitor()
        monitor.close(linger=0)
        dealer.close(linger=0)
        ctx.term()
