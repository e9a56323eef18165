"""The link meter: the time bytes take to leave for a peer, and a bounded window of them.

Real sockets on loopback, one process: a receiver that reads nothing stops the
link, so the window fills and a send waits (then times out, naming the peer);
once it reads, every message completes and its bytes are counted.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
import zmq

from zpipe._errors import TransportTimeout
from zpipe.stage.metrics import LinkMeter, StageCounters
from zpipe.transport.codec import Message
from zpipe.transport.sockets import (
    SocketOptions,
    bind_endpoint,
    new_context,
    open_socket,
    recv_frames,
    send,
)

MESSAGE_BYTES = 16 * 2**20  # far more than the kernel's socket buffers hold


async def _stalled_then_drained(window: int, messages: int) -> tuple[StageCounters, int, int]:
    context = new_context()
    options = SocketOptions(send_hwm=1, recv_hwm=1)
    receiver = open_socket(context, zmq.PULL, options)
    sender = open_socket(context, zmq.PUSH, options)
    try:
        endpoint = bind_endpoint(receiver, "tcp://127.0.0.1:0")
        sender.connect(endpoint)
        counters = StageCounters()
        meter = LinkMeter(counters, window=window)
        message = Message(
            "data", {"run": 1, "mb": 0, "src": "s0"}, tensors=(torch.zeros(MESSAGE_BYTES // 4),)
        )
        sent = 0
        # the window holds the sender up to its deadline; then the message goes to zmq's
        # own queue (one message here), whose send deadline stops the sender
        with pytest.raises(TransportTimeout, match="downstream"):
            for _ in range(messages):
                await meter.room(timeout_s=1.0)
                try:
                    await send(
                        sender, message, timeout_s=1.0, peer="downstream", on_queued=meter.track
                    )
                except TransportTimeout:
                    meter.release()
                    raise
                sent += 1
        stuck = meter.in_flight
        for _ in range(sent):  # the receiver reads: the link moves again
            await recv_frames(receiver, timeout_s=60.0, peer="upstream", awaited="data")
        await meter.drained(timeout_s=60.0, peer="downstream")
        meter.close()
        return counters, sent, stuck
    finally:
        sender.close(linger=0)
        receiver.close(linger=0)
        context.term()


def test_a_stalled_link_fills_the_window_and_a_drained_one_counts_every_byte() -> None:
    counters, sent, stuck = asyncio.run(_stalled_then_drained(window=2, messages=8))
    assert 2 <= sent < 8  # the window let some through, then the link stopped them
    assert stuck >= 2  # the window was full when the send gave up
    assert counters.link_peak_in_flight == stuck
    assert counters.link_delivered_bytes >= sent * MESSAGE_BYTES
    assert counters.link_s > 0
    assert counters.to_dict()["link_mbps"] > 0


class _HeldTracker:
    """A tracker that completes when the test says so (libzmq wrote the message out)."""

    def __init__(self) -> None:
        import threading

        self.written = threading.Event()

    def wait(self, timeout: float | None = None) -> None:
        if not self.written.wait(timeout):
            raise zmq.NotDone

    @property
    def done(self) -> bool:
        return self.written.is_set()


async def _window_of_one() -> tuple[bool, bool, StageCounters]:
    counters = StageCounters()
    meter = LinkMeter(counters, window=1)
    await meter.room(timeout_s=60.0)
    first = _HeldTracker()
    meter.track(first, 1000)  # type: ignore[arg-type]
    waiting = asyncio.create_task(meter.room(timeout_s=60.0))
    for _ in range(20):  # the event loop runs; the window stays full
        await asyncio.sleep(0)
    held = not waiting.done()
    first.written.set()
    await asyncio.wait_for(waiting, 60.0)
    await meter.drained(timeout_s=60.0, peer="downstream")
    meter.close()
    return held, waiting.done(), counters


def test_a_full_window_holds_the_next_send_until_a_message_is_written_out() -> None:
    held, released, counters = asyncio.run(_window_of_one())
    assert held and released
    assert counters.link_delivered_bytes == 1000
    assert counters.link_peak_in_flight == 1


async def _written_together(count: int) -> tuple[StageCounters, int, list[int]]:
    counters = StageCounters()
    meter = LinkMeter(counters, window=count)
    trackers = [_HeldTracker() for _ in range(count)]
    wakeups: list[int] = []
    done_all = meter._done_all

    def counting(completed: list[tuple[int, float]]) -> None:
        wakeups.append(len(completed))
        done_all(completed)

    meter._done_all = counting  # type: ignore[method-assign]
    for i, tracker in enumerate(trackers):
        assert meter.has_room()
        await meter.room(timeout_s=60.0)
        meter.track(tracker, 100 * (i + 1))  # type: ignore[arg-type]
    assert not meter.has_room()  # the window is full
    # waiting for the drain hands every message to the waiter thread at once
    draining = asyncio.create_task(meter.drained(timeout_s=60.0, peer="downstream"))
    await asyncio.sleep(0)
    handed_off = meter._handed_off
    # every message is written out before the waiter thread looks at the second one
    for tracker in reversed(trackers):
        tracker.written.set()
    await asyncio.wait_for(draining, 60.0)
    assert handed_off == count
    in_flight = meter.in_flight
    meter.close()
    return counters, in_flight, wakeups


def test_messages_written_out_together_all_count_and_free_their_places() -> None:
    counters, in_flight, wakeups = asyncio.run(_written_together(4))
    assert in_flight == 0
    assert counters.link_delivered_bytes == 100 + 200 + 300 + 400
    # the waiter was held on the first: it found the other three written out behind
    # it and reported all four in one wake-up of the loop
    assert wakeups == [4]


async def _written_at_once() -> tuple[StageCounters, float, bool, int]:
    counters = StageCounters()
    meter = LinkMeter(counters, window=2)
    tracker = _HeldTracker()
    await meter.room(timeout_s=60.0)
    before = time.perf_counter()
    meter.track(tracker, 1000)  # type: ignore[arg-type]
    tracker.written.set()
    room = meter.has_room()  # the loop looks: the message is out
    elapsed = time.perf_counter() - before
    in_flight = meter.in_flight
    meter.close()
    return counters, elapsed, room and meter._waiter is None, in_flight


def test_a_message_written_out_at_once_is_counted_by_the_loop_without_a_thread() -> None:
    counters, elapsed, no_thread, in_flight = asyncio.run(_written_at_once())
    assert no_thread and in_flight == 0
    assert counters.link_delivered_bytes == 1000
    # stamped between the two looks: never more link time than actually passed
    assert 0 <= counters.link_s <= elapsed


async def _held_past_the_look() -> tuple[StageCounters, float, bool]:
    counters = StageCounters()
    meter = LinkMeter(counters, window=2)
    tracker = _HeldTracker()
    handing = asyncio.Event()
    to_waiter = meter._to_waiter

    def noting(tracker: zmq.MessageTracker, nbytes: int, messages: int = 1) -> None:
        to_waiter(tracker, nbytes, messages)
        handing.set()

    meter._to_waiter = noting  # type: ignore[method-assign]
    await meter.room(timeout_s=60.0)
    meter.track(tracker, 1000)  # type: ignore[arg-type]
    tracked_at = time.perf_counter()
    # nothing else happens: the loop's own look, LOOK_AGAIN_S on, hands it to the waiter
    await asyncio.wait_for(handing.wait(), 60.0)
    handed_off = meter._handed_off == 1 and meter._waiter is not None
    tracker.written.set()
    held_s = time.perf_counter() - tracked_at
    await meter.drained(timeout_s=60.0, peer="downstream")
    meter.close()
    return counters, held_s, handed_off


def test_a_message_still_on_its_way_is_timed_by_the_waiter_for_its_whole_time() -> None:
    counters, held_s, handed_off = asyncio.run(_held_past_the_look())
    assert handed_off
    assert counters.link_delivered_bytes == 1000
    assert counters.link_s >= held_s  # stamped when written out, not when looked at


async def _fast_stream(messages: int, nbytes: int) -> tuple[StageCounters, float]:
    context = new_context()
    receiver = open_socket(context, zmq.PULL, SocketOptions())
    sender = open_socket(context, zmq.PUSH, SocketOptions())
    try:
        sender.connect(bind_endpoint(receiver, "tcp://127.0.0.1:0"))
        counters = StageCounters()
        meter = LinkMeter(counters)
        message = Message(
            "data", {"run": 1, "mb": 0, "src": "s0"}, tensors=(torch.zeros(nbytes // 4),)
        )
        started = time.perf_counter()
        for _ in range(messages):
            await meter.room(timeout_s=60.0)
            await send(sender, message, timeout_s=60.0, peer="downstream", on_queued=meter.track)
            await recv_frames(receiver, timeout_s=60.0, peer="upstream", awaited="data")
        await meter.drained(timeout_s=60.0, peer="downstream")
        elapsed = time.perf_counter() - started
        meter.close()
        return counters, elapsed
    finally:
        sender.close(linger=0)
        receiver.close(linger=0)
        context.term()


def test_a_fast_link_counts_every_byte_and_no_more_time_than_passed() -> None:
    counters, elapsed = asyncio.run(_fast_stream(50, 64 * 1024))
    assert counters.link_delivered_bytes >= 50 * 64 * 1024
    assert 0 < counters.link_s <= elapsed


async def _copied_then_tracked() -> tuple[list[bool], StageCounters, int, int, bool]:
    counters = StageCounters()
    meter = LinkMeter(counters, window=4)
    allowed: list[bool] = []
    for nbytes in (100, 200, 300):
        allowed.append(meter.may_copy(nbytes, more_behind=True))
        await meter.room(timeout_s=60.0)
        meter.copied(nbytes)
    # three copied ones hold three places: the fourth takes the last and must be tracked
    allowed.append(meter.may_copy(400, more_behind=True))
    await meter.room(timeout_s=60.0)
    tracker = _HeldTracker()
    meter.track(tracker, 400)  # type: ignore[arg-type]
    in_flight_before = meter.in_flight
    delivered_before = counters.link_delivered_bytes
    tracker.written.set()
    room = meter.has_room()  # the loop looks: the tracked one is out, its riders too
    meter.close()
    return allowed, counters, in_flight_before, delivered_before, room and meter.in_flight == 0


def test_copied_messages_are_counted_written_with_the_tracked_one_behind_them() -> None:
    allowed, counters, in_flight_before, delivered_before, all_out = asyncio.run(
        _copied_then_tracked()
    )
    assert allowed == [True, True, True, False]
    assert in_flight_before == 4 and delivered_before == 0  # nothing known before it
    assert all_out  # every place free again
    assert counters.link_delivered_bytes == 100 + 200 + 300 + 400
    assert counters.link_peak_in_flight == 4


async def _copy_refused() -> dict[str, bool]:
    from zpipe.transport.sockets import COPY_BELOW_BYTES

    meter = LinkMeter(StageCounters(), window=4)
    got = {
        "nothing_behind": meter.may_copy(1000, more_behind=False),
        "large": meter.may_copy(COPY_BELOW_BYTES, more_behind=True),
        "idle": meter.may_copy(1000, more_behind=True),
    }
    await meter.room(timeout_s=60.0)
    tracker = _HeldTracker()
    meter.track(tracker, 1000)  # type: ignore[arg-type]
    meter.has_room()
    got["tracked_on_its_way"] = meter.may_copy(1000, more_behind=True)
    tracker.written.set()
    meter.has_room()
    got["tracked_written"] = meter.may_copy(1000, more_behind=True)
    meter.close()
    return got


def test_a_message_goes_copied_only_with_one_behind_it_while_the_link_keeps_up() -> None:
    got = asyncio.run(_copy_refused())
    assert got == {
        "nothing_behind": False,  # the last of a burst is tracked: nothing would count it
        "large": False,  # shared with libzmq anyway: tracked
        "idle": True,
        "tracked_on_its_way": False,  # a slow link is timed message by message
        "tracked_written": True,
    }


async def _copied_behind_a_handed_off_one() -> tuple[StageCounters, int]:
    counters = StageCounters()
    meter = LinkMeter(counters, window=4)
    await meter.room(timeout_s=60.0)
    meter.copied(100)
    await meter.room(timeout_s=60.0)
    first = _HeldTracker()
    meter.track(first, 200)  # type: ignore[arg-type]
    meter._hand_off()  # as when it stays on its way: the waiter thread owns it
    await meter.room(timeout_s=60.0)
    second = _HeldTracker()
    meter.track(second, 300)  # type: ignore[arg-type]
    first.written.set()
    second.written.set()
    await meter.drained(timeout_s=60.0, peer="downstream")
    meter.close()
    return counters, meter.in_flight


def test_a_copied_message_rides_on_a_tracked_one_the_waiter_thread_stamps() -> None:
    counters, in_flight = asyncio.run(_copied_behind_a_handed_off_one())
    assert in_flight == 0
    assert counters.link_delivered_bytes == 100 + 200 + 300
