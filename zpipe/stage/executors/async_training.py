"""The executor of an asynchronous 1F1B stage (PipeDream, FTPipeHD).

Runs the stage's endless action list (:func:`zpipe.planner.async_schedule.
iter_async_actions`): warm-up forwards, then a backward, its update and a forward
in turn, an aggregation every so many backwards when asked for. A forward uses
the weight version :func:`~zpipe.planner.async_schedule.forward_version` names
(vertical sync, on by default: the version the first stage used), its backward
the same one (weight stashing, :mod:`zpipe.stage.executors.async_shard`).

The run's length is not known in advance: the client ends its feed with a
``data`` message that carries ``end`` and no rows (no batch from ``mb`` on
follows); each stage passes it on once it has forwarded every batch before it,
skips the forwards and backwards that will not come, and so runs exactly the
action list of a run of that many batches, which the single-process reference
runs too. The number of batches in flight is bounded by the client's window
(FTPipeHD's semaphore) and by the warm-up.

Micro-batch ids are batch numbers; ``completed_steps`` counts backwards (one
update each), so a checkpoint after ``N`` batches waits for all ``N``. A run
resumed from a replica numbers its batches from 0 again; its weight versions go
on from the replica's (``origin``).

With ``chain_every``/``global_every`` in its settings the stage copies its units
without draining (FTPipeHD): right after the update that makes its update count a
multiple of a period, the compute thread clones the units (weights of that
version, the stashed versions the next forwards read, optimizer state), between
two actions, so no later update can tear the copy; the loop's copy task sends it
(:mod:`zpipe.stage.live_copies`) while the next actions run. A wait at a flush
(a replica's or a re-partition's) is recorded as a ``flush`` span of the
timeline, a copy's clone as ``snapshot``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from zpipe._errors import PipelineError, TransportTimeout, ZpipeError
from zpipe.log import get_logger
from zpipe.planner.async_schedule import (
    AsyncSettings,
    aggregation_interval,
    concurrent_versions,
    forward_version,
    iter_async_actions,
    versions_read_after,
)
from zpipe.planner.schedules import Action
from zpipe.protocol.data_plane import Data, Labels, Loss
from zpipe.protocol.repartition import SpeedChanged
from zpipe.recovery.live_copies import copies_due
from zpipe.stage.executors.async_shard import AsyncShard
from zpipe.stage.executors.sync_training import (
    CLIENT,
    DataParallelGroup,
    GroupReducer,
    Piece,
    Sender,
    TrainingExecutor,
    TrainingSetup,
)
from zpipe.stage.executors.training_shard import TrainShard
from zpipe.stage.live_copies import LiveCopySender, PendingCopy
from zpipe.stage.metrics import StageCounters
from zpipe.stage.speed_watch import StageSpeedWatch
from zpipe.stage.timeline import clock
from zpipe.training.forward_watch import PassKind

log = get_logger("zpipe.stage")


class AsyncTrainingExecutor(TrainingExecutor):
    def __init__(
        self,
        setup: TrainingSetup,
        shard: TrainShard,
        *,
        send: Sender,
        compute: ThreadPoolExecutor,
        counters: StageCounters,
        reducer: GroupReducer | None = None,
    ) -> None:
        if len(setup.group.names) > 1 or reducer is not None:
            raise PipelineError("asynchronous 1F1B runs one device per stage")
        if not isinstance(shard, AsyncShard):
            raise PipelineError("asynchronous 1F1B needs an AsyncShard")
        super().__init__(setup, shard, send=send, compute=compute, counters=counters)
        self.async_shard = shard
        self.settings = AsyncSettings.from_dict(setup.async_settings)
        n, i = setup.num_stages, setup.index
        # A run resumed from a replica (zpipe.coordinator.runs.async_replicas): its batches
        # are numbered from 0 again, its versions go on from the replica's update
        # count, its forwards keep the staleness of the depth the run started with,
        # and its aggregations that depth's windows, counted from the run's start.
        self.depth = self.settings.depth_of(n)
        self.origin = shard.updates
        self._every = (
            aggregation_interval(i, self.depth, self.settings.aggregate_multiple)
            if self.settings.aggregate
            else None
        )
        self._versions = concurrent_versions(i, self.depth)
        # a resumed shard (a checkpoint, a replica) must hold what the next forwards read
        shard.check_versions(
            versions_read_after(
                i, n, self.origin, vertical_sync=self.settings.vertical_sync, depth=self.depth
            ),
            stages=n,
        )
        self._end: int | None = None  # the number of batches, once the feed ended
        self._end_passed = False
        self.aggregations = 0
        # A live re-partition pauses the feed: the stage runs until every batch
        # before the pause is backwarded (``flushed_at``), then waits to be resumed
        # from that batch (:meth:`resume`), its units possibly changed.
        self._first = 0  # the batch this segment of the run starts at
        self.flushed_at: int | None = None
        self._flush_changed = asyncio.Condition()
        self._resume: asyncio.Event = asyncio.Event()
        # copies without draining (set by the training plane when the settings ask)
        self.copies: LiveCopySender | None = None
        # the watch of this stage's own forwards and where its verdicts go (set by the
        # training plane when the run's re-partitioning asks: forward_watch)
        self.speed_watch: StageSpeedWatch | None = None
        self.report_speed: Callable[[SpeedChanged], Awaitable[None]] | None = None
        self._speed_reports: set[asyncio.Task[None]] = set()

    def replica_state(self) -> dict[str, torch.Tensor]:
        """At a flush (a replica's, or the run's end: a checkpoint's), every unit with
        the versions this stage reads next (under vertical sync those of the run's
        depth, what a re-partition moves); compute thread."""
        versions = versions_read_after(
            self.setup.index,
            self.setup.num_stages,
            self.async_shard.updates,
            vertical_sync=self.settings.vertical_sync,
            depth=self.depth,
        )
        return self.async_shard.saved_state(versions)

    def _schedule_actions(self) -> list[Action]:
        return []  # endless: iter_async_actions, in _train

    # ------------------------------------------------------------ arrivals

    def deliver(self, message: Piece) -> None:
        if isinstance(message, Data) and message.end:
            end = message.mb
            if self._end is not None and end != self._end:
                raise PipelineError(f"the feed ended at batch {end}, earlier at {self._end}")
            self._end = end
            for waiter in self._waiters.values():
                waiter.set()  # a forward waiting for a batch that will not come
            return
        super().deliver(message)

    async def _arrives(self, batch: int) -> bool:
        """Wait for ``batch``'s activations; False once the feed ended before it."""
        key: tuple[type[Piece], int] = (Data, batch)
        deadline = time.monotonic() + self.setup.wait_s
        waited_from = time.perf_counter()
        try:
            while True:
                if len(self._arrived.get(key, {})) >= len(self.setup.upstream.names):
                    return True
                if self._end is not None and batch >= self._end:
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportTimeout(
                        ", ".join(self.setup.upstream.names),
                        f"data of batch {batch}",
                        self.setup.wait_s,
                    )
                event = self._waiters.setdefault(key, asyncio.Event())
                event.clear()
                try:
                    await asyncio.wait_for(event.wait(), left)
                except asyncio.TimeoutError:
                    continue
        finally:
            self._waiters.pop(key, None)
            self.counters.idle_s += time.perf_counter() - waited_from

    # ------------------------------------------------------------ the run

    async def _train(self) -> None:
        while True:
            await self._segment()
            async with self._flush_changed:
                self.flushed_at = self._end
                self._flush_changed.notify_all()
            flushed = clock()
            # the run's end, or a pause for a re-partition: resumed by the latter
            await self._resume.wait()
            self._resume.clear()
            # drained and waiting: what replication without draining avoids
            self.counters.timeline.record(self._first, "flush", flushed, clock())

    async def wait_flushed(self, batch: int, timeout_s: float) -> None:
        """Wait until every batch before ``batch`` was backwarded and the stage waits to
        be resumed there; TransportTimeout after ``timeout_s``."""
        async with self._flush_changed:
            try:
                await asyncio.wait_for(
                    self._flush_changed.wait_for(
                        lambda: self.flushed_at == batch or self.failure is not None
                    ),
                    timeout_s,
                )
            except asyncio.TimeoutError:
                raise TransportTimeout(
                    self.setup.name, f"the flush before batch {batch}", timeout_s
                ) from None
        if self.failure is not None:
            raise PipelineError(f"the stage failed before the flush: {self.failure}")

    def resume(self, batch: int, shard: AsyncShard | None = None) -> None:
        """Go on from ``batch`` after a flush there, on ``shard`` if the units changed."""
        if self.flushed_at != batch:
            raise PipelineError(f"resume from batch {batch}, but flushed at {self.flushed_at}")
        if shard is not None:
            self.shard = self.async_shard = shard
        self._first, self._end, self._end_passed, self.flushed_at = batch, None, False, None
        self._resume.set()

    async def _segment(self) -> None:
        s = self.setup
        for action in iter_async_actions(
            s.index,
            s.num_stages,
            aggregate_every=self._every,
            first_batch=self._first,
            batches_before=self.origin,
        ):
            b = action.batch
            if action.kind == "F":
                assert b is not None
                if not await self._arrives(b):
                    await self._pass_end()
                    continue
                await self._forward_batch(b)
            elif action.kind == "B":
                assert b is not None
                if self._end is not None and b >= self._end:
                    return  # every batch of the run is done here
                await self._backward(b)
            elif action.kind == "STEP":
                await self._step(self.completed_steps)
            elif action.kind == "AGG":
                # before the backward of batch ``completed_steps``; none when it will
                # not come (the feed's end is known by then: its forward was skipped)
                if self._end is None or self.completed_steps < self._end:
                    started = time.perf_counter()
                    await self._in_thread(self.async_shard.aggregate, self._versions)
                    self.counters.step_s += time.perf_counter() - started
                    self.aggregations += 1

    async def _forward_batch(self, b: int) -> None:
        s = self.setup
        self._current_mb = b
        inputs, total, _ = await self._gather(Data, b, s.upstream)
        target, samples = None, 0
        if s.last:
            client = DataParallelGroup((CLIENT,), (1,))  # the labels come from the client
            labels, label_total, piece = await self._gather(Labels, b, client)
            if label_total != total:
                raise PipelineError(f"labels of batch {b} have {label_total} rows, not {total}")
            assert isinstance(piece, Labels)
            target, samples = (labels[0] if labels else None), piece.samples
        version = forward_version(
            s.index,
            s.num_stages,
            self.origin + b,
            vertical_sync=self.settings.vertical_sync,
            depth=self.depth,
        )
        started = time.perf_counter()
        outputs, loss, _ = await self._in_thread(
            self.async_shard.forward_at, b, version, inputs, target, samples, self._versions
        )
        done = time.perf_counter()
        self.counters.forward_s += done - started
        self.counters.timeline.record(b, "forward", started, done)
        self.counters.microbatches += 1
        self.counters.peak_live_activations = self.async_shard.peak_live
        self._watch_pass(b, done - started, "forward")
        self._rows[b] = (0, total, total)
        if s.last:
            reply = Loss(run=s.run, mb=b, step=b, loss=loss or 0.0, src=s.name, epoch=s.epoch)
            await self._send(CLIENT, reply)
        else:
            await self._scatter(Data, b, outputs, (0, total, total), s.downstream)

    async def _step(self, b: int) -> None:
        started = time.perf_counter()
        await self._in_thread(self.async_shard.step_batch, b)
        stepped = time.perf_counter()
        self.counters.step_s += stepped - started
        # on the timeline too: an emulated slow device's update is a third of its
        # mini-batch, and without its span a trace showed it as idle time
        self.counters.timeline.record(b, "step", started, stepped)
        await self._copy_if_due()
        async with self._step_done:
            self.completed_steps = b + 1
            self._step_done.notify_all()

    async def _copy_if_due(self) -> None:
        """Snapshot the units for the copies due at this update count (see the module
        notes); the copy task sends them while training goes on."""
        if self.copies is None:
            return
        step = self.async_shard.updates
        kinds = copies_due(
            step, chain_every=self.settings.chain_every, global_every=self.settings.global_every
        )
        if not kinds:
            return
        started = clock()
        # a clone of every tensor, in the compute thread between two actions: the
        # version of ``step`` and nothing later
        state = await self._in_thread(self.async_shard.live_copy, self.depth)
        self.counters.timeline.record(step, "snapshot", started, clock())
        shard = self.async_shard
        self.copies.offer(PendingCopy(self.setup.run, step, shard.start, shard.end, kinds, state))

    async def _backward(self, mb: int) -> None:
        # the base times the backward's compute (the thread's own, not the wait for the
        # gradient) into backward_s: its growth is this backward's time (0: no rows)
        before = self.counters.backward_s
        await super()._backward(mb)
        self._watch_pass(mb, self.counters.backward_s - before, "backward")

    def _watch_pass(self, b: int, seconds: float, kind: PassKind) -> None:
        """A forward's or a backward's compute time (the thread's own, not the waits
        for inputs) to the speed watch; a verdict leaves beside the training (a task:
        the next pass does not wait for the coordinator's socket)."""
        if self.speed_watch is None or self.report_speed is None:
            return
        verdict = self.speed_watch.observe(b, seconds, kind)
        if verdict is None:
            return
        log.info("speed_changed", stage=self.setup.name, run=self.setup.run, step=b, kind=kind,
                 ratio=round(verdict.ratio, 3), baseline_s=round(verdict.baseline_s, 6),
                 now_s=round(verdict.now_s, 6), plan_epoch=verdict.plan_epoch)  # fmt: skip
        task = asyncio.create_task(self._tell_speed(self.report_speed, verdict))
        self._speed_reports.add(task)
        task.add_done_callback(self._speed_reports.discard)

    async def _tell_speed(
        self, report: Callable[[SpeedChanged], Awaitable[None]], verdict: SpeedChanged
    ) -> None:
        try:
            await asyncio.wait_for(report(verdict), self.setup.wait_s)
        except (asyncio.TimeoutError, ZpipeError, OSError) as exc:
            # a hint only: the scheduled looks still come
            log.warning("speed_change_not_sent", stage=self.setup.name, error=repr(exc))

    def rewired(self, setup: TrainingSetup) -> None:
        """A re-partition's commit that left a device out: this stage's place in the
        shorter chain (``setup``: its index, the stage count, its neighbours) from the
        next segment on. The run's depth stays (vertical sync reads the versions of the
        pipeline the run started with, as a recovered run's do), so the weights each
        forward reads do not change; what does is the warm-up and, with aggregation,
        the window of this stage's new index (a recovered run's rule)."""
        if self.flushed_at is None:
            raise PipelineError("a stage is re-wired only while it waits at a flush")
        if setup.first != self.setup.first or setup.last != self.setup.last:
            raise PipelineError("a re-wired chain keeps its first and last stages")
        self.setup = setup
        i = setup.index
        self._every = (
            aggregation_interval(i, self.depth, self.settings.aggregate_multiple)
            if self.settings.aggregate
            else None
        )
        self._versions = concurrent_versions(i, self.depth)

    def committed(self, plan_epoch: int, *, scale: float | None) -> None:
        """A re-partition's commit: the cuts of ``plan_epoch`` from here on; ``scale``:
        this stage's units changed, the new ones' share of the old (None: they did not)."""
        if self.speed_watch is not None:
            self.speed_watch.committed(plan_epoch, scale=scale)

    async def _pass_end(self) -> None:
        """Tell the next stage the feed ended, once: after this stage's last forward."""
        s = self.setup
        if self._end_passed or s.last:
            return
        self._end_passed = True
        assert self._end is not None
        end = Data(
            run=s.run, mb=self._end, src=s.name, rows=[0, 0], total=0, end=True, epoch=s.epoch
        )
        for name in s.downstream.names:
            await self._send(name, end)
