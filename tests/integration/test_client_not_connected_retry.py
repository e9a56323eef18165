"""A run_request refused because a chosen stage's connection was gone is asked again.

A stage killed and started again is counted alive under its name until the
coordinator finds it dead; a run asked for in between fails at its first send
("b is not connected: could not send assign"). The coordinator suspects that stage
from then on and waits for a live process under its name, so the client asks once
more (with a fresh request id) before it gives up. Other refusals are not asked
again. A ROUTER on loopback TCP stands in for the coordinator.
"""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from tests._support.stand_in_coordinator import (
    READY,
    REQUEST,
    WAIT_S,
    answer,
    client_connection,
    endpoint_of,
    received,
)
from zpipe import InfeasiblePlanError, PipelineError
from zpipe.client import ClientConnection
from zpipe.client.session import NOT_CONNECTED_RETRIES, RunSession
from zpipe.protocol.client_control import RunFailed, RunRequest

GONE = RunFailed(error="b is not connected: could not send assign")


def _connection(router: zmq.asyncio.Socket) -> ClientConnection:
    return client_connection(zmq.asyncio.Context(), endpoint_of(router))


async def test_a_run_refused_for_a_stage_not_connected_is_asked_again(
    router: zmq.asyncio.Socket,
) -> None:
    connection = _connection(router)
    try:
        session = RunSession(connection, what="stream")
        asked = asyncio.ensure_future(
            session.request_run(REQUEST, wait_for_stages_s=10.0, doing="start the run")
        )
        identity, first = await received(router)
        await answer(router, identity, GONE)
        identity, second = await received(router)
        assert isinstance(first, RunRequest) and isinstance(second, RunRequest)
        assert second.request_id != first.request_id  # a new request, not a copy
        await answer(router, identity, READY)
        ready = await asyncio.wait_for(asked, WAIT_S)
        assert ready.run == READY.run and session.run == READY.run
    finally:
        await connection.close()


async def test_the_retries_are_bounded_and_the_last_refusal_is_raised(
    router: zmq.asyncio.Socket,
) -> None:
    connection = _connection(router)
    try:
        session = RunSession(connection, what="stream")
        asked = asyncio.ensure_future(
            session.request_run(REQUEST, wait_for_stages_s=10.0, doing="start the run")
        )
        for _ in range(1 + NOT_CONNECTED_RETRIES):
            identity, request = await received(router)
            assert isinstance(request, RunRequest)
            await answer(router, identity, GONE)
        with pytest.raises(PipelineError, match="b is not connected"):
            await asyncio.wait_for(asked, WAIT_S)
        with pytest.raises(asyncio.TimeoutError):  # nothing more was asked
            await asyncio.wait_for(router.recv_multipart(), 0.5)
    finally:
        await connection.close()


async def test_another_refusal_is_raised_at_once(router: zmq.asyncio.Socket) -> None:
    connection = _connection(router)
    try:
        session = RunSession(connection, what="stream")
        asked = asyncio.ensure_future(
            session.request_run(REQUEST, wait_for_stages_s=10.0, doing="start the run")
        )
        identity, _ = await received(router)
        short = RunFailed(error="stages ['b'] are not registered after waiting 10.0 s")
        await answer(router, identity, short)
        with pytest.raises(InfeasiblePlanError):
            await asyncio.wait_for(asked, WAIT_S)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(router.recv_multipart(), 0.5)
    finally:
        await connection.close()
