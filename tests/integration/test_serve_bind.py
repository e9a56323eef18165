"""zpipe/serve/server.py bind: the socket listens as soon as it is returned."""

from __future__ import annotations

import socket

from zpipe.serve.server import bind, url_of


def test_a_bound_socket_accepts_a_connection_before_any_server_runs() -> None:
    # `zpipe serve` prints url_of(sock) before uvicorn starts serving on it: a client
    # that connects at once must be queued by the kernel, not refused
    sock = bind("127.0.0.1", 0)
    try:
        port = int(url_of(sock).rsplit(":", 1)[1].split("/", 1)[0])
        with socket.create_connection(("127.0.0.1", port), timeout=10.0):
            pass
    finally:
        sock.close()
