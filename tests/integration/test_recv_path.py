"""recv_frames on zpipe's receive-only sockets waits on the socket's file descriptor
itself (no zmq.asyncio future per message): it wakes for every message, keeps its
deadline, can be cancelled, is cancelled when the socket closes, and hands the
socket back to zmq.asyncio when that was used on it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq
import zmq.asyncio
from zmq.sugar.attrsettr import AttributeSetter

from zpipe._errors import TransportTimeout
from zpipe.transport.codec import Message, encode
from zpipe.transport.fd_wait import ZpipeSocket
from zpipe.transport.sockets import (
    decode_frames,
    new_context,
    open_socket,
    recv_frames,
)

MAX = 1 << 31


class Pair:
    def __init__(self, context: zmq.asyncio.Context, kinds: tuple[int, int]) -> None:
        self.tx = open_socket(context, kinds[0])
        self.rx = open_socket(context, kinds[1])
        if kinds[1] == zmq.SUB:
            self.rx.setsockopt(zmq.SUBSCRIBE, b"")
            # a publisher drops what does not fit: room for a whole burst
            self.rx.setsockopt(zmq.RCVHWM, 10_000)
            self.tx.setsockopt(zmq.SNDHWM, 10_000)
        port = self.rx.bind_to_random_port("tcp://127.0.0.1")
        self.tx.connect(f"tcp://127.0.0.1:{port}")

    def send(self, n: int) -> None:
        self.tx._shadow_sock.send_multipart(encode(Message("probe_ack", {"nonce": n})))

    async def receive(self, timeout_s: float | None = 30.0) -> int:
        frames = await recv_frames(self.rx, timeout_s=timeout_s, peer="tx", awaited="probe_ack")
        return int(decode_frames(frames, MAX).body["nonce"])

    def waiters(self) -> int:
        """How many receives wait on rx's descriptor."""
        assert isinstance(self.rx, ZpipeSocket)
        reader = self.rx._zpipe_reader
        return 0 if reader is None else len(reader.waiters)

    def reader_on(self) -> bool:
        assert isinstance(self.rx, ZpipeSocket)
        reader = self.rx._zpipe_reader
        return reader is not None and reader.on

    async def waiting(self) -> None:
        """Until a recv_frames on rx waits on the descriptor (events, not sleeps)."""
        assert isinstance(self.rx, ZpipeSocket)
        for _ in range(10_000):
            if self.waiters():
                return
            await asyncio.sleep(0)
        raise AssertionError("recv_frames never waited on the descriptor")


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    context = new_context()
    yield context
    context.destroy(linger=0)


async def test_a_waiting_receive_wakes_for_a_message_sent_later(
    context: zmq.asyncio.Context,
) -> None:
    pair = Pair(context, (zmq.PUSH, zmq.PULL))
    receiving = asyncio.create_task(pair.receive())
    await pair.waiting()
    pair.send(7)
    assert await asyncio.wait_for(receiving, 30) == 7
    assert pair.rx._current_loop is None  # zmq.asyncio never had to watch it


@pytest.mark.parametrize("kinds", [(zmq.PUSH, zmq.PULL), (zmq.PUB, zmq.SUB)])
async def test_every_message_of_a_burst_from_two_senders_is_received(
    context: zmq.asyncio.Context, kinds: tuple[int, int]
) -> None:
    pair = Pair(context, kinds)
    other = open_socket(context, kinds[0])
    other.setsockopt(zmq.SNDHWM, 10_000)
    other.connect(pair.rx.getsockopt_string(zmq.LAST_ENDPOINT))
    if kinds[0] == zmq.PUB:  # a subscription has to reach both publishers first
        heard: set[int] = set()
        while heard != {-1, -2}:
            pair.send(-1)
            other._shadow_sock.send_multipart(encode(Message("probe_ack", {"nonce": -2})))
            try:
                while True:
                    heard.add(await pair.receive(timeout_s=0.05))
            except TransportTimeout:
                pass  # all that came: publish again until both got through

    async def send_all() -> None:
        for n in range(0, 2000, 2):
            pair.send(n)
            other._shadow_sock.send_multipart(encode(Message("probe_ack", {"nonce": n + 1})))
            if n % 50 == 0:
                await asyncio.sleep(0)  # let the receiver wait now and then

    sending = asyncio.create_task(send_all())
    got = [await pair.receive() for _ in range(2000)]
    await sending
    assert sorted(got) == list(range(2000))
    assert [n for n in got if n % 2 == 0] == list(range(0, 2000, 2))  # per sender, in order


async def test_two_tasks_waiting_on_one_socket_both_get_a_message(
    context: zmq.asyncio.Context,
) -> None:
    pair = Pair(context, (zmq.PUSH, zmq.PULL))
    first = asyncio.create_task(pair.receive())
    second = asyncio.create_task(pair.receive())
    await pair.waiting()
    for _ in range(100):  # until both wait (events, not sleeps)
        if pair.waiters() == 2:
            break
        await asyncio.sleep(0)
    pair.send(1)
    pair.send(2)
    assert sorted(await asyncio.wait_for(asyncio.gather(first, second), 30)) == [1, 2]
    assert pair.waiters() == 0


