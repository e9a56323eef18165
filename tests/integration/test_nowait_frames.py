"""The non-blocking halves of zpipe's one-way fast paths (zpipe.transport.fd_wait):
``send_whole_nowait`` queues a multipart message whole or not at all, as pyzmq's
``send_multipart`` does, with the same trackers; ``take_queued`` takes a waiting
message within the socket's bounds and says None when there is none."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from zpipe.transport.fd_wait import send_whole_nowait, take_queued
from zpipe.transport.message_bounds import MessageBounds, OverBounds

WIDE = MessageBounds(max_frames=8, max_bytes=1 << 20)


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    context = zmq.Context()
    tx = context.socket(zmq.PUSH)
    rx = context.socket(zmq.PULL)
    for sock in (tx, rx):
        sock.setsockopt(zmq.LINGER, 0)
    tx.setsockopt(zmq.SNDHWM, 1)
    rx.setsockopt(zmq.RCVHWM, 1)
    rx.bind("inproc://nowait")
    tx.connect("inproc://nowait")
    yield tx, rx
    context.destroy(linger=0)


def take(rx: zmq.Socket[Any], bounds: MessageBounds = WIDE) -> Any:
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        got = take_queued(rx, bounds)
        if got is not None:
            return got
        time.sleep(0.001)
    raise AssertionError("no message within 10 s")


def test_a_message_goes_whole_and_the_next_finds_no_room_and_queues_nothing(
    pair: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    tx, rx = pair
    shared = memoryview(bytes(range(256)) * 512)  # 128 KiB: sent zero-copy
    sent = 0
    # fill both queues (a PUSH's and a PULL's high-water mark of one, inproc)
    while True:
        try:
            send_whole_nowait(tx, [b"head", b"x" * sent, shared], copy=True, track=False)
        except zmq.Again:
            break
        sent += 1
        assert sent < 100, "the queues never filled"
    for n in range(sent):
        frames = take(rx)
        assert isinstance(frames, list)
        assert [bytes(f.buffer) for f in frames] == [b"head", b"x" * n, bytes(shared)]
    # the refused message left no frame behind: the queue is empty
    assert take_queued(rx, WIDE) is None


def test_a_tracked_send_hands_back_the_last_frame_s_tracker(
    pair: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    tx, rx = pair
    payload = bytearray(b"p" * (128 << 10))
    tracker = send_whole_nowait(tx, [b"head", memoryview(payload)], copy=False, track=True)
    assert isinstance(tracker, zmq.MessageTracker)
    frames = take(rx)
    assert isinstance(frames, list) and bytes(frames[1].buffer) == bytes(payload)
    del frames
    tracker.wait(10.0)  # libzmq let go of the shared buffer
    assert tracker.done


def test_a_queued_message_past_its_bounds_is_reported_not_returned(
    pair: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    tx, rx = pair
    send_whole_nowait(tx, [b"a", b"b", b"c"], copy=True, track=False)
    got = take(rx, MessageBounds(max_frames=2, max_bytes=1 << 20))
    assert isinstance(got, OverBounds)
    assert got.frames == 3 and not got.more
