"""A client sends its ``run_request`` and ``run_go`` again to a restarted coordinator.

A coordinator SIGKILLed during admission (after the assignments, before
``run_ready``) lost the request with its process; the client waited for the
answer until its deadline, 30 + 300 + 10 = 340 s (issue 33, bench/chaos.py).
Once the connection is made again, the client now sends what had no answer, with
the same request id (the coordinator answers a copy once:
tests/unit/coordinator/test_coordinator_admission.py). A ROUTER on loopback TCP
stands in for the coordinator and is closed and bound again for the restart.
"""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from tests._support.stand_in_coordinator import (
    READY,
    REQUEST,
    WAIT_S,
    answer,
    bind_router,
    client_session,
    close_session,
    endpoint_of,
    received,
    restart,
)
from zpipe.client.session import RunSession
from zpipe.config import Timeouts
from zpipe.protocol.client_control import RunRequest, RunStarted

# the copy comes once the reconnection is seen, well inside the silence timeout
TIMEOUTS = Timeouts(coordinator_silence_s=120.0)


def _session(context: zmq.asyncio.Context, endpoint: str) -> RunSession:
    return client_session(context, endpoint, TIMEOUTS)


async def test_the_run_request_goes_again_with_its_id_and_is_answered(
    context: zmq.asyncio.Context,
) -> None:
    router = bind_router(context)
    session = _session(context, endpoint_of(router))
    restarted = None
    try:
        asked = asyncio.ensure_future(
            session.request_run(REQUEST, wait_for_stages_s=10.0, doing="start the run")
        )
        _, first = await received(router)
        assert isinstance(first, RunRequest) and first.request_id
        restarted = await restart(router, context)
        identity, copy = await received(restarted)  # the request, sent again
        assert isinstance(copy, RunRequest) and copy.request_id == first.request_id
        await answer(restarted, identity, READY)
        ready = await asyncio.wait_for(asked, WAIT_S)
        assert ready.run == 5 and session.run == 5 and session.epoch == 2
    finally:
        await close_session(session, router, restarted)


async def test_each_request_has_its_own_id(
    context: zmq.asyncio.Context, router: zmq.asyncio.Socket
) -> None:
    """A training run's resume is a new request: never taken for a copy of the last."""
    session = _session(context, endpoint_of(router))
    try:
        ids = []
        for _ in range(2):
            asked = asyncio.ensure_future(
                session.request_run(REQUEST, wait_for_stages_s=10.0, doing="start the run")
            )
            identity, request = await received(router)
            assert isinstance(request, RunRequest)
            ids.append(request.request_id)
            await answer(router, identity, READY)
            await asyncio.wait_for(asked, WAIT_S)
        assert ids[0] and ids[1] and ids[0] != ids[1]
    finally:
        await close_session(session)


async def test_run_go_goes_again_after_a_restart(context: zmq.asyncio.Context) -> None:
    router = bind_router(context)
    session = _session(context, endpoint_of(router))
    session.run, session.epoch = 5, 2
    restarted = None
    try:
        went = asyncio.ensure_future(session.go())
        _, first = await received(router)
        assert first.KIND == "run_go"  # type: ignore[attr-defined]
        restarted = await restart(router, context)
        identity, copy = await received(restarted)
        assert copy.KIND == "run_go" and copy.run == 5  # type: ignore[attr-defined]
        await answer(restarted, identity, RunStarted(run=5, epoch=2))
        await asyncio.wait_for(went, WAIT_S)
    finally:
        await close_session(session, router, restarted)
