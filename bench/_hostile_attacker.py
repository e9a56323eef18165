"""bench/hostile.py's attacker: sends one attack class to one endpoint from its own zmq
context (or, for the slowloris, from plain TCP sockets that speak ZMTP by hand)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import zmq

from bench._hostile_wire import header, many_frames, zmtp_handshake, zmtp_long_frame_header
from zpipe.transport.codec import Message, decode


class Attacker:
    """One attacker: a zmq context and a seeded random source."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], seed: int) -> None:
        import random

        self.context = context
        self.rng = random.Random(seed)

    def socket(self, kind: int, endpoint: str, *, sndtimeo_ms: int = 200) -> zmq.Socket[bytes]:
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, sndtimeo_ms)
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.connect(endpoint)
        return sock

    def send_all(
        self, kind: int, endpoint: str, messages: Iterator[list[bytes]], count: int
    ) -> int:
        sock = self.socket(kind, endpoint)
        sent = 0
        try:
            for frames in messages:
                if sent >= count:
                    break
                try:
                    sock.send_multipart(frames)
                    sent += 1
                except zmq.Again:
                    break
        finally:
            sock.close(linger=0)
        return sent

    def fill_and_hang_up(self, endpoint: str, rounds: int) -> int:
        sent = 0
        for _ in range(rounds):
            sock = self.socket(zmq.PUSH, endpoint)
            for _ in range(40):
                try:
                    sock.send(b"x" * 64)
                    sent += 1
                except zmq.Again:
                    break
            sock.close(linger=0)
        return sent

    def flood(self, kind: int, endpoint: str, seconds: float) -> int:
        sock = self.socket(kind, endpoint)
        sock.setsockopt(zmq.SNDTIMEO, 0)
        probe = header("probe", {"nonce": 1}, [])
        sent, deadline = 0, time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                try:
                    sock.send_multipart([probe])
                    sent += 1
                except zmq.Again:
                    time.sleep(0.001)
        finally:
            sock.close(linger=0)
        return sent

    def probe_flood(self, endpoint: str, seconds: float, connections: int) -> int:
        """``connections`` floods of one probe port at once, each on its own socket
        and thread (libzmq sockets are used by one thread each)."""
        counts = [0] * connections

        def one(i: int) -> None:
            counts[i] = self.flood(zmq.DEALER, endpoint, seconds)

        _join_all([threading.Thread(target=one, args=(i,)) for i in range(connections)], seconds)
        return sum(counts)

    def raw_tcp(self, endpoint: str, connections: int, junk: bool) -> int:
        host, port = _host_port(endpoint)
        sent = 0
        for _ in range(connections):
            try:
                with socket.create_connection((host, port), timeout=1.0) as conn:
                    if junk:
                        conn.sendall(self.rng.randbytes(self.rng.randint(1, 4096)))
                    sent += 1
            except OSError:
                pass
        return sent

    def requests(
        self, endpoint: str, messages: list[list[bytes]], timeout_s: float = 10.0
    ) -> list[Message]:
        """Send each message on one DEALER and collect the replies that come back."""
        sock = self.socket(zmq.DEALER, endpoint)
        replies: list[Message] = []
        try:
            for frames in messages:
                sock.send_multipart(frames)
                if sock.poll(int(timeout_s * 1000)):
                    replies.append(decode(sock.recv_multipart(copy=False)))
        finally:
            sock.close(linger=0)
        return replies

    def big_frames(self, endpoint: str, count: int, megabytes: int) -> int:
        sock = self.socket(zmq.PUSH, endpoint, sndtimeo_ms=5000)
        frame = bytes(megabytes << 20)
        sent = 0
        try:
            for _ in range(count):
                try:
                    sock.send(frame, copy=False)
                    sent += 1
                except zmq.Again:
                    break
        finally:
            sock.close(linger=0)
        return sent

    def frame_storm(
        self,
        kind: int,
        endpoint: str,
        *,
        connections: int,
        messages: int,
        frames: int,
        frame_bytes: int,
        hold_s: float,
        on_sent: Any = None,
    ) -> int:
        """Findings 1 and 3: ``connections`` sockets, each sending ``messages`` messages
        of ``frames`` frames of ``frame_bytes`` bytes, then staying connected for
        ``hold_s`` (``on_sent()`` is called then: what the target holds while the
        attacker is still there) before they all hang up. Messages sent in all."""
        frame = bytes(frame_bytes)
        message = many_frames(frames, frame)
        counts = [0] * connections
        socks = [self.socket(kind, endpoint, sndtimeo_ms=30_000) for _ in range(connections)]

        def one(i: int) -> None:
            for _ in range(messages):
                try:
                    socks[i].send_multipart(message, copy=frame_bytes < 4096)
                    counts[i] += 1
                except zmq.ZMQError:
                    break

        try:
            _join_all([threading.Thread(target=one, args=(i,)) for i in range(connections)], 300)
            time.sleep(hold_s)
            if on_sent is not None:
                on_sent()
        finally:
            for sock in socks:
                sock.close(linger=0)
        return sum(counts)

    def unadmitted_storm(
        self,
        endpoint: str,
        *,
        source: str,
        connections: int,
        frames: int,
        frame_bytes: int,
        wait_s: float,
    ) -> dict[str, int]:
        """Finding 3 from an address the port does not admit: PUSH sockets bound to
        ``source`` (loopback lets a process pick 127.0.0.2) each try one message of
        ``frames`` frames. The port must refuse every handshake (address_auth)
        before it reads a frame. Counts the handshakes refused and admitted within
        ``wait_s`` and the messages the sockets queued (locally: none is delivered)."""
        via = f"tcp://{source}:0;{endpoint.split('://', 1)[1]}"
        message = many_frames(frames, bytes(frame_bytes))
        events = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED
        socks, monitors = [], []
        refused = admitted = queued = 0
        try:
            for _ in range(connections):
                sock = self.context.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDTIMEO, 200)
                monitors.append(sock.get_monitor_socket(events))
                sock.connect(via)
                socks.append(sock)
            for sock in socks:
                try:
                    sock.send_multipart(message, copy=frame_bytes < 4096)
                    queued += 1
                except zmq.Again:
                    pass
            deadline = time.monotonic() + wait_s
            for monitor in monitors:
                while (left := deadline - time.monotonic()) > 0 and monitor.poll(int(left * 1000)):
                    event = int.from_bytes(monitor.recv_multipart()[0][:2], "little")
                    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                        refused += 1
                        break
                    if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                        admitted += 1
                        break
        finally:
            for sock in socks:
                sock.disable_monitor()
                sock.close(linger=0)
            for monitor in monitors:
                monitor.close(linger=0)
        return {"handshakes_refused": refused, "handshakes_admitted": admitted, "queued": queued}

    def slowloris(
        self,
        endpoint: str,
        *,
        connections: int,
        frame_size: int,
        send_bytes: int,
        hold_s: float,
        on_sent: Any = None,
    ) -> dict[str, int]:
        """Finding 7: plain TCP connections that each complete a ZMTP handshake, send
        the first ``send_bytes`` of a ``frame_size``-byte frame and hold for ``hold_s``
        (``on_sent()`` then), then hang up. How many connections sent all they meant to,
        how many the target closed first or stopped reading from, and how many it
        refused before a frame (the handshake goes a step at a time: written in one
        piece with the frame, libzmq 4.3.5 may refuse it before it reads a frame:
        10 of 10 on a bare ROUTER here)."""
        host, port = _host_port(endpoint)
        frame_header = zmtp_long_frame_header(frame_size)
        block = bytes(1 << 20)
        conns: list[socket.socket] = []
        full = cut = stalled = unshaken = 0
        try:
            for _ in range(connections):
                conn = socket.create_connection((host, port), timeout=30.0)
                conns.append(conn)
                try:
                    zmtp_handshake(conn, "DEALER")
                except OSError:  # refused before a frame: the attack never began
                    unshaken += 1
                    continue
                try:
                    conn.sendall(frame_header)
                    left = send_bytes
                    while left > 0:
                        n = min(left, len(block))
                        conn.sendall(block[:n])
                        left -= n
                    full += 1
                except TimeoutError:  # the target stopped reading: the kernel's buffers full
                    stalled += 1
                except OSError:  # the target closed it: a frame it would not take
                    cut += 1
            time.sleep(hold_s)
            if on_sent is not None:
                on_sent()
        finally:
            for conn in conns:
                conn.close()
        return {
            "connections_full": full,
            "connections_cut": cut,
            "connections_stalled": stalled,
            "handshakes_refused": unshaken,
        }


def _host_port(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


def _join_all(threads: list[threading.Thread], seconds: float) -> None:
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 30)
