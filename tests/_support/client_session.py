"""Helpers shared by tests (moved from test_client_session.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import zmq
import zmq.asyncio

from zpipe._errors import CoordinatorLostError, ProtocolError
from zpipe.client import ClientConnection
from zpipe.client.session import RunSession
from zpipe.config import Timeouts
from zpipe.protocol import WireMessage
from zpipe.transport.sockets import SocketOptions

RUN, EPOCH, LAST = 7, 3, "s2"


class _Control:
    """What a session uses of the control channel, without a coordinator."""

    def __init__(self) -> None:
        self.failures: asyncio.Queue[WireMessage] = asyncio.Queue()
        self.lost = asyncio.Event()  # set by a test: the coordinator is gone for good

    def lost_error(self, awaited: str) -> CoordinatorLostError:
        return CoordinatorLostError(awaited, 1.0)

    async def report_stalls(self, *_: Any) -> None:
        await asyncio.Event().wait()


def _connection(context: zmq.asyncio.Context, sink: Any) -> ClientConnection:
    return ClientConnection(
        context,
        _Control(),  # type: ignore[arg-type]
        sink,
        "inproc://unused",
        timeouts=Timeouts(),
        options=SocketOptions(),
    )


def _session(connection: ClientConnection) -> RunSession:
    session = RunSession(connection, what="stream")
    session.run, session.epoch, session.last_stage = RUN, EPOCH, LAST
    return session


async def _never_called(message: WireMessage) -> None:
    raise AssertionError("no message was sent")


def _check(message: WireMessage) -> None:
    if message.run != RUN:  # type: ignore[attr-defined]
        raise ProtocolError(f"run {message.run} is not this run")  # type: ignore[attr-defined]
