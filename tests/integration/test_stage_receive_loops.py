"""A stage's receive loops survive any exception from one message (in-process).

The data port, the probe port and the control loop are driven over real
sockets inside this process: a message whose handling raises something other
than a ProtocolError (a poisoned tensor shape that the decoder hands to
``torch.empty``, a handler bug) is logged and dropped, and the next message is
served as usual. A task that dies anyway is reported, never lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio

from zpipe._errors import ProtocolError
from zpipe.config import Timeouts
from zpipe.protocol import WireMessage
from zpipe.protocol.stage_control import Assign, Connect, Probe, Register, Registered
from zpipe.stage.dataport import DataMessage, DataPort
from zpipe.stage.lifecycle import DataRoute, StageLifecycle, StageTaskFailed
from zpipe.stage.linkprobe import ProbeResponder
from zpipe.stage.metrics import StageCounters
from zpipe.stage.runtime import StageConfig, StageRuntime
from zpipe.stage.supervision import TaskSupervisor, serve_messages
from zpipe.transport.codec import Message, encode
from zpipe.transport.emulation import LinkSpec
from zpipe.transport.sockets import (
    SocketOptions,
    bind_endpoint,
    decode_frames,
    new_context,
    open_socket,
)

OPTIONS = SocketOptions()


def poisoned(message: Message) -> list[bytes]:
    """``message``'s frames with a tensor of no elements but a dimension of 2**63:
    valid framing, and ``torch.empty`` raises TypeError on the shape."""
    header, *_ = encode(Message(message.kind, message.body, message.epoch, (torch.zeros(0),)))
    fields = msgpack.unpackb(bytes(header), raw=False)
    fields["t"] = [["float32", [0, 2**63]]]
    return [msgpack.packb(fields, use_bin_type=True), b""]


def frames_of(message: Message) -> list[bytes]:
    return [bytes(f) for f in encode(message)]


@pytest.fixture
def context() -> Iterator[zmq.asyncio.Context]:
    ctx = new_context()
    yield ctx
    ctx.term()


# ----------------------------------------------------------- the loop itself


async def test_serve_messages_goes_on_after_a_handler_raises() -> None:
    items = iter([1, 2, 3])
    handled: list[int] = []
    errors: list[tuple[int, str]] = []

    async def receive() -> int:
        try:
            return next(items)
        except StopIteration:
            await asyncio.sleep(3600)
            raise AssertionError("unreachable") from None

    async def handle(item: int) -> None:
        if item == 2:
            raise KeyError("missing field")
        handled.append(item)

    task = asyncio.create_task(
        serve_messages(receive, handle, lambda i, e: errors.append((i, type(e).__name__)))
    )
    for _ in range(10):
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert handled == [1, 3]
    assert errors == [(2, "KeyError")]


async def test_a_task_that_dies_is_reported_and_can_be_restarted() -> None:
    deaths: list[tuple[str, str]] = []
    runs = 0

    async def flaky() -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            raise zmq.ZMQError(zmq.ETERM)
        await asyncio.sleep(3600)

    supervisor = TaskSupervisor("s0", lambda name, exc: deaths.append((name, type(exc).__name__)))
    supervisor.start("control", flaky)
    await asyncio.sleep(0.01)
    assert deaths == [("control", "ZMQError")]
    assert not supervisor.running("control")
    supervisor.restart("control")
    await asyncio.sleep(0.01)
    assert runs == 2 and supervisor.running("control")
    await supervisor.stop()  # cancelled on purpose: not a death
    assert deaths == [("control", "ZMQError")] and not supervisor.running("control")


# --------------------------------------------------------------- data port


def _running_lifecycle(epoch: int) -> StageLifecycle:
    registration = Register(name="s0", data_endpoint="", info={})
    lifecycle = StageLifecycle(
        name="s0", coordinator="c", registration=registration, connect_s=1.0,
        silence_limit_s=1.0, now=0.0,
    )  # fmt: skip
    lifecycle.registration_reply(Registered(name="s0", heartbeat_interval=1), 0)
    assign = Assign(
        run=1, model={}, start=0, end=1, index=0, num_stages=1, upstream="client",
        downstream="client", downstream_endpoint="", dtype="float32", epoch=epoch,
    )  # fmt: skip
    lifecycle.control_message(assign, 0.0)
    lifecycle.assignment_ready(1, epoch, build_s=0.0)
    lifecycle.control_message(Connect(run=1, epoch=epoch), 0.0)
    lifecycle.connected(1, DataRoute.inference(epoch, "client"))
    return lifecycle


async def test_the_data_port_survives_poison_and_a_failing_delivery(
    context: zmq.asyncio.Context,
) -> None:
    pull = open_socket(context, zmq.PULL, OPTIONS)
    pull.bind("inproc://data")
    push = open_socket(context, zmq.PUSH, OPTIONS)
    push.connect("inproc://data")
    counters = StageCounters()
    port = DataPort(
        socket=pull,
        lifecycle=_running_lifecycle(epoch=2),
        counters=counters,
        name="s0",
        max_message_bytes=OPTIONS.max_message_bytes,
    )
    delivered: list[int] = []
    done = asyncio.Event()

    async def deliver(message: DataMessage) -> None:
        if message.mb == 1:
            raise RuntimeError("a bug in compute's hand-over")
        delivered.append(message.mb)
        if message.mb == 2:
            done.set()

    def data(mb: int, epoch: int = 2) -> Message:
        return Message("data", {"run": 1, "mb": mb, "src": "client"}, epoch, (torch.ones(2),))

    task = asyncio.create_task(port.serve(deliver, upstream="client"))
    try:
        await push.send_multipart(poisoned(data(0)))  # decoder: not a ProtocolError today
        await push.send_multipart(frames_of(data(1)))  # delivery raises RuntimeError
        await push.send_multipart(frames_of(data(7, epoch=1)))  # an older epoch: stale
        await push.send_multipart([b"\xc1garbage"])  # not msgpack: a ProtocolError
        await push.send_multipart(frames_of(data(2)))
        await asyncio.wait_for(done.wait(), 5.0)
        assert not task.done()
    finally:
        task.cancel()
        push.close(linger=0)
        pull.close(linger=0)
    assert delivered == [2]
    assert counters.dropped == 3 and counters.stale == 1


def test_the_data_port_checks_a_message_synchronously_for_a_receiver_on_any_thread(
    context: zmq.asyncio.Context,
) -> None:
    """:meth:`DataPort.accept` (what a synchronous receiver calls): the message of the
    route's epoch, None for an older epoch (counted stale), a ProtocolError for one
    the verdict drops; every byte counted in."""
    pull = open_socket(context, zmq.PULL, OPTIONS)
    counters = StageCounters()
    port = DataPort(
        socket=pull,
        lifecycle=_running_lifecycle(epoch=2),
        counters=counters,
        name="s0",
        max_message_bytes=OPTIONS.max_message_bytes,
    )

    def frames(mb: int, *, epoch: int = 2, src: str = "client") -> list[zmq.Frame]:
        message = Message("data", {"run": 1, "mb": mb, "src": src}, epoch, (torch.ones(2),))
        return [zmq.Frame(f) for f in frames_of(message)]

    current, older, intruder = frames(3), frames(4, epoch=1), frames(5, src="intruder")
    try:
        accepted = port.accept(current)
        assert accepted is not None and accepted.mb == 3
        assert torch.equal(accepted.tensors[0], torch.ones(2))
        assert port.accept(older) is None
        assert counters.stale == 1
        with pytest.raises(ProtocolError):
            port.accept(intruder)  # not the route's upstream
        received = [current, older, intruder]
        assert counters.bytes_in == sum(len(f) for message in received for f in message)
    finally:
        pull.close(linger=0)


# -------------------------------------------------------------- probe port


async def test_the_probe_port_survives_a_peer_request_that_raises(
    context: zmq.asyncio.Context,
) -> None:
    router = open_socket(context, zmq.ROUTER, OPTIONS)
    endpoint = bind_endpoint(router, "tcp://127.0.0.1:0")

    async def peer_handler(message: WireMessage, sender: bytes | None) -> WireMessage:
        raise KeyError("owner")  # what a malformed backup did to the old handler

    responder = ProbeResponder(
        socket=router,
        link=LinkSpec(),
        name="s0",
        send_timeout_s=2.0,
        max_message_bytes=OPTIONS.max_message_bytes,
        peer_handler=peer_handler,
    )
    task = asyncio.create_task(responder.serve())
    dealer = open_socket(context, zmq.DEALER, OPTIONS)
    dealer.connect(endpoint)
    try:
        backup = Message("backup", {"run": 1, "step": 1, "owner": "x", "keys": []})
        await dealer.send_multipart(frames_of(backup))
        await dealer.send_multipart(poisoned(Message("link_burst", {"burst": 0, "seq": 0})))
        await dealer.send_multipart(frames_of(Message("link_ping", {"nonce": 5})))
        reply = decode_frames(await asyncio.wait_for(dealer.recv_multipart(copy=False), 5.0), 2**20)
        assert (reply.kind, reply.body["nonce"]) == ("link_pong", 5)
        assert not task.done()
    finally:
        task.cancel()
        await responder.close()
        dealer.close(linger=0)
        router.close(linger=0)


# ------------------------------------------------- the runtime's control loop


async def _recv(router: zmq.asyncio.Socket) -> tuple[bytes, Message]:
    frames = await asyncio.wait_for(router.recv_multipart(copy=False), 10.0)
    return frames[0].bytes, decode_frames(frames[1:], 2**30)


async def _expect(router: zmq.asyncio.Socket, kind: str) -> tuple[bytes, Message]:
    while True:  # heartbeats may come in between
        routing_id, message = await _recv(router)
        if message.kind == kind:
            return routing_id, message


async def test_the_control_loop_survives_any_exception_from_one_message(
    context: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    coordinator = open_socket(context, zmq.ROUTER, OPTIONS)
    port = coordinator.bind_to_random_port("tcp://127.0.0.1")
    config = StageConfig(
        name="s0",
        coordinator=f"tcp://127.0.0.1:{port}",
        data_bind="tcp://127.0.0.1:0",
        timeouts=Timeouts(connect_s=10.0, coordinator_silence_s=30.0),
    )
    runtime = StageRuntime(config)
    serving = asyncio.create_task(runtime.serve())

    async def send(routing_id: bytes, frames: list[Any]) -> None:
        await coordinator.send_multipart([routing_id, *frames])

    try:
        routing_id, _ = await _expect(coordinator, "register")
        await send(
            routing_id, frames_of(Message("registered", {"name": "s0", "heartbeat_interval": 5.0}))
        )
        # a poisoned assignment (the decoder raises TypeError) ...
        assign = Message(
            "assign",
            {
                "run": 1,
                "model": {},
                "start": 0,
                "end": 1,
                "index": 0,
                "num_stages": 1,
                "upstream": "client",
                "downstream": "client",
                "downstream_endpoint": "tcp://127.0.0.1:1",
                "dtype": "float32",
            },
        )
        await send(routing_id, poisoned(assign))
        # ... and a handler that raises something no validation expects
        real = runtime.lifecycle.control_message

        def control_message(message: WireMessage, now: float) -> Any:
            if isinstance(message, Probe) and message.nonce == 666:
                raise RuntimeError("a bug in the controller")
            return real(message, now)

        monkeypatch.setattr(runtime.lifecycle, "control_message", control_message)
        await send(routing_id, frames_of(Message("probe", {"nonce": 666})))
        await send(routing_id, frames_of(Message("probe", {"nonce": 7})))
        _, ack = await _expect(coordinator, "probe_ack")
        assert ack.body["nonce"] == 7
        assert runtime.counters.dropped == 2
        assert not serving.done()
        await send(routing_id, frames_of(Message("shutdown", {"reason": "test over"})))
        await asyncio.wait_for(serving, 10.0)  # a clean exit: no exception
    finally:
        if not serving.done():
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
        coordinator.close(linger=0)


async def test_a_receive_task_that_keeps_dying_fails_the_stage_loudly(
    context: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    starts = 0

    async def broken_serve(self: ProbeResponder) -> None:
        nonlocal starts
        starts += 1
        raise zmq.ZMQError(zmq.ENOTSOCK)  # a socket that broke under the loop

    monkeypatch.setattr(ProbeResponder, "serve", broken_serve)
    coordinator = open_socket(context, zmq.ROUTER, OPTIONS)
    port = coordinator.bind_to_random_port("tcp://127.0.0.1")
    runtime = StageRuntime(
        StageConfig(
            name="s0",
            coordinator=f"tcp://127.0.0.1:{port}",
            data_bind="tcp://127.0.0.1:0",
            timeouts=Timeouts(connect_s=10.0),
        )
    )
    serving = asyncio.create_task(runtime.serve())
    try:
        routing_id, _ = await _expect(coordinator, "register")
        registered = Message("registered", {"name": "s0", "heartbeat_interval": 5.0})
        await coordinator.send_multipart([routing_id, *frames_of(registered)])
        with pytest.raises(StageTaskFailed, match="probe task died 4 times"):
            await asyncio.wait_for(serving, 10.0)
        assert starts == 4  # the first run and three restarts
    finally:
        if not serving.done():
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
        coordinator.close(linger=0)
