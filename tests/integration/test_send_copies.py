"""How tensors leave a process: untracked sends copy buffers under COPY_BELOW_BYTES
(no wake-up of pyzmq's garbage-collector thread), a received tensor sent on
unchanged goes as the received zmq.Frame, tracked sends stay zero-copy with a
live tracker; the bytes that arrive are exact and every deadline still holds."""

from __future__ import annotations

import asyncio
import copy
import gc
import io
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio
from zmq.utils.garbage import gc as pyzmq_gc

from zpipe._errors import TransportTimeout
from zpipe.transport import codec, sockets
from zpipe.transport.codec import Message, decode, encode
from zpipe.transport.sockets import (
    COPY_BELOW_BYTES,
    decode_frames,
    new_context,
    open_socket,
    recv_frames,
    send,
    send_nowait,
)

MAX = 1 << 31


class Link:
    """A PUSH -> PULL pair on loopback TCP, as two stages' data sockets."""

    def __init__(self, context: zmq.asyncio.Context) -> None:
        self.pull = open_socket(context, zmq.PULL)
        port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.push = open_socket(context, zmq.PUSH)
        self.push.connect(f"tcp://127.0.0.1:{port}")

    async def receive(self) -> list[zmq.Frame]:
        return await recv_frames(self.pull, timeout_s=30, peer="peer", awaited="data")

    def close(self) -> None:
        self.push.close(linger=0)
        self.pull.close(linger=0)


@pytest.fixture
async def links() -> AsyncIterator[tuple[Link, Link]]:
    context = new_context()
    first, second = Link(context), Link(context)
    try:
        yield first, second
    finally:
        first.close()
        second.close()
        context.term()


