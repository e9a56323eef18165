"""The training executor of one stage device: runs its schedule's actions, round after round.

The stage's receive loop hands over activations (``data`` from the upstream
group), gradients (``grad`` from the downstream group) and, on the last stage,
``labels`` from the client; the executor runs each round's actions in order
(:func:`zpipe.planner.schedules.stage_actions`): a forward waits for its
activation, a backward for its gradient, ``ALLREDUCE`` sums the gradients of
the devices that share this stage, then ``STEP`` applies the optimizer.
Compute runs in the stage's compute thread; sends are queued on the stage's
(possibly emulated) outgoing link and overlap the next compute.

Data-parallel groups (Asteroid's hybrid pipeline parallelism): each device of
a group computes its block of every micro-batch's rows
(:mod:`zpipe.training.routing`); every device of one group sends every device
of the next one a piece (the rows they share, possibly none, with the
micro-batch's row count), so a receiver always knows how many pieces to wait
for. Losses are scaled to the whole mini-batch, so the group's gradients are
summed, not averaged.

Micro-batch ids are global: round r's micro-batch m is ``r * M + m``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from zpipe._errors import PipelineError, TransportTimeout
from zpipe.log import get_logger
from zpipe.planner.schedules import Action, stage_actions
from zpipe.protocol.data_plane import Data, Grad, Labels, Loss, MicroBatchError
from zpipe.stage.executors.training_shard import TrainShard
from zpipe.stage.live_copies import ChainPeer
from zpipe.stage.metrics import StageCounters
from zpipe.training.routing import split_rows

log = get_logger("zpipe.stage")

# A piece of a micro-batch this executor waits for, and what it sends.
Piece = Data | Grad | Labels
Outgoing = Data | Grad | Loss | MicroBatchError
# send(peer name, message)
Sender = Callable[[str, Outgoing], Awaitable[None]]
_T = TypeVar("_T")


class GroupReducer(Protocol):
    async def allreduce_(
        self, tensors: Sequence[torch.Tensor], *, op: str, round_id: int
    ) -> object: ...


@dataclass(frozen=True)
class DataParallelGroup:
    """Devices that share a stage (or the client, alone) and their shares of each row."""

    names: tuple[str, ...]
    shares: tuple[int, ...]

    def blocks(self, total: int) -> list[tuple[int, int]]:
        return split_rows(total, self.shares)


@dataclass(frozen=True)
class TrainingSetup:
    run: int
    epoch: int
    name: str
    index: int
    num_stages: int
    schedule: str
    num_microbatches: int
    warmup: int
    group: DataParallelGroup  # this stage's devices, this one included
    rank: int  # this device's place in ``group``
    upstream: DataParallelGroup  # the client alone on the first stage
    downstream: DataParallelGroup  # the client alone on the last stage
    wait_s: float
    # the devices whose backups this one keeps (chain and topology replication);
    # a backup from anyone else is refused
    backup_from: tuple[str, ...] = ()
    # asynchronous 1F1B's settings (zpipe.planner.async_schedule.AsyncSettings.to_dict)
    async_settings: dict[str, Any] | None = None
    # the next stage, which keeps this one's chain copies made without draining
    # (zpipe.stage.live_copies); None: the coordinator keeps them, or none are made
    chain_to: ChainPeer | None = None
    # an asynchronous run that re-partitions with a forward watch: its factor
    # (zpipe.stage.speed_watch); None: no watch
    forward_watch: float | None = None

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1


class TrainingExecutor:
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
        if len(setup.group.names) > 1 and reducer is None:
            raise PipelineError("a stage shared by several devices needs an all-reduce group")
        self.setup = setup
        self.shard = shard
        self._send = send
        self._compute = compute
        self._reducer = reducer
        self.counters = counters
        # (kind, micro-batch) -> pieces by sender
        # by (kind of piece, micro-batch): the pieces arrived, by sender; who waits
        self._arrived: dict[tuple[type[Piece], int], dict[str, Piece]] = {}
        self._waiters: dict[tuple[type[Piece], int], asyncio.Event] = {}
        self.completed_steps = 0
        self._step_done = asyncio.Condition()
        self._current_mb = 0  # the micro-batch being worked on, named if it fails
        self.failure: str | None = None  # set when the run broke; no more steps will come
        # rows of each micro-batch this device computes, and their row count
        self._rows: dict[int, tuple[int, int, int]] = {}
        self._round_rows = 0  # rows this device computed this round, of all rows
        self._round_total = 0
        self.actions = self._schedule_actions()

    def _schedule_actions(self) -> list[Action]:
        s = self.setup
        return stage_actions(
            s.schedule,
            stage=s.index,
            num_stages=s.num_stages,
            num_microbatches=s.num_microbatches,
            warmup=s.warmup,
            data_parallel=len(s.group.names) > 1,
        )

    # ------------------------------------------------------------ arrivals

    def deliver(self, message: Piece) -> None:
        """A piece of an activation, gradient or labels, already validated."""
        key: tuple[type[Piece], int] = (type(message), message.mb)
        _check_piece(message)
        pieces = self._arrived.setdefault(key, {})
        src = message.src
        if src in pieces:
            raise PipelineError(
                f"a second {message.KIND} piece from {src} for micro-batch {key[1]}"
            )
        pieces[src] = message
        waiter = self._waiters.get(key)
        if waiter is not None:
            waiter.set()

    async def _gather(
        self, kind: type[Piece], mb: int, senders: DataParallelGroup
    ) -> tuple[tuple[torch.Tensor, ...], int, Piece]:
        """Every sender's piece of ``mb``: the concatenated rows, the row count, one piece."""
        key = (kind, mb)
        waited_from = time.perf_counter()
        deadline = time.monotonic() + self.setup.wait_s
        try:
            while len(self._arrived.get(key, {})) < len(senders.names):
                left = deadline - time.monotonic()
                missing = [n for n in senders.names if n not in self._arrived.get(key, {})]
                if left <= 0:
                    raise TransportTimeout(
                        ", ".join(missing), f"{kind.KIND} of micro-batch {mb}", self.setup.wait_s
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
        pieces = self._arrived.pop(key)
        ordered = sorted(pieces.values(), key=lambda p: int(_rows(p)[0]))
        totals = {_rows(p)[2] for p in ordered}
        if len(totals) != 1:
            raise PipelineError(f"{kind.KIND} pieces of micro-batch {mb} disagree on its size")
        parts = [p.tensors for p in ordered if p.tensors]
        if not parts:
            return (), totals.pop(), ordered[0]
        joined = tuple(
            torch.cat(column) if len(parts) > 1 else column[0]
            for column in zip(*parts, strict=True)
        )
        return joined, totals.pop(), ordered[0]

    # ------------------------------------------------------------ the rounds

    async def run(self) -> None:
        """Run rounds until cancelled; a failure is reported downstream and ends the run."""
        try:
            await self._train()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.error(
                "training_failed", stage=self.setup.name, epoch=self.setup.epoch, error=str(exc)
            )
            async with self._step_done:
                self.failure = f"{type(exc).__name__}: {exc}"
                self._step_done.notify_all()
            await self._report_failure(exc)

    async def _train(self) -> None:
        while True:
            await self._round(self.completed_steps)

    async def _round(self, step: int) -> None:
        base = step * self.setup.num_microbatches
        for action in self.actions:
            if action.kind == "F":
                assert action.microbatch is not None
                await self._forward(base + action.microbatch, step)
            elif action.kind == "B":
                assert action.microbatch is not None
                await self._backward(base + action.microbatch)
            elif action.kind == "ALLREDUCE":
                await self._allreduce(step)
            elif action.kind == "STEP":
                started = time.perf_counter()
                await self._in_thread(self.shard.step)
                stepped = time.perf_counter()
                self.counters.step_s += stepped - started
                self.counters.timeline.record(-1, "step", started, stepped)
                self._round_rows = self._round_total = 0
                async with self._step_done:
                    self.completed_steps = step + 1
                    self._step_done.notify_all()
                log.debug("step_done", stage=self.setup.name, step=step)
            # RECV_* happen inside F/B (waiting for the pieces); SEND_* are queued there.

    async def _allreduce(self, step: int) -> None:
        """Sum the group's gradients; average its running statistics by rows computed.

        Losses are scaled to the whole mini-batch, so summed gradients are the
        mini-batch's. Buffers such as BatchNorm's running mean are updated by each
        replica from its own rows: weighting each by its share of the round's rows
        keeps the replicas identical and a device that computed nothing out of it.
        """
        assert self._reducer is not None
        started = time.perf_counter()
        grads = await self._in_thread(self.shard.all_gradients)
        await self._reducer.allreduce_(grads, op="sum", round_id=2 * step)
        buffers = await self._in_thread(self.shard.float_buffers)
        if buffers:
            weight = self._round_rows / self._round_total if self._round_total else 0.0
            for buffer in buffers:
                buffer.mul_(weight)
            await self._reducer.allreduce_(buffers, op="sum", round_id=2 * step + 1)
        # on an accelerator the reduced host copies go back onto the device
        await self._in_thread(self.shard.keep_reduced, grads, buffers)
        reduced = time.perf_counter()
        self.counters.allreduce_s += reduced - started
        self.counters.timeline.record(-1, "allreduce", started, reduced)

    async def _in_thread(self, fn: Callable[..., _T], *args: object) -> _T:
        started = time.perf_counter()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)
        finally:
            self.counters.busy_s += time.perf_counter() - started

    async def _forward(self, mb: int, step: int) -> None:
        s = self.setup
        self._current_mb = mb
        inputs, total, _ = await self._gather(Data, mb, s.upstream)
        lo, hi = s.group.blocks(total)[s.rank]
        self._rows[mb] = (lo, hi, total)
        self._round_rows += hi - lo
        self._round_total += total
        target, samples = None, 0
        if s.last:
            client = DataParallelGroup((CLIENT,), (1,))  # the labels come from the client
            labels, label_total, piece = await self._gather(Labels, mb, client)
            if label_total != total:
                raise PipelineError(
                    f"labels of micro-batch {mb} have {label_total} rows, not {total}"
                )
            assert isinstance(piece, Labels)
            target, samples = (labels[0] if labels else None), piece.samples
        if hi == lo:
            outputs: tuple[torch.Tensor, ...] = ()
            loss: float | None = 0.0 if s.last else None
        else:
            started = time.perf_counter()
            outputs, loss, _ = await self._in_thread(
                self.shard.forward, mb, inputs, target, samples
            )
            done = time.perf_counter()
            self.counters.forward_s += done - started
            self.counters.timeline.record(mb, "forward", started, done)
            self.counters.microbatches += 1
            self.counters.peak_live_activations = self.shard.peak_live
            self.counters.peak_activation_bytes = self.shard.peak_activation_bytes
        if s.last:
            reply = Loss(run=s.run, mb=mb, step=step, loss=loss or 0.0, src=s.name, epoch=s.epoch)
            await self._send(CLIENT, reply)
        else:
            await self._scatter(Data, mb, outputs, (lo, hi, total), s.downstream)

    async def _backward(self, mb: int) -> None:
        s = self.setup
        self._current_mb = mb
        lo, hi, total = self._rows.pop(mb)
        grad_outputs: tuple[torch.Tensor, ...] = ()
        if not s.last:
            grad_outputs, _, _ = await self._gather(Grad, mb, s.downstream)
        grads: tuple[torch.Tensor, ...] = ()
        if hi > lo:
            started = time.perf_counter()
            grads, _ = await self._in_thread(self.shard.backward, mb, grad_outputs)
            done = time.perf_counter()
            self.counters.backward_s += done - started
            self.counters.timeline.record(mb, "backward", started, done)
            self.counters.backwards += 1
        if not s.first:
            await self._scatter(Grad, mb, grads, (lo, hi, total), s.upstream)

    async def _scatter(
        self,
        kind: type[Data] | type[Grad],
        mb: int,
        tensors: tuple[torch.Tensor, ...],
        rows: tuple[int, int, int],
        receivers: DataParallelGroup,
    ) -> None:
        """Send every receiver the rows it shares with this device (maybe none)."""
        s = self.setup
        lo, hi, total = rows
        for name, (a, b) in zip(receivers.names, receivers.blocks(total), strict=True):
            start, end = max(lo, a), min(hi, b)
            piece: tuple[torch.Tensor, ...] = ()
            if start < end:
                piece = tuple(t[start - lo : end - lo] for t in tensors)
            else:
                start = end = max(lo, min(hi, a))
            out = kind(
                run=s.run,
                mb=mb,
                src=s.name,
                rows=[start, end],
                total=total,
                epoch=s.epoch,
                tensors=piece,
            )
            await self._send(name, out)

    async def _report_failure(self, exc: BaseException) -> None:
        s = self.setup
        error = MicroBatchError(
            run=s.run,
            mb=self._current_mb,
            src=s.name,
            stage=s.name,
            message=f"{type(exc).__name__}: {exc}",
            epoch=s.epoch,
        )
        for name in s.downstream.names:
            try:
                await self._send(name, error)
            except Exception as send_exc:  # the run is over either way
                log.error("failure_not_reported", stage=s.name, error=str(send_exc))

    async def pass_on_error(self, message: MicroBatchError) -> None:
        """A stage upstream failed: tell whoever is downstream, up to the client."""
        s = self.setup
        passed = dataclasses.replace(message, src=s.name, epoch=s.epoch)
        for name in s.downstream.names:
            await self._send(name, passed)

    async def wait_for_step(self, step: int, timeout_s: float) -> None:
        """Return once ``step`` rounds have completed on this stage."""

        async def reached() -> None:
            async with self._step_done:
                await self._step_done.wait_for(
                    lambda: self.completed_steps >= step or self.failure is not None
                )
            if self.completed_steps < step and self.failure is not None:
                raise PipelineError(f"training failed here before round {step}: {self.failure}")

        try:
            await asyncio.wait_for(reached(), timeout_s)
        except asyncio.TimeoutError:
            raise TransportTimeout(
                self.setup.name, f"round {step} to complete", timeout_s
            ) from None


CLIENT = "client"


def _check_piece(message: Piece) -> None:
    """Rows inside the micro-batch, and tensors of exactly that many rows (or none)."""
    rows, total = message.rows, message.total
    if not isinstance(rows, list) or len(rows) != 2 or not isinstance(total, int):
        raise PipelineError(f"a {message.KIND} piece without its rows and row count")
    lo, hi = rows
    if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi <= total):
        raise PipelineError(f"a {message.KIND} piece with rows {rows} of {total}")
    if hi > lo and not message.tensors:
        raise PipelineError(f"a {message.KIND} piece of rows {rows} carries no tensors")
    if any(t.dim() == 0 or t.shape[0] != hi - lo for t in message.tensors):
        raise PipelineError(f"a {message.KIND} piece's tensors do not have {hi - lo} rows")


def _rows(piece: Piece) -> tuple[int, int, int]:
    """A checked piece's rows [lo, hi) and row count (:func:`_check_piece` passed)."""
    assert piece.rows is not None and piece.total is not None
    lo, hi = piece.rows
    return int(lo), int(hi), piece.total
