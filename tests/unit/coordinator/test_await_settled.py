"""The shell's wait for suspect stages to settle before a resume plans its survivors
(zpipe.coordinator.jobs, AwaitSettled): a suspect that answers its probe ends the wait
as alive, one that never answers ends it by its deadline, and the others are not
waited for."""

from __future__ import annotations

import asyncio
import time

from zpipe.config import Timeouts
from zpipe.coordinator.commands import AwaitSettled
from zpipe.coordinator.jobs import JobRunner
from zpipe.coordinator.membership import Membership, MemberState
from zpipe.coordinator.state import ControlState

INTERVAL = 0.1  # s: the deadlines scale with it (3 intervals to suspect, 2 to answer)


def _runner(names: tuple[str, ...]) -> tuple[ControlState, JobRunner]:
    timeouts = Timeouts(heartbeat_interval_s=INTERVAL)
    membership = Membership(
        heartbeat_interval_s=INTERVAL, suspect_after_intervals=3, probe_intervals=2
    )
    state = ControlState(timeouts=timeouts, membership=membership)
    for name in names:
        membership.register(
            name=name, routing_id=name.encode(), data_endpoint=f"tcp://{name}:1", info={},
            public_key=None, now=time.monotonic(),
        )  # fmt: skip
    return state, JobRunner(state, None, None, measure_links=False, store=None)  # type: ignore[arg-type]


async def test_the_wait_ends_when_the_suspect_answers_its_probe() -> None:
    state, runner = _runner(("a", "b"))
    membership = state.membership
    assert membership.suspect("a", time.monotonic()) is not None
    waiting = asyncio.create_task(runner.run(AwaitSettled(("a", "b"))))
    await asyncio.sleep(3 * INTERVAL)
    assert not waiting.done()  # a is still suspect
    member = membership.get("a")
    assert member is not None
    membership.heard_from("a", time.monotonic())  # its probe answered
    await asyncio.wait_for(waiting, 10)
    assert member.state is MemberState.ALIVE


async def test_a_suspect_that_never_answers_ends_the_wait_by_its_deadlines() -> None:
    state, runner = _runner(("a", "b"))
    state.membership.suspect("a", time.monotonic())
    began = time.monotonic()
    await asyncio.wait_for(runner.run(AwaitSettled(("a", "b"))), 30)
    # its suspect and probe deadlines (5 intervals) and two ticks to be judged
    assert time.monotonic() - began >= 5 * INTERVAL


async def test_nothing_is_waited_for_when_none_of_them_is_suspect() -> None:
    state, runner = _runner(("a", "b"))
    state.membership.suspect("b", time.monotonic())  # suspect, but not one of the run's
    began = time.monotonic()
    await asyncio.wait_for(runner.run(AwaitSettled(("a", "gone"))), 30)
    assert time.monotonic() - began < 5 * INTERVAL