@pytest.fixture
def shared_buffers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Sizes of the buffers pyzmq shares with libzmq (each one later wakes its gc thread)."""
    stored: list[int] = []
    original = pyzmq_gc.store

    def store(obj: Any, event: Any = None) -> int:
        stored.append(memoryview(obj).nbytes)
        return original(obj, event)

    monkeypatch.setattr(pyzmq_gc, "store", store)
    yield stored


def data(mb: int, tensor: torch.Tensor) -> Message:
    return Message("data", {"run": 1, "mb": mb, "src": "a"}, epoch=2, tensors=(tensor,))


def values(nbytes: int) -> torch.Tensor:
    return torch.arange(nbytes // 4, dtype=torch.float32).reshape(-1, 256)


@pytest.mark.parametrize("nbytes", [64 << 10, 1 << 20, COPY_BELOW_BYTES, 4 << 20])
async def test_an_untracked_send_copies_under_the_threshold_and_shares_above(
    links: tuple[Link, Link], shared_buffers: list[int], nbytes: int
) -> None:
    link, _ = links
    tensor = values(nbytes)
    expected = tensor.clone()
    sent = await send(link.push, data(7, tensor), timeout_s=30, peer="b")
    copied = nbytes < COPY_BELOW_BYTES
    if copied:
        tensor.fill_(-1.0)  # a copied send owes nothing to the tensor once it returns
    got = decode_frames(await link.receive(), MAX)
    assert sent == sum(len(f) for f in encode(data(7, expected)))
    assert got.body["mb"] == 7 and got.epoch == 2
    assert torch.equal(got.tensors[0], expected)
    assert shared_buffers == ([] if copied else [nbytes])


async def test_copy_below_zero_shares_every_buffer_from_64_kib_as_before(
    links: tuple[Link, Link], shared_buffers: list[int]
) -> None:
    link, _ = links
    tensor = values(1 << 20)
    assert send_nowait(link.push, data(1, tensor), copy_below=0) is not None
    got = decode_frames(await link.receive(), MAX)
    assert torch.equal(got.tensors[0], tensor)
    assert shared_buffers == [1 << 20]


async def test_a_received_tensor_sent_on_unchanged_is_the_received_frame(
    links: tuple[Link, Link], shared_buffers: list[int]
) -> None:
    first, second = links
    tensor = values(4 << 20)  # above the threshold: shared by the first sender only
    await send(first.push, data(3, tensor), timeout_s=30, peer="relay")
    frames = await first.receive()
    relayed = decode_frames(frames, MAX)
    out = encode(data(3, relayed.tensors[0]))
    assert out[1] is frames[1]  # the frame itself: libzmq counts a reference
    await send(second.push, data(3, relayed.tensors[0]), timeout_s=30, peer="sink")
    got = decode_frames(await second.receive(), MAX)
    assert torch.equal(got.tensors[0], tensor)
    assert shared_buffers == [4 << 20]  # the relay shared nothing with pyzmq's gc


async def test_a_forwarded_tensor_changed_in_place_sends_what_it_holds_now(
    links: tuple[Link, Link],
) -> None:
    first, second = links
    await send(first.push, data(1, values(256 << 10)), timeout_s=30, peer="relay")
    frames = await first.receive()
    tensor = decode_frames(frames, MAX).tensors[0]
    tensor.add_(1.0)  # same storage: the frame holds the new values
    assert encode(data(1, tensor))[1] is frames[1]
    await send(second.push, data(1, tensor), timeout_s=30, peer="sink")
    assert torch.equal(decode_frames(await second.receive(), MAX).tensors[0], values(256 << 10) + 1)
    tensor.t_()  # re-strided in place: the frame's bytes are no longer in its order
    assert not isinstance(encode(data(1, tensor))[1], zmq.Frame)
    await send(second.push, data(2, tensor), timeout_s=30, peer="sink")
    got = decode_frames(await second.receive(), MAX).tensors[0]
    assert torch.equal(got, (values(256 << 10) + 1).t())


def test_only_a_tensor_that_shares_a_received_frame_remembers_it() -> None:
    tensor = values(64 << 10)
    frames = encode(data(1, tensor))
    as_bytes = decode([bytes(frames[0]), bytes(frames[1])], max_message_bytes=MAX)
    assert not isinstance(encode(data(1, as_bytes.tensors[0]))[1], zmq.Frame)
    received = [zmq.Frame(bytes(frames[0])), zmq.Frame(bytes(frames[1]))]
    decoded = decode(received, max_message_bytes=MAX).tensors[0]
    assert encode(data(1, decoded))[1] is received[1]
    assert not isinstance(encode(data(1, decoded.reshape(-1)))[1], zmq.Frame)  # a new view
    decoded.resize_(4)  # shrunk in place: the frame holds more than the tensor
    assert not isinstance(encode(data(1, decoded))[1], zmq.Frame)


def test_a_decoded_tensor_saves_copies_and_forgets_its_frame_when_it_dies() -> None:
    # what remembers the frame must not ride along with the tensor: torch.save and
    # deepcopy carry a tensor's attributes, and a zmq.Frame cannot be pickled
    frames = encode(data(1, values(64 << 10)))
    received = [zmq.Frame(bytes(frames[0])), zmq.Frame(bytes(frames[1]))]
    decoded = decode(received, max_message_bytes=MAX).tensors[0]
    buffer = io.BytesIO()
    torch.save({"w": decoded}, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=True)["w"], values(64 << 10))
    assert torch.equal(copy.deepcopy(decoded), values(64 << 10))
    assert encode(data(1, decoded))[1] is received[1]
    key = id(decoded)
    assert key in codec._SOURCE_FRAMES
    del decoded
    gc.collect()
    assert key not in codec._SOURCE_FRAMES


async def test_a_tracked_send_of_a_received_tensor_keeps_a_live_tracker(
    links: tuple[Link, Link],
) -> None:
    first, second = links
    await send(first.push, data(5, values(1 << 20)), timeout_s=30, peer="relay")
    relayed = decode_frames(await first.receive(), MAX)
    trackers: list[tuple[zmq.MessageTracker, int]] = []
    await send(
        second.push,
        data(5, relayed.tensors[0]),
        timeout_s=30,
        peer="sink",
        on_queued=lambda tracker, nbytes: trackers.append((tracker, nbytes)),
    )
    got = decode_frames(await second.receive(), MAX)
    assert torch.equal(got.tensors[0], values(1 << 20))
    [(tracker, nbytes)] = trackers
    await asyncio.to_thread(tracker.wait, 30)  # libzmq released it: written out
    assert tracker.done and nbytes > 1 << 20


async def test_a_copied_send_to_a_peer_that_never_connects_times_out_by_its_deadline() -> None:
    context = new_context()
    push = open_socket(context, zmq.PUSH)
    push.connect("tcp://127.0.0.1:9")  # nobody there: the queue fills at its high-water mark
    message = data(1, values(256 << 10))
    try:
        assert sockets._outgoing(encode(message), track=False, copy_below=COPY_BELOW_BYTES)[1]
        with pytest.raises(TransportTimeout, match="room to send data"):
            for _ in range(100):
                await send(push, message, timeout_s=0.3, peer="nobody")
        assert send_nowait(push, message) is None
    finally:
        push.close(linger=0)
        context.term()
