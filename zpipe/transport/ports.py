"""A free TCP port, for a socket this process binds at once (tests).

Never hand the number to another process, or keep it for later: until it is bound,
any socket bound to port 0 on the machine can be given the same port. Bind port 0
where the socket lives and report the port it got (``--endpoint-file``, a ring's
``ready``) instead."""

from __future__ import annotations

import socket


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now. ``host`` may be a bind address as zmq writes
    it (``tcp://*``, ``0.0.0.0``): every interface then."""
    host = host.split("://", 1)[-1]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("" if host in ("*", "0.0.0.0") else host, 0))
        return int(probe.getsockname()[1])
