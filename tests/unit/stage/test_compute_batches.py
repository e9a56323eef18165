"""ComputeBatches: inputs to a compute thread and results back, in batches and in order."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from zpipe.stage.executors.compute_batches import ComputeBatches, Computed

WAIT_S = 60.0


def _take_all(queued: deque[int]) -> list[int]:
    taken = list(queued)
    queued.clear()
    return taken


def test_a_loop_pass_of_inputs_goes_in_one_batch_with_one_wakeup() -> None:
    threads: set[int] = set()

    def double(batch: list[int]) -> list[int]:
        threads.add(threading.get_ident())
        return [2 * x for x in batch]

    async def run() -> list[Computed[int, int]]:
        with ThreadPoolExecutor(max_workers=1) as executor:
            batches = ComputeBatches(executor=executor, compute=double, next_batch=_take_all)
            for x in range(5):  # one loop pass: nothing awaited in between
                batches.put(x)
            got = await asyncio.wait_for(batches.results(), WAIT_S)
            assert batches.counts.thread_wakeups == 1 and batches.counts.batches == 1
            return got

    got = asyncio.run(run())
    assert [(c.inputs, c.results) for c in got] == [([0, 1, 2, 3, 4], [0, 2, 4, 6, 8])]
    assert threading.get_ident() not in threads  # computed off the event loop


def test_batches_come_back_in_order_and_a_failing_batch_is_reported_not_lost() -> None:
    def compute(batch: list[int]) -> list[int]:
        if -1 in batch:
            raise RuntimeError("a bug in compute")
        return batch

    async def run() -> list[Computed[int, int]]:
        with ThreadPoolExecutor(max_workers=1) as executor:
            one_each = ComputeBatches(
                executor=executor, compute=compute, next_batch=lambda q: [q.popleft()]
            )
            for x in (1, -1, 3):
                one_each.put(x)
            got: list[Computed[int, int]] = []
            while len(got) < 3:
                got += await asyncio.wait_for(one_each.results(), WAIT_S)
            return got

    got = asyncio.run(run())
    assert [c.inputs for c in got] == [[1], [-1], [3]]
    assert got[0].results == [1] and got[2].results == [3]
    assert isinstance(got[1].failure, RuntimeError) and got[1].results == []


def test_close_drops_what_is_queued_and_what_the_running_batch_gives() -> None:
    release = threading.Event()
    entered = threading.Event()
    computed: list[list[int]] = []

    def held(batch: list[int]) -> list[int]:
        entered.set()
        release.wait(WAIT_S)
        computed.append(batch)
        return batch

    async def run() -> ComputeBatches[int, int]:
        executor = ThreadPoolExecutor(max_workers=1)
        batches = ComputeBatches(
            executor=executor, compute=held, next_batch=lambda q: [q.popleft()]
        )
        batches.put(1)
        await asyncio.sleep(0)  # the pass ends: 1 goes to the thread
        await asyncio.to_thread(entered.wait, WAIT_S)
        batches.put(2)
        await asyncio.sleep(0)  # 2 queued behind the running batch
        batches.close()
        release.set()
        await asyncio.to_thread(executor.shutdown, wait=True)
        await asyncio.sleep(0)  # a call into the loop, had there been one, runs now
        return batches

    batches = asyncio.run(run())
    assert computed == [[1]]  # 2 was never computed
    assert not batches._results and not batches.pending()
    assert batches.counts.loop_calls == 0  # the closed batch's results went nowhere
