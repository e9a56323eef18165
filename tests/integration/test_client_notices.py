"""Notices a client missed arrive when the coordinator sends them again: each acts once.

The client's control channel against an in-process ROUTER standing in for the
coordinator (no processes); the session's handling of a stale re-plan.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq
import zmq.asyncio

from tests._support.client_session import EPOCH, RUN, _check, _connection, _never_called, _session
from zpipe.client.control import ControlChannel
from zpipe.client.failures import NoticeFilter
from zpipe.config import Timeouts
from zpipe.protocol.client_control import Checkpoint, RunReplanned, StageFailed
from zpipe.protocol.stage_control import WeightsRequest
from zpipe.transport.codec import Message, encode
from zpipe.transport.sockets import SocketOptions, decode_frames

_endpoints = itertools.count()


@pytest.fixture
async def pair() -> AsyncIterator[tuple[zmq.asyncio.Socket, ControlChannel]]:
    context = zmq.asyncio.Context()
    endpoint = f"inproc://coordinator-{next(_endpoints)}"
    router = context.socket(zmq.ROUTER)
    router.bind(endpoint)
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.ROUTING_ID, b"client-1")
    dealer.connect(endpoint)
    channel = ControlChannel(dealer, SocketOptions(), Timeouts())
    try:
        yield router, channel
    finally:
        await channel.close()
        router.close(linger=0)
        context.term()


async def _send(router: zmq.asyncio.Socket, message: Message) -> None:
    await router.send_multipart([b"client-1", *encode(message)])


async def _receive(router: zmq.asyncio.Socket) -> Message:
    frames = await asyncio.wait_for(router.recv_multipart(copy=False), 10)
    return decode_frames(frames[1:], SocketOptions().max_message_bytes)


def _failed(seq: int | None, stage: str = "b") -> Message:
    body: dict[str, Any] = {"run": 3, "stage": stage, "reason": "no heartbeat"}
    if seq is not None:
        body["seq"] = seq
    return Message("stage_failed", body)


async def test_every_copy_of_a_notice_is_acknowledged_and_the_run_sees_it_once(
    pair: tuple[zmq.asyncio.Socket, ControlChannel],
) -> None:
    router, channel = pair
    await _send(router, _failed(1))
    await _send(router, _failed(1))  # sent again: the first ack was late, or lost
    await _send(router, _failed(2, stage="d"))
    acks = [await _receive(router) for _ in range(3)]
    assert [(a.kind, a.body["run"], a.body["seq"]) for a in acks] == [
        ("notice_ack", 3, 1),
        ("notice_ack", 3, 1),
        ("notice_ack", 3, 2),
    ]
    first = await asyncio.wait_for(channel.failures.get(), 10)
    second = await asyncio.wait_for(channel.failures.get(), 10)
    assert (first.stage, second.stage) == ("b", "d")
    assert channel.failures.empty()


async def test_a_notice_without_a_number_is_passed_on_and_not_acknowledged(
    pair: tuple[zmq.asyncio.Socket, ControlChannel],
) -> None:
    router, channel = pair
    await _send(router, _failed(None))
    notice = await asyncio.wait_for(channel.failures.get(), 10)
    assert notice.stage == "b"
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(router.recv_multipart(), 0.3)


def test_the_filter_lets_each_run_and_number_through_once() -> None:
    notices = NoticeFilter()

    def typed(message: Message) -> StageFailed:
        return StageFailed.from_message(message)

    assert notices.first_time(typed(_failed(1)))
    assert not notices.first_time(typed(_failed(1)))
    assert notices.first_time(StageFailed(run=4, stage="b", reason="x", seq=1))
    assert notices.first_time(typed(_failed(None))) and notices.first_time(typed(_failed(None)))


async def test_a_replan_older_than_the_one_followed_is_ignored() -> None:
    context = zmq.asyncio.Context()
    sink = context.socket(zmq.PULL)
    sink.bind(f"inproc://sink-notices-{next(_endpoints)}")
    session = _session(_connection(context, sink))
    followed: list[int] = []
    two = asyncio.Event()

    async def replanned(notice: RunReplanned) -> None:
        followed.append(notice.epoch)
        session.epoch = notice.epoch  # as the stream's replay does (session.follow)
        if len(followed) == 2:
            two.set()

    def replan(epoch: int) -> RunReplanned:
        return RunReplanned(
            run=RUN,
            plan={},
            dead="b",
            recovered_s=0.0,
            first_endpoint="",
            first_stage="",
            first_key=None,
            last_stage="",
            last_key=None,
            last_endpoint="",
            epoch=epoch,
        )

    try:
        session.watch(_check, _never_called, awaited="results", on_replanned=replanned)
        for epoch in (EPOCH + 2, EPOCH + 1, EPOCH + 3):  # the middle one was sent again late
            await session.control.failures.put(replan(epoch))
        await asyncio.wait_for(two.wait(), 10)
    finally:
        await session.close()
        sink.close(linger=0)
        context.term()
    assert followed == [EPOCH + 2, EPOCH + 3]


async def _answer_late_with_progress(
    router: zmq.asyncio.Socket, *, run: int, notices: int, gap_s: float
) -> None:
    """The coordinator's side of a slow gather: progress every ``gap_s``, then the
    checkpoint."""
    await _receive(router)  # the request
    for _ in range(notices):
        await asyncio.sleep(gap_s)
        await _send(router, Message("progress", {"run": run, "awaited": "weights"}))
    await _send(router, Message("checkpoint", {"run": run, "step": 4, "keys": []}))


async def test_progress_notices_of_the_run_keep_a_request_waiting_past_its_deadline(
    pair: tuple[zmq.asyncio.Socket, ControlChannel],
) -> None:
    """Issue 17: final weights that take longer than the client's deadline to gather
    (a slow link) are not given up on while the coordinator says they are moving."""
    router, channel = pair
    coordinator = asyncio.ensure_future(
        _answer_late_with_progress(router, run=3, notices=8, gap_s=0.25)
    )
    reply = await channel.ask(
        WeightsRequest(run=3, step=4),
        expect=(Checkpoint,),
        timeout_s=1.0,  # the whole answer takes 2 s: only the notices keep it alive
        awaited="the trained weights",
        progress_run=3,
    )
    await coordinator
    assert reply.KIND == "checkpoint" and reply.step == 4


async def test_without_progress_or_with_another_runs_the_deadline_holds(
    pair: tuple[zmq.asyncio.Socket, ControlChannel],
) -> None:
    from zpipe._errors import TransportTimeout

    router, channel = pair
    for progress_run in (None, 99):  # not asked for; notices of another run
        coordinator = asyncio.ensure_future(
            _answer_late_with_progress(router, run=3, notices=8, gap_s=0.25)
        )
        with pytest.raises(TransportTimeout, match="the trained weights"):
            await channel.ask(
                WeightsRequest(run=3, step=4),
                expect=(Checkpoint,),
                timeout_s=1.0,
                awaited="the trained weights",
                progress_run=progress_run,
            )
        await coordinator
        # what came after the deadline, up to the checkpoint: the next round starts clean
        while (await asyncio.wait_for(channel._replies.get(), 10)).KIND != "checkpoint":
            pass
