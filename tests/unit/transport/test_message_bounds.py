"""Taking a multipart message frame by frame within its socket's bounds (issue 33,
finding 1): frames past the bound are never kept, the rest of the message is read
and dropped in turns of the event loop, and the refusal says why. A fake socket
stands for libzmq's queue: pure, no sockets."""

from __future__ import annotations

import asyncio
from collections import deque

import pytest
import zmq

from zpipe._errors import MessageLimitError, ProtocolError
from zpipe.transport import message_bounds
from zpipe.transport.codec import MAX_TENSORS
from zpipe.transport.message_bounds import (
    CODEC_FRAMES,
    DRAIN_TURN_FRAMES,
    TRIM_AFTER_BYTES,
    TRIM_AFTER_FRAMES,
    MessageBounds,
    OverBounds,
    discard_rest,
    discard_some,
    give_back_freed_memory,
    take_rest,
)
from zpipe.transport.sockets import ReceiveLimits


class FakeFrame:
    def __init__(self, nbytes: int, more: bool) -> None:
        self.nbytes = nbytes
        self.more = more

    def __len__(self) -> int:
        return self.nbytes


class FakeQueue:
    """Queued frames of whole messages, as libzmq delivers them; counts reads."""

    def __init__(self) -> None:
        self.frames: deque[FakeFrame] = deque()
        self.reads = 0

    def put(self, sizes: list[int]) -> None:
        for i, size in enumerate(sizes):
            self.frames.append(FakeFrame(size, more=i < len(sizes) - 1))

    def recv(self, flags: int = 0, copy: bool = True, track: bool = False) -> FakeFrame:
        assert flags & zmq.NOBLOCK, "a queued frame is taken without waiting"
        assert not copy
        if not self.frames:
            raise zmq.Again()
        self.reads += 1
        return self.frames.popleft()


def first_of(queue: FakeQueue) -> FakeFrame:
    return queue.recv(zmq.NOBLOCK, copy=False)


def test_a_message_within_bounds_is_taken_whole_and_the_next_is_left_queued() -> None:
    queue = FakeQueue()
    queue.put([100, 4, 4])
    queue.put([7])
    got = take_rest(queue, first_of(queue), MessageBounds(3, 1000))
    assert isinstance(got, list) and [len(f) for f in got] == [100, 4, 4]
    assert [len(f) for f in queue.frames] == [7]


def test_frames_past_the_bound_are_not_kept_and_the_rest_is_discarded() -> None:
    queue = FakeQueue()
    queue.put([1] * 10_000)
    queue.put([5, 6])
    got = take_rest(queue, first_of(queue), MessageBounds(8, 1 << 20))
    assert isinstance(got, OverBounds)
    # it stopped at the first frame past the bound: one more than the bound read
    assert (got.frames, got.more, queue.reads) == (9, True, 9)
    discard_some(queue, got, limit=100)
    assert (got.frames, got.more) == (109, True)  # at most the limit per call
    asyncio.run(discard_rest(queue, got))
    assert (got.frames, got.nbytes, got.more) == (10_000, 10_000, False)
    # the next message is intact
    again = take_rest(queue, first_of(queue), MessageBounds(8, 1 << 20))
    assert isinstance(again, list) and [len(f) for f in again] == [5, 6]


def test_a_message_past_the_byte_bound_is_refused_even_in_few_frames() -> None:
    queue = FakeQueue()
    queue.put([10, 600, 600, 600])
    got = take_rest(queue, first_of(queue), MessageBounds(100, 1000))
    assert isinstance(got, OverBounds) and (got.frames, got.nbytes, got.more) == (3, 1210, True)
    error = got.error()
    assert isinstance(error, MessageLimitError) and isinstance(error, ProtocolError)
    assert "more than 1000 bytes" in str(error)
    single = FakeQueue()
    single.put([2000])
    assert isinstance(take_rest(single, first_of(single), MessageBounds(100, 1000)), OverBounds)


def test_the_refusal_names_the_frame_bound() -> None:
    queue = FakeQueue()
    queue.put([1] * 50)
    got = take_rest(queue, first_of(queue), MessageBounds(4, 1 << 20))
    assert isinstance(got, OverBounds)
    asyncio.run(discard_rest(queue, got))
    error = got.error()
    assert "more than 4 frames" in str(error) and "50 frames" in str(error)
    assert (error.frames, error.nbytes) == (50, 50)


def test_discarding_gives_the_loop_a_turn_every_few_thousand_frames() -> None:
    """A heartbeat task runs while a huge message is discarded, not only after it."""
    total = 10 * DRAIN_TURN_FRAMES + 5
    queue = FakeQueue()
    queue.put([1] * total)
    looks: list[int] = []
    turns: list[int] = []

    async def main() -> None:
        got = take_rest(queue, first_of(queue), MessageBounds(2, 1 << 20))
        assert isinstance(got, OverBounds)

        async def heartbeat() -> None:
            while True:
                turns.append(got.frames)
                await asyncio.sleep(0)

        beat = asyncio.create_task(heartbeat())
        await discard_rest(queue, got, between_turns=lambda: looks.append(got.frames))
        beat.cancel()
        assert got.frames == total and not got.more

    asyncio.run(main())
    assert len(looks) >= 10  # the socket's events looked at before every turn
    # the heartbeat ran in the middle of the message, between chunks of discarding
    assert len([t for t in turns if t < total]) >= 9


def test_bounds_by_socket_kind_follow_the_codec() -> None:
    assert CODEC_FRAMES == MAX_TENSORS + 1
    assert MessageBounds.for_socket(zmq.PULL).max_frames == MAX_TENSORS + 1
    # a ROUTER puts the sender's routing id in front of the codec's frames
    assert MessageBounds.for_socket(zmq.ROUTER).max_frames == MAX_TENSORS + 2
    with pytest.raises(ValueError):
        MessageBounds(0, 10)


def test_a_message_may_hold_what_one_connection_may_queue() -> None:
    before = ReceiveLimits.before_plan()
    bounds = before.message_bounds(zmq.PULL)
    assert bounds.max_bytes == before.queued_bytes_per_peer == 256 << 10
    planned = ReceiveLimits.for_largest_message(100 << 20)
    assert planned.message_bounds(zmq.PULL).max_bytes == planned.queued_bytes_per_peer
    # never more than the codec takes in one message, never less than one frame
    huge = ReceiveLimits(1 << 31, 16)
    assert huge.message_bounds(zmq.PULL).max_bytes == 1 << 31
    assert ReceiveLimits(1000, 1).message_bounds(zmq.PULL).max_bytes == 1000


def test_only_a_refused_message_of_many_frames_or_bytes_gives_freed_memory_back() -> None:
    assert not give_back_freed_memory(TRIM_AFTER_FRAMES - 1, TRIM_AFTER_BYTES - 1)
    trims = message_bounds._malloc_trim() is not None  # glibc's, where there is one
    assert give_back_freed_memory(TRIM_AFTER_FRAMES) == trims
    assert give_back_freed_memory(8000, TRIM_AFTER_BYTES) == trims
