"""Run an application with uvicorn on a socket bound beforehand.

Binding first (port 0: any free port) lets the caller print or hand out the
real address before the server answers, which is how ``python -m zpipe serve``
reports its URL and how the tests find their server.
"""

from __future__ import annotations

import socket
from typing import Any


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (IPv6 if ``host`` has a colon)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        # listening from here: the command prints its URL before uvicorn's server
        # starts, and a client that connected in between was refused (CI's
        # test_serve_command saw "Connection refused" from the printed URL)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/v1"


def uvicorn_server(app: Any, *, log_level: str = "warning") -> Any:
    """A ``uvicorn.Server`` for ``app``; run it with ``await server.serve(sockets=[sock])``
    and stop it with ``server.should_exit = True``."""
    import uvicorn

    config = uvicorn.Config(
        app,
        log_level=log_level,
        # the endpoint's own deadline (token_timeout) bounds each response; these
        # bound an idle keep-alive connection and a graceful shutdown
        timeout_keep_alive=5,
        timeout_graceful_shutdown=5,
        # the application's lifespan starts and closes a backend that has to (the
        # cluster's run and client belong to this server's event loop)
        lifespan="on",
    )
    return uvicorn.Server(config)
