"""One run at a time: the client's side of a refusal, and of a run it leaves.

A coordinator refuses another client's ``run_request`` while a run is in flight
(``run_failed`` naming it: tests/unit/coordinator/test_coordinator_admission.py),
and a ``gen_run_request`` or ``lossy_run_request`` too (test_one_run_kinds.py);
the client raises :class:`~zpipe.RunRefusedError` with that run, for every kind. A run the client
leaves without its ``run_end`` (an error, an interrupt) would hold the
coordinator: the connection ends it as it closes. A ROUTER on loopback TCP
stands in for the coordinator.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import numpy as np
import pytest
import zmq
import zmq.asyncio

from tests._support.stand_in_coordinator import (
    REQUEST,
    WAIT_S,
    answer,
    client_connection,
    endpoint_of,
    received,
    start_run,
)
from zpipe import PipelineError, RunRefusedError
from zpipe.client import ClientConnection, PipelineClient
from zpipe.client.runs.generation import GenerateOptions, GenerationRun
from zpipe.client.runs.lossy import run_lossy
from zpipe.client.session import RunSession
from zpipe.lossy.data import Dataset
from zpipe.lossy.simulate import RunConfig, prepare_run
from zpipe.models import ModelSpec
from zpipe.protocol import WireMessage
from zpipe.protocol.client_control import RunEnd, RunFailed, RunReport
from zpipe.protocol.generation import GenRunReady, GenRunRequest
from zpipe.protocol.lossy import LossyRunRequest


def _connection(router: zmq.asyncio.Socket) -> ClientConnection:
    """A client connection in a context of its own: its close ends that context."""
    return client_connection(zmq.asyncio.Context(), endpoint_of(router))


async def test_a_refusal_is_a_run_refused_error_naming_the_run_in_flight(
    router: zmq.asyncio.Socket,
) -> None:
    connection = _connection(router)
    try:
        session = RunSession(connection, what="stream")
        asked = asyncio.ensure_future(
            session.request_run(REQUEST, wait_for_stages_s=10.0, doing="start the run")
        )
        identity, _ = await received(router)
        refused = RunFailed(error="run 4 of another client is in flight", in_flight=4)
        await answer(router, identity, refused)
        with pytest.raises(RunRefusedError, match="run 4 of another client") as caught:
            await asyncio.wait_for(asked, WAIT_S)
        assert caught.value.run == 4 and isinstance(caught.value, PipelineError)
        assert connection.open_run is None  # nothing started: nothing to end
    finally:
        await connection.close()


async def test_a_run_left_open_is_ended_when_the_connection_closes(
    router: zmq.asyncio.Socket,
) -> None:
    connection = _connection(router)
    await start_run(connection, router)  # and the run fails here, say: no finish()
    assert connection.open_run == 5
    closing = asyncio.ensure_future(connection.close())
    identity, ended = await received(router)
    assert isinstance(ended, RunEnd) and ended.run == 5
    assert not closing.done()  # it waits for the end's answer (a next run comes after)
    report = RunReport(run=5, stages={})
    await answer(router, identity, report)
    await asyncio.wait_for(closing, WAIT_S)


async def test_a_close_does_not_wait_long_for_an_unanswered_end(
    router: zmq.asyncio.Socket,
) -> None:
    connection = _connection(router)
    await start_run(connection, router)
    started = time.monotonic()
    await asyncio.wait_for(connection.close(), WAIT_S)  # nobody answers the run_end
    assert time.monotonic() - started < WAIT_S / 2  # bounded (2 s), not a deadline
    _, ended = await received(router)
    assert isinstance(ended, RunEnd) and ended.run == 5


async def test_a_finished_run_is_not_ended_again(
    router: zmq.asyncio.Socket,
) -> None:
    connection = _connection(router)
    session = await start_run(connection, router)
    finished = asyncio.ensure_future(session.finish())
    identity, end = await received(router)
    assert isinstance(end, RunEnd) and end.run == 5
    report = RunReport(run=5, stages={"s0": {}})
    await answer(router, identity, report)
    assert await asyncio.wait_for(finished, WAIT_S) == {"s0": {}}
    assert connection.open_run is None
    await connection.close()
    with pytest.raises(asyncio.TimeoutError):  # no run_end goes at the close
        await asyncio.wait_for(router.recv_multipart(), 1.0)


async def test_end_run_ends_any_run_and_returns_its_counters(
    router: zmq.asyncio.Socket,
) -> None:
    """For a run whose client was killed: it stays in flight until someone ends it."""
    client = PipelineClient(endpoint_of(router), sink_bind="tcp://127.0.0.1:0")
    await client.open()
    try:
        ended = asyncio.ensure_future(client.end_run(4))
        identity, end = await received(router)
        assert isinstance(end, RunEnd) and end.run == 4
        report = RunReport(run=4, stages={"s0": {"microbatches": 3}})
        await answer(router, identity, report)
        assert await asyncio.wait_for(ended, WAIT_S) == {"s0": {"microbatches": 3}}
    finally:
        await client.close()


async def _refused_with(router: zmq.asyncio.Socket, awaited: type[WireMessage], run: int) -> None:
    """Answer the next request (of class ``awaited``) with a refusal naming ``run``."""
    identity, request = await received(router)
    assert isinstance(request, awaited)
    refused = RunFailed(error=f"run {run} of another client is in flight", in_flight=run)
    await answer(router, identity, refused)


async def test_a_generation_start_refused_raises_run_refused_error_naming_the_run(
    router: zmq.asyncio.Socket,
) -> None:
    connection = _connection(router)
    try:
        gen = GenerationRun(connection, ModelSpec.preset("llama-tiny"), GenerateOptions(stages=2))
        starting = asyncio.ensure_future(gen.start())
        await _refused_with(router, GenRunRequest, 4)
        with pytest.raises(RunRefusedError, match="run 4 of another client") as caught:
            await asyncio.wait_for(starting, WAIT_S)
        assert caught.value.run == 4 and gen.ready is None
    finally:
        await connection.close()


async def test_a_lossy_start_refused_raises_run_refused_error_naming_the_run(
    router: zmq.asyncio.Socket,
) -> None:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 6)), rng.integers(0, 3, size=40)
    data = Dataset("random", x, y, x[:4], y[:4])
    cfg = RunConfig(
        allocation="hybrid", n_devices=2, hidden=(4,), batch_size=4, n_data=3, mapping="identity"
    )
    connection = _connection(router)
    # what run_lossy uses of a PipelineClient: its connection and timeouts
    client = SimpleNamespace(connection=connection, timeouts=connection.timeouts)
    try:
        running = asyncio.ensure_future(
            run_lossy(client, prepare_run(cfg, data), data, stages=2)  # type: ignore[arg-type]
        )
        await _refused_with(router, LossyRunRequest, 6)
        with pytest.raises(RunRefusedError, match="run 6 of another client") as caught:
            await asyncio.wait_for(running, WAIT_S)
        assert caught.value.run == 6
    finally:
        await connection.close()


async def test_a_generation_run_left_open_is_ended_when_the_connection_closes(
    router: zmq.asyncio.Socket,
) -> None:
    """A caller that leaves a started generation run without close() (an error) would
    hold the coordinator, which runs one run at a time, until its process ended."""
    connection = _connection(router)
    gen = GenerationRun(connection, ModelSpec.preset("llama-tiny"), GenerateOptions(stages=1))
    starting = asyncio.ensure_future(gen.start())
    identity, request = await received(router)
    assert isinstance(request, GenRunRequest)
    ready = GenRunReady(
        run=8, stages=["s0"], bounds=[[0, 4]], first_endpoint="tcp://127.0.0.1:9",
        first_stage="s0",
    )  # fmt: skip
    await answer(router, identity, ready)
    await asyncio.wait_for(starting, WAIT_S)
    assert connection.open_run == 8
    closing = asyncio.ensure_future(connection.close())  # no gen.close(): left open
    identity, ended = await received(router)
    assert isinstance(ended, RunEnd) and ended.run == 8
    await answer(router, identity, RunReport(run=8, stages={}))
    await asyncio.wait_for(closing, WAIT_S)
