"""Binding a fresh socket to an endpoint another socket of this process just left.

New receive limits need a new listener (libzmq copies ``MAXMSGSIZE`` and
``RCVHWM`` into it at bind). Unbinding and binding the same socket again while
a connected peer sends crashed libzmq 4.3.5's I/O thread (a segfault while the
old listener's connections went down): a PULL with three PUSH peers sending
crashed in every one of 6 runs of 400 re-binds, where closing it and binding a
new PULL to the same port never did (0 of 6; 0 of 10 more without waiting for
traffic). So a port changes its limits by reopening: the caller closes the old
socket (linger 0) and binds its replacement with :func:`bind_when_free` (a
stage's data port, :meth:`zpipe.stage.ports.StagePorts.reopen_data_in`; the
client's sink, :meth:`zpipe.client.connection.ClientConnection.limit_sink`).
"""

from __future__ import annotations

import asyncio
import time

import zmq
import zmq.asyncio

from zpipe._errors import ConfigError
from zpipe.transport import security
from zpipe.transport.address_auth import address_checked_server
from zpipe.transport.keys import KeyPair
from zpipe.transport.sockets import ReceiveLimits, SocketOptions, open_socket

# libzmq's reaper closes the old listener asynchronously: the port is free after a
# few milliseconds, longer on a loaded machine.
FREE_PORT_WAIT_S = 5.0
_RETRY_S = 0.002


def open_listener(
    context: zmq.asyncio.Context,
    options: SocketOptions,
    limits: ReceiveLimits,
    keypair: KeyPair | None,
    *,
    address_domain: str | None = None,
) -> zmq.asyncio.Socket:
    """The replacement of a closed receive-only listener: a PULL under ``limits``, a
    CURVE server with ``keypair`` when there is one (its allow-list lives in the
    context's authenticator, so it carries over), else, given ``address_domain``, one
    whose peers' addresses that domain's handler judges
    (:mod:`zpipe.transport.address_auth`); bind it with :func:`bind_when_free`."""
    fresh = open_socket(context, zmq.PULL, options, limits=limits)
    if keypair is not None:
        security.secure_server(fresh, keypair)
    elif address_domain is not None:
        address_checked_server(fresh, address_domain)
    return fresh


async def bind_when_free(
    sock: zmq.asyncio.Socket, endpoint: str, *, wait_s: float = FREE_PORT_WAIT_S
) -> None:
    """Bind ``sock`` to ``endpoint`` (a resolved address), retrying while the port is
    still held by a socket being closed; ConfigError past ``wait_s``. Waits on the
    event loop, so heartbeats go on meanwhile."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                raise ConfigError(f"cannot bind {endpoint} again: {exc}") from None
        await asyncio.sleep(_RETRY_S)
