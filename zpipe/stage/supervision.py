"""Receive loops that survive any one message, and tasks that never die silently.

A peer's message may make its handler raise anything (a decoder's
``TypeError`` on a poisoned shape, a ``KeyError`` on a missing field): the
loop logs it with the peer and goes on (:func:`serve_messages`). A task that
ends with an exception anyway (its socket broke) is reported by
:class:`TaskSupervisor` to whoever decides (the lifecycle controller restarts
it or fails the process); nothing ends unnoticed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from zpipe.log import get_logger

log = get_logger("zpipe.stage")

_Item = TypeVar("_Item")


# A receive loop gives the event loop back after this many messages. A message
# already queued is taken without waiting (zmq.asyncio hands back a finished
# future, zpipe's fast path a plain call), so under a flood a loop that drops
# what it reads would never yield until its queue ran dry, and the stage's
# heartbeats and control link would starve: a live stage declared dead (issue 33,
# finding 6). One pass of the loop per 32 messages costs nothing measurable.
YIELD_EVERY = 32


async def serve_messages(
    receive: Callable[[], Awaitable[_Item]],
    handle: Callable[[_Item], Awaitable[None]],
    on_error: Callable[[_Item, Exception], None],
) -> None:
    """Receive and handle until cancelled; an exception from handling one item goes
    to ``on_error`` and the loop goes on. An exception from ``receive`` itself
    (a closed or broken socket) ends the loop: its supervisor decides."""
    served = 0
    while True:
        item = await receive()
        served += 1
        if served % YIELD_EVERY == 0:
            await asyncio.sleep(0)  # see YIELD_EVERY
        try:
            await handle(item)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            on_error(item, exc)


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


TaskFactory = Callable[[], Coroutine[Any, Any, None]]


class TaskSupervisor:
    """Long-lived tasks by name. One that ends with an exception is logged and
    reported to ``on_death(name, error)``; one that is cancelled is not."""

    def __init__(self, stage: str, on_death: Callable[[str, BaseException], None]) -> None:
        self._stage = stage
        self._on_death = on_death
        self._factories: dict[str, TaskFactory] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, name: str, factory: TaskFactory) -> asyncio.Task[None]:
        self.cancel(name)
        self._factories[name] = factory
        task = asyncio.create_task(factory(), name=f"{self._stage}:{name}")
        self._tasks[name] = task
        task.add_done_callback(lambda done: self._ended(name, done))
        return task

    def restart(self, name: str) -> None:
        factory = self._factories.get(name)
        if factory is not None:
            log.warning("task_restarted", stage=self._stage, task=name)
            self.start(name, factory)

    def cancel(self, name: str) -> asyncio.Task[None] | None:
        self._factories.pop(name, None)
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()
        return task

    async def stop(self, names: list[str] | None = None) -> None:
        """Cancel ``names`` (all when None) and wait until they have ended."""
        cancelled = [self.cancel(n) for n in list(self._tasks if names is None else names)]
        for task in cancelled:
            if task is None:
                continue
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception as exc:  # already reported by _ended
                log.debug("task_ended_with_error", stage=self._stage, error=str(exc))

    def running(self, name: str) -> bool:
        task = self._tasks.get(name)
        return task is not None and not task.done()

    def _ended(self, name: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(name) is not task:
            return  # replaced or cancelled on purpose: nothing to report
        del self._tasks[name]
        error = None if task.cancelled() else task.exception()
        if error is None:
            self._factories.pop(name, None)  # a loop that finished its work
            return
        log.error("task_died", stage=self._stage, task=name, error=describe_error(error))
        self._on_death(name, error)
