"""The feed waits for room in its window before it decides what comes next, and a
stage's speed verdict ends that wait at once (``room_or_verdict``).

Without it the feed decided (look, replica or send) before it waited for room: a
verdict, or the loss that shows a device slowing, that came during the wait let one
more mini-batch into the pipeline before the look, and a move drains it through the
slow device. The shell's wait is fed a fake run: a window and the control's queue.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from zpipe.client.runs.async_repartition import room_or_verdict
from zpipe.client.runs.training_events import SpeedNoticed
from zpipe.protocol.repartition import SpeedChanged


def _run(window: int) -> Any:
    control = SimpleNamespace(speed_changes=asyncio.Queue())
    return SimpleNamespace(
        run=1, window=asyncio.Semaphore(window), session=SimpleNamespace(control=control)
    )


def _verdict(run: int = 1) -> SpeedChanged:
    return SpeedChanged(run=run, name="d1", step=16, plan_epoch=1, ratio=8.2,
                        baseline_s=0.03, now_s=0.24, epoch=1)  # fmt: skip


def test_a_verdict_during_the_wait_for_room_is_noticed_at_once() -> None:
    async def scenario() -> None:
        run = _run(1)
        await run.window.acquire()  # the window is full: one mini-batch in flight
        waiting = asyncio.ensure_future(room_or_verdict(run))
        await asyncio.sleep(0)
        assert not waiting.done()
        run.session.control.speed_changes.put_nowait(_verdict())
        notices = await asyncio.wait_for(waiting, 30.0)
        assert notices == [SpeedNoticed("d1", 1, 8.2)]
        assert run.window.locked()  # no room was taken: the loss has not come
        assert run.session.control.speed_changes.empty()
        # the cancelled wait for room holds none: the loss's room is the send's
        run.window.release()
        await asyncio.sleep(0)
        await asyncio.wait_for(run.window.acquire(), 1.0)
        assert run.window.locked()

    asyncio.run(scenario())


def test_room_ends_the_wait_and_is_given_back_for_the_send() -> None:
    async def scenario() -> None:
        run = _run(1)
        await run.window.acquire()
        waiting = asyncio.ensure_future(room_or_verdict(run))
        await asyncio.sleep(0)
        assert not waiting.done()
        run.window.release()  # a loss came back
        assert await asyncio.wait_for(waiting, 30.0) == []
        # the send's own take returns at once: the room is still there
        await asyncio.wait_for(run.window.acquire(), 1.0)
        # and the queue's waiter was cancelled: a later verdict stays for the next call
        run.session.control.speed_changes.put_nowait(_verdict())
        await asyncio.sleep(0)
        assert run.session.control.speed_changes.qsize() == 1

    asyncio.run(scenario())


def test_with_room_the_verdicts_so_far_come_back_without_waiting() -> None:
    async def scenario() -> None:
        run = _run(2)
        run.session.control.speed_changes.put_nowait(_verdict())
        run.session.control.speed_changes.put_nowait(_verdict(run=7))  # another run's
        notices = await asyncio.wait_for(room_or_verdict(run), 1.0)
        assert notices == [SpeedNoticed("d1", 1, 8.2)]
        assert not run.window.locked()

    asyncio.run(scenario())
