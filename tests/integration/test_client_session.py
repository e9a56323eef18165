"""The client's run session in-process: its sink loop against fake frames, its failures.

No coordinator and no stages: a real PULL sink on ``inproc://`` fed by a PUSH in
the test, and a stand-in for the control channel.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio
from structlog.testing import capture_logs

from tests._support.client_session import (
    EPOCH,
    LAST,
    RUN,
    _check,
    _connection,
    _Control,
    _never_called,
    _session,
)
from zpipe._errors import PipelineError, RemoteStageError, StageFailedError
from zpipe.client import ClientConnection
from zpipe.config import Timeouts
from zpipe.protocol import WireMessage
from zpipe.protocol.client_control import StageFailed
from zpipe.transport.codec import PROTOCOL_VERSION, Message, encode
from zpipe.transport.sockets import ReceiveLimits, SocketOptions, bind_endpoint, open_socket


@pytest.fixture
def context() -> Iterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.term()


_endpoints = itertools.count()


class _BrokenSink:
    """A sink whose receive fails outright (not one message: the socket itself)."""

    type = zmq.PULL

    def recv(self, copy: bool = True) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.set_exception(RuntimeError("the socket broke"))
        return future


def _result(mb: int, run: int = RUN, value: float = 1.0) -> list[Any]:
    body = {"run": run, "mb": mb, "src": LAST}
    return list(encode(Message("data", body, epoch=EPOCH, tensors=(torch.full((2,), value),))))


def _poison_shape(shape: list[int]) -> list[bytes]:
    """A data message whose empty tensor has an absurd shape (issue 19's poison)."""
    header = {
        "v": PROTOCOL_VERSION,
        "k": "data",
        "e": EPOCH,
        "b": {"run": RUN, "mb": 1, "src": LAST},
        "t": [["float32", shape]],
    }
    return [msgpack.packb(header), b""]


async def test_the_sink_loop_drops_every_poison_message_and_keeps_receiving(
    context: zmq.asyncio.Context,
) -> None:
    endpoint = f"inproc://sink-{next(_endpoints)}"
    sink = context.socket(zmq.PULL)
    sink.bind(endpoint)
    push = context.socket(zmq.PUSH)
    push.connect(endpoint)
    session = _session(_connection(context, sink))
    taken: list[float] = []
    good = asyncio.Event()

    async def handle(message: Any) -> None:
        if message.mb == 13:
            raise KeyError("a bug a message's contents hit in the handler")
        taken.append(float(message.tensors[0][0]))
        good.set()

    try:
        with capture_logs() as logs:
            session.watch(_check, handle, awaited="results")
            for frames in (
                [b"\xc1 not msgpack"],
                _poison_shape([0, 2**63]),
                _poison_shape([0, 2**62, 2**62]),
                _result(1, run=99),  # another run's result
                _result(13),  # the handler raises
                _result(1, value=5.0),  # the one good result
            ):
                await push.send_multipart(frames)
            await session.race(good.wait(), timeout_s=10)
    finally:
        await session.close()
        push.close(linger=0)
        sink.close(linger=0)
    assert taken == [5.0]
    assert not session.failed
    dropped = [e for e in logs if e["event"] == "dropped_message"]
    assert len(dropped) == 5
    assert dropped[-1]["error_type"] == "KeyError"


async def test_a_stage_error_on_the_sink_fails_the_run_with_the_stage_named(
    context: zmq.asyncio.Context,
) -> None:
    endpoint = f"inproc://sink-{next(_endpoints)}"
    sink = context.socket(zmq.PULL)
    sink.bind(endpoint)
    push = context.socket(zmq.PUSH)
    push.connect(endpoint)
    session = _session(_connection(context, sink))

    async def handle(message: WireMessage) -> None:
        raise AssertionError("an error message must not reach the handler")

    body = {"run": RUN, "mb": 4, "src": LAST, "stage": "s1", "message": "shape mismatch"}
    try:
        session.watch(_check, handle, awaited="results")
        await push.send_multipart(list(encode(Message("error", body, epoch=EPOCH))))
        with pytest.raises(RemoteStageError, match="'s1' failed on micro-batch 4") as info:
            await session.race(asyncio.Event().wait(), timeout_s=10)
    finally:
        await session.close()
        push.close(linger=0)
        sink.close(linger=0)
    assert info.value.remote_message == "shape mismatch"


async def test_a_receive_task_that_dies_fails_the_run_instead_of_stalling(
    context: zmq.asyncio.Context,
) -> None:
    session = _session(_connection(context, _BrokenSink()))

    async def handle(message: WireMessage) -> None:
        raise AssertionError("nothing can arrive on a broken sink")

    try:
        with capture_logs() as logs:
            session.watch(_check, handle, awaited="results")
            with pytest.raises(PipelineError, match="sink task of run 7 failed") as info:
                await session.race(asyncio.Event().wait(), timeout_s=10)
    finally:
        await session.close()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert [e["task"] for e in logs if e["event"] == "run_task_failed"] == ["sink"]


async def test_a_stage_failed_notice_for_the_run_fails_it_and_others_are_ignored(
    context: zmq.asyncio.Context,
) -> None:
    sink = context.socket(zmq.PULL)
    sink.bind(f"inproc://sink-{next(_endpoints)}")  # nothing is sent to it
    session = _session(_connection(context, sink))
    control = session.control
    notice = StageFailed(run=RUN, stage="s1", reason="heartbeats lapsed")
    other = StageFailed(run=RUN + 1, stage="s0", reason="old run")
    try:
        session.watch(_check, _never_called, awaited="results")
        await control.failures.put(other)
        await control.failures.put(notice)
        with pytest.raises(StageFailedError, match="s1") as info:
            await session.race(asyncio.Event().wait(), timeout_s=10)
        found = await session.stage_failure_within(1.0)
    finally:
        await session.close()
        sink.close(linger=0)
    assert found is info.value and info.value.reason == "heartbeats lapsed"


async def test_race_prefers_a_result_and_times_out_without_one(
    context: zmq.asyncio.Context,
) -> None:
    session = _session(_connection(context, _BrokenSink()))
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    ready.set_result(3)
    assert await session.race(ready, timeout_s=1) == 3
    with pytest.raises(asyncio.TimeoutError):
        await session.race(asyncio.Event().wait(), timeout_s=0.05)
    session.fail(PipelineError("first"))
    session.fail(PipelineError("second"))  # the first failure is the one raised
    with pytest.raises(PipelineError, match="first"):
        await session.race(asyncio.Event().wait(), timeout_s=1)


async def _handshakes(monitor: zmq.asyncio.Socket, count: int, *, timeout_s: float) -> None:
    """Until ``monitor`` has reported ``count`` successful handshakes in all."""
    for _ in range(count):
        await asyncio.wait_for(monitor.recv_multipart(), timeout_s)


async def test_the_sink_reopens_for_new_limits_only_when_no_run_receives_on_it(
    context: zmq.asyncio.Context,
) -> None:
    # A new run's limits close the sink and bind a fresh one: never under a live
    # receive loop (another run of the same client), which it would cancel.
    sink = open_socket(context, zmq.PULL, SocketOptions())
    bound = bind_endpoint(sink, "tcp://127.0.0.1:0")
    connection = ClientConnection(
        context,
        _Control(),  # type: ignore[arg-type]
        sink,
        bound,
        timeouts=Timeouts(),
        options=SocketOptions(),
        sink_bound=bound,
    )
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    # the peer's handshakes, to send to the fresh socket only once it reached it:
    # a message sent earlier may sit in the pipe of the connection being closed
    handshakes = push.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    push.connect(bound)
    session = _session(connection)
    taken = asyncio.Event()

    async def handle(message: WireMessage) -> None:
        taken.set()

    larger = ReceiveLimits(4 << 20, 4)
    try:
        session.watch(_check, handle, awaited="results")
        await push.send_multipart(_result(1))
        await session.race(taken.wait(), timeout_s=10)  # the loop is receiving
        with pytest.raises(PipelineError, match="another run of the same client"):
            await connection.limit_sink(larger)
        assert connection.sink is sink and not sink.closed
        assert not session.failed
    finally:
        await session.close()
    try:
        await connection.limit_sink(connection.sink_fallback)  # the limits it has
        assert connection.sink is sink
        await connection.limit_sink(larger)
        fresh = connection.sink
        assert fresh is not sink and sink.closed
        assert fresh.getsockopt(zmq.MAXMSGSIZE) == larger.max_message_bytes
        assert fresh.getsockopt(zmq.RCVHWM) == larger.recv_hwm
        # the peer connected before reconnects to the fresh socket by itself
        await _handshakes(handshakes, 2, timeout_s=30)
        await push.send_multipart(_result(2))
        frames = await asyncio.wait_for(fresh.recv_multipart(), 30)
        assert connection.decode_sink_message(frames).body["mb"] == 2
    finally:
        push.disable_monitor()
        handshakes.close(linger=0)
        push.close(linger=0)
        connection.sink.close(linger=0)
