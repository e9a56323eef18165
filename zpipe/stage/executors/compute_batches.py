"""Inputs to a stage's compute thread and results back, in batches.

Every trip between the event loop and the compute thread costs a wake-up of the
thread that sleeps (a futex, a context switch, a GIL hand-off) whatever the
input's size: on a stage that relays small messages these wake-ups cost more
than the compute (bench/stage_relay.py). :class:`ComputeBatches` pays them per
burst instead of per input::

    loop: put, put, put ─(end of the loop pass)─> one submit, if the thread is idle
    thread: batch, batch, ... until the queue is empty  (never sleeps between them)
    thread ─(one call into the loop while the loop has not yet looked)─> results

* The loop stages the inputs of one loop pass (a receive loop takes every
  message already queued on its socket without suspending) and hands them over
  at the end of the pass, together. The thread is woken only when it has no
  batch queued or running; a thread at work takes the new inputs after its
  current batch.
* The thread takes batches (``next_batch`` says how many inputs go together)
  until its queue is empty. Each batch is one job on the stage's single-thread
  executor, queued again behind any other job the stage gave that thread (a
  shard build, a snapshot), so those still take turns with a stream of inputs;
  the worker takes a queued job without sleeping.
* Results go back in order with one ``call_soon_threadsafe`` per stretch in
  which the loop has not looked: results that come while a call is on its way
  ride on it.

The loop never computes (DESIGN.md): ``compute`` runs on the executor only.
What is queued here is bounded by the caller (it admits at most so many inputs
before their results are consumed).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

_In = TypeVar("_In")
_Out = TypeVar("_Out")


@dataclass(frozen=True)
class Computed(Generic[_In, _Out]):
    """One batch's inputs and what computing them gave: ``results`` (one per input,
    in order), or ``failure``, which ``compute`` raised for the batch as a whole."""

    inputs: list[_In]
    results: list[_Out]
    failure: BaseException | None = None


@dataclass
class HandOffCounts:
    """How often each side woke the other (each a thread hand-off), for the bench."""

    inputs: int = 0
    batches: int = 0
    thread_wakeups: int = 0  # submits to an idle compute thread
    loop_calls: int = 0  # call_soon_threadsafe from the compute thread


class ComputeBatches(Generic[_In, _Out]):
    """Batches of inputs to ``compute`` on ``executor``'s thread, results back in order.

    ``next_batch(queue)`` runs on the compute thread and pops the inputs that go
    together (at least one) from the left of ``queue``; ``compute(batch)`` runs there
    too and returns one result per input. Loop-side methods must be called on the
    event loop's thread.
    """

    def __init__(
        self,
        *,
        executor: ThreadPoolExecutor,
        compute: Callable[[list[_In]], list[_Out]],
        next_batch: Callable[[deque[_In]], list[_In]],
    ) -> None:
        self._executor = executor
        self._compute = compute
        self._next_batch = next_batch
        self._loop: asyncio.AbstractEventLoop | None = None
        self._staged: list[_In] = []  # this loop pass's inputs (loop thread only)
        self._flush_scheduled = False
        self._lock = threading.Lock()  # guards everything below it
        self._queued: deque[_In] = deque()
        self._running = False  # a batch job is queued on, or running in, the executor
        self._results: deque[Computed[_In, _Out]] = deque()
        self._told = False  # a call into the loop for the results is on its way
        self._closed = False
        self._waiter: asyncio.Future[None] | None = None  # the consumer (loop thread)
        self.counts = HandOffCounts()

    # ---------------------------------------------------------------- loop side

    def put(self, item: _In) -> None:
        """Queue ``item``; it goes to the thread at the end of this loop pass."""
        if self._closed:
            return
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        self._staged.append(item)
        self.counts.inputs += 1
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        staged, self._staged = self._staged, []
        with self._lock:
            if self._closed:
                return
            self._queued.extend(staged)
            if self._running or not self._queued:
                return  # the thread takes them after its current batch
            self._running = True
        self.counts.thread_wakeups += 1
        self._submit_batch_job()

    async def results(self) -> list[Computed[_In, _Out]]:
        """The batches computed since the last call, oldest first; waits for one."""
        while True:
            with self._lock:
                if self._results:
                    taken = list(self._results)
                    self._results.clear()
                    return taken
            assert self._loop is not None or not self._closed
            loop = self._loop or asyncio.get_running_loop()
            self._loop = loop
            self._waiter = loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def pending(self) -> bool:
        """Whether inputs are staged, queued or computing (results not yet taken)."""
        return bool(self._staged) or self._running

    def close(self) -> None:
        """Drop every input not yet computed and every result not yet taken; a batch
        computing now finishes on the thread, and its results are dropped."""
        with self._lock:
            self._closed = True
            self._queued.clear()
            self._results.clear()
        self._staged.clear()

    def _results_arrived(self) -> None:
        with self._lock:
            self._told = False
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -------------------------------------------------------------- thread side

    def _submit_batch_job(self) -> None:
        try:
            self._executor.submit(self._compute_one_batch)
        except RuntimeError:  # the executor shut down: the stage is closing
            with self._lock:
                self._running = False

    def _compute_one_batch(self) -> None:
        """On the compute thread: one batch, then queue the next one as a new job (so
        the executor's other jobs take turns), or stop when nothing is queued."""
        with self._lock:
            if self._closed or not self._queued:
                self._running = False
                return
            batch = self._next_batch(self._queued)
        try:
            computed = Computed(batch, self._compute(batch))
        except BaseException as exc:  # compute keeps each input's own error: a bug
            computed = Computed(batch, [], exc)
        self.counts.batches += 1  # before the loop can see the results
        with self._lock:
            if self._closed:
                self._running = False
                return
            self._results.append(computed)
            tell, self._told = not self._told, True
            more = bool(self._queued)
            self._running = more
        if more:
            self._submit_batch_job()
        if tell:
            self.counts.loop_calls += 1
            assert self._loop is not None
            try:
                self._loop.call_soon_threadsafe(self._results_arrived)
            except RuntimeError:  # the loop closed: nobody takes the results any more
                pass