async def test_a_wait_keeps_its_deadline_and_leaves_the_socket_usable(
    context: zmq.asyncio.Context,
) -> None:
    pair = Pair(context, (zmq.PUSH, zmq.PULL))
    with pytest.raises(TransportTimeout, match="probe_ack"):
        await pair.receive(timeout_s=0.2)
    assert pair.waiters() == 0
    pair.send(1)
    assert await pair.receive() == 1


async def test_a_cancelled_wait_leaves_the_socket_usable_for_both_ways_of_receiving(
    context: zmq.asyncio.Context,
) -> None:
    pair = Pair(context, (zmq.PUSH, zmq.PULL))
    receiving = asyncio.create_task(pair.receive(timeout_s=None))
    await pair.waiting()
    receiving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await receiving
    pair.send(2)
    assert await pair.receive() == 2
    # zmq.asyncio can still take the socket over; recv_frames then goes through it
    pair.send(3)
    frames = await asyncio.wait_for(pair.rx.recv_multipart(copy=False), 30)
    assert decode_frames(frames, MAX).body["nonce"] == 3
    receiving = asyncio.create_task(pair.receive())
    await asyncio.sleep(0)
    pair.send(4)
    assert await asyncio.wait_for(receiving, 30) == 4


async def test_closing_the_socket_cancels_a_wait_as_zmq_asyncio_does(
    context: zmq.asyncio.Context,
) -> None:
    pair = Pair(context, (zmq.PUSH, zmq.PULL))
    receiving = asyncio.create_task(pair.receive(timeout_s=None))
    await pair.waiting()
    pair.rx.close(linger=0)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(receiving, 30)


async def test_a_receive_loop_keeps_the_reader_and_schedules_nothing_per_message(
    context: zmq.asyncio.Context,
) -> None:
    # Before, every waited receive scheduled a look for an idle reader (a callback
    # and a pass of the loop per message); the reader now stays on while receives
    # wait one after another, and comes off when the descriptor has news nobody
    # waits for.
    loop = asyncio.get_running_loop()
    pair = Pair(context, (zmq.PUSH, zmq.PULL))
    assert isinstance(pair.rx, ZpipeSocket)
    adds = removes = socket_callbacks = 0
    add_reader, remove_reader, call_soon = loop.add_reader, loop.remove_reader, loop.call_soon

    def counted_add_reader(*args: Any) -> None:
        nonlocal adds
        adds += 1
        add_reader(*args)

    def counted_remove_reader(fd: Any) -> bool:
        nonlocal removes
        removes += 1
        return remove_reader(fd)

    def counted_call_soon(callback: Any, *args: Any, **kwargs: Any) -> asyncio.Handle:
        nonlocal socket_callbacks
        if getattr(callback, "__self__", None) is pair.rx:
            socket_callbacks += 1
        return call_soon(callback, *args, **kwargs)

    loop.add_reader = counted_add_reader  # type: ignore[method-assign,assignment]
    loop.remove_reader = counted_remove_reader  # type: ignore[method-assign]
    loop.call_soon = counted_call_soon  # type: ignore[method-assign,assignment]
    taken: asyncio.Queue[int] = asyncio.Queue()

    async def receive_loop() -> None:
        for _ in range(6):
            taken.put_nowait(await pair.receive(timeout_s=30))

    try:
        receiving = asyncio.create_task(receive_loop())
        for n in range(5):
            await pair.waiting()
            pair.send(n)
            assert await asyncio.wait_for(taken.get(), 30) == n
        await pair.waiting()  # the sixth receive waits, on the same reader
        assert (adds, removes, socket_callbacks) == (1, 0, 0)
        pair.send(5)
        await asyncio.wait_for(receiving, 30)
        assert pair.reader_on() or removes == 1  # off already if news came meanwhile
        pair.send(6)  # nobody waits: the reader comes off at this news
        for _ in range(10_000):
            if not pair.reader_on():
                break
            await asyncio.sleep(0)
        assert (adds, removes) == (1, 1)
    finally:
        del loop.add_reader, loop.remove_reader, loop.call_soon
    assert await pair.receive() == 6  # queued meanwhile: taken without a wait


async def test_a_receive_never_looks_up_a_socket_option_by_attribute_name(
    context: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An attribute a pyzmq socket lacks falls through to pyzmq's __getattr__, which
    # looks for a socket option of that name and raises AttributeError: about 3 us
    # of CPU. The look for the connection guard did that for every message received
    # on a socket without a guard (all but the listeners'); the socket's descriptor
    # (``sock.FD``, an option too) was read each time the reader came on or off.
    pair = Pair(context, (zmq.PUSH, zmq.PULL))
    pair.send(0)
    assert await pair.receive() == 0  # the socket's first receive may read FD once
    missed: list[str] = []
    option_lookup = AttributeSetter.__getattr__

    def counted(sock: Any, name: str) -> Any:
        missed.append(name)
        return option_lookup(sock, name)

    monkeypatch.setattr(AttributeSetter, "__getattr__", counted)
    pair.send(1)  # queued before the receive: taken at once
    assert await pair.receive() == 1
    receiving = asyncio.create_task(pair.receive())
    await pair.waiting()
    pair.send(2)  # sent while the receive waits on the descriptor
    assert await asyncio.wait_for(receiving, 30) == 2
    assert missed == []
