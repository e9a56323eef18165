"""bench/_hostile_wire.py: the hand-written ZMTP handshake the slowloris attack uses
is one libzmq admits (a ROUTER on loopback receives the frame sent after it)."""

from __future__ import annotations

import socket

import zmq

from bench._hostile_wire import zmtp_handshake, zmtp_long_frame_header


def test_a_frame_sent_after_the_step_by_step_handshake_reaches_a_router() -> None:
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVTIMEO, 30_000)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        for _ in range(5):  # the one-write handshake failed about every other time
            with socket.create_connection(("127.0.0.1", port), timeout=30.0) as conn:
                zmtp_handshake(conn, "DEALER")
                conn.sendall(zmtp_long_frame_header(5) + b"hello")
                identity, payload = router.recv_multipart()
                assert payload == b"hello" and identity
    finally:
        router.close()
