"""A stage's part in a live re-partition of a training run (FTPipeHD III-D, III-F).

Asynchronous runs flush at the pause (:class:`~zpipe.stage.executors.async_training.
AsyncTrainingExecutor`); a synchronous stage is between two rounds there anyway
(every round ends with its update), so it only waits for round ``step - 1``'s.

The coordinator's ``repartition_request`` comes in three phases
(:mod:`zpipe.protocol.repartition`), after a ``profile`` (the counters as they
are, no flush) when the coordinator looks before the client pauses:

- ``prepare``: wait until the executor flushed before batch ``step`` (the client
  paused its feed there), keep a snapshot of every unit here (weights, optimizer
  state, and for an asynchronous stage the weight versions still read) in the
  replica store under this stage's name, and answer with the stage's counters
  (the coordinator's execution profile);
- ``fetch``: take the units of the new cuts from those snapshots, this stage's own
  or a peer's, fetched straight from the peer's probe socket (the peer answers
  from its snapshot, so it may go on serving after it switched); kept until the
  commit, nothing changes yet;
- ``commit``: build the shard of the new range from what was fetched and go on
  from batch ``step`` (without new cuts: on the same shard).

Leaving a device out (``leave_out``, eq. 5's ``l = j``) is the same move with one
more thing at the commit: the coordinator sends each stage kept its place in the
shorter chain (``chain``: index, stage count, neighbours), and the stage takes it
before it resumes (:meth:`~zpipe.stage.dataplane.DataPlane.rewire`: a PUSH to a new
neighbour, the senders it accepts; the executor's index). This is the smallest
honest path: the pipeline has drained at the pause (every mini-batch acknowledged)
and the leaver's units are fetched from its own snapshot at the flush, the live
state, nothing lost (a fast resume would have stopped the run, started another and
re-sent the assignments for a device that is alive). The run's depth stays, so
vertical sync reads the same weight versions and the run's losses and weights are
those of the same run without the leave-out. The first and last stages stay (the
client's feed and sink are wired to them). The device left out gets no commit: it
stays at its flush, idle, until its next assignment.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch

from zpipe._errors import PipelineError
from zpipe.log import get_logger
from zpipe.planner.async_schedule import async_warmup
from zpipe.protocol.repartition import RepartitionReply, RepartitionRequest
from zpipe.stage.executors.async_shard import AsyncShard
from zpipe.stage.executors.async_training import AsyncTrainingExecutor
from zpipe.stage.executors.sync_training import (
    CLIENT,
    DataParallelGroup,
    TrainingExecutor,
    TrainingSetup,
)
from zpipe.stage.executors.training_shard import TrainShard
from zpipe.stage.metrics import StageCounters
from zpipe.stage.snapshots import SnapshotService
from zpipe.stage.supervision import describe_error

log = get_logger("zpipe.stage")

# mini-batches of compute a look's reply carries one by one (``recent``): more than
# a look's window at the bench's every 10, few enough to stay a small reply
RECENT = 32


class StageRepartition:
    def __init__(
        self,
        *,
        name: str,
        snapshots: SnapshotService,
        counters: StageCounters,
        compute: ThreadPoolExecutor,
        timeout_s: float,
    ) -> None:
        self.name = name
        self._compute = compute
        self._snapshots = snapshots
        self._counters = counters
        self._timeout_s = timeout_s
        # (run, step, bounds, the fetched state) between the fetch and the commit
        self._fetched: tuple[int, int, tuple[int, ...], dict[str, torch.Tensor]] | None = None

    async def reply(
        self,
        request: RepartitionRequest,
        trainer: TrainingExecutor | None,
        rewire: Rewire | None = None,
        allow: Allow | None = None,
    ) -> RepartitionReply:
        run, step, phase = request.run, request.step, request.phase
        metrics: dict[str, Any] | None = None
        error = ""
        try:
            if trainer is None or trainer.setup.run != run:
                raise PipelineError(f"this stage is not training run {run}")
            if len(trainer.setup.group.names) > 1:
                raise PipelineError("a live re-partition moves units of one-device stages only")
            if phase == "profile":
                # the counters as they are, while the pipeline runs: a look before
                # any flush (most looks keep the cuts, and then nothing pauses)
                shard = trainer.shard  # and the units it trains now, as a commit says
                metrics = {
                    **self._counters.to_dict(),
                    "start": shard.start,
                    "end": shard.start + len(shard.units),
                    "recent": recent_compute(self._counters),
                }
            elif phase == "prepare":
                await self._prepare(trainer, run, step)
                metrics = {**self._counters.to_dict(), "recent": recent_compute(self._counters)}
            elif phase == "fetch":
                bounds = _bounds(request)
                entries = list(request.fetch or [])
                if request.chain is not None and allow is not None:
                    # a leave-out's new neighbours, admitted before anyone commits and
                    # connects (a refused CURVE handshake is not tried again)
                    allow(_chain(trainer, request.chain)[1])
                state = await self._snapshots.fetched_state(entries)
                self._fetched = (run, step, bounds, state)
                log.info("repartition_fetched", stage=self.name, run=run, step=step,
                         units=sum(int(e["end"]) - int(e["start"]) for e in entries),
                         peers=sorted({str(e["from"]) for e in entries} - {self.name}))  # fmt: skip
            elif phase == "commit":
                chain = None
                if request.chain is not None:
                    chain = _chain(trainer, request.chain)
                    if rewire is None or not isinstance(trainer, AsyncTrainingExecutor):
                        raise PipelineError("only an asynchronous stage leaves a device out")
                await self._commit(
                    trainer, run, step, _bounds(request), request.plan_epoch, chain, rewire
                )
                shard = trainer.shard  # the units it trains from here on
                metrics = {"start": shard.start, "end": shard.start + len(shard.units)}
            else:
                raise PipelineError(f"unknown repartition phase {phase!r}")
        except Exception as exc:  # reported: the coordinator decides what it means
            error = describe_error(exc)
            log.error("repartition_failed", stage=self.name, phase=phase, error=error)
        return RepartitionReply(
            run=run,
            name=self.name,
            step=step,
            phase=phase,
            error=error,
            metrics=metrics,
            epoch=request.epoch,
        )

    async def _prepare(self, trainer: TrainingExecutor, run: int, step: int) -> None:
        started = time.perf_counter()
        if isinstance(trainer, AsyncTrainingExecutor):
            await trainer.wait_flushed(step, self._timeout_s)
        else:
            await trainer.wait_for_step(step, self._timeout_s)
            if trainer.completed_steps != step:
                raise PipelineError(f"round {trainer.completed_steps} ran past the pause at {step}")
        flushed = time.perf_counter()
        shard = trainer.shard
        loop = asyncio.get_running_loop()
        # the versions the run's depth reads (a recovered run's may exceed its stages)
        n = (
            trainer.depth
            if isinstance(trainer, AsyncTrainingExecutor)
            else trainer.setup.num_stages
        )
        snapshot = await loop.run_in_executor(self._compute, shard.repartition_snapshot, n)
        self._snapshots.held.replicas.put(self.name, run, step, snapshot)
        self._fetched = None
        log.info("repartition_prepared", stage=self.name, run=run, step=step,
                 units=[shard.start, shard.start + len(shard.units)],
                 flush_wait_s=round(flushed - started, 4),
                 snapshot_s=round(time.perf_counter() - flushed, 4))  # fmt: skip

    async def _commit(
        self,
        trainer: TrainingExecutor,
        run: int,
        step: int,
        bounds: tuple[int, ...],
        plan_epoch: int | None = None,
        chain: tuple[TrainingSetup, dict[str, tuple[str, str | None]]] | None = None,
        rewire: Rewire | None = None,
    ) -> None:
        asynchronous = isinstance(trainer, AsyncTrainingExecutor)
        at = trainer.flushed_at if isinstance(trainer, AsyncTrainingExecutor) else None
        if asynchronous and at != step:
            if at is None and self._fetched is None:
                return  # a commit sent again after it resumed: done already
            raise PipelineError(f"commit at batch {step}, but flushed at {at}")
        if not asynchronous and trainer.completed_steps != step:
            raise PipelineError(f"commit at round {step}, but {trainer.completed_steps} are done")
        i = trainer.setup.index if chain is None else chain[0].index
        if len(bounds) != (trainer.setup.num_stages if chain is None else chain[0].num_stages) + 1:
            raise PipelineError(f"cuts {list(bounds)} are not of this chain's stages")
        start, end = bounds[i], bounds[i + 1]
        shard = trainer.shard
        new: TrainShard | None = None
        started = time.perf_counter()
        if (start, end) != (shard.start, shard.start + len(shard.units)):
            fetched = self._fetched
            if fetched is None or fetched[:3] != (run, step, bounds):
                raise PipelineError(f"commit of cuts {list(bounds)} that were not fetched")
            loop = asyncio.get_running_loop()
            new = await loop.run_in_executor(self._compute, shard.regrouped, start, end, fetched[3])
        self._fetched = None
        if isinstance(trainer, AsyncTrainingExecutor):
            assert new is None or isinstance(new, AsyncShard)
            if chain is not None and rewire is not None:
                rewire(*chain)
                trainer.rewired(chain[0])
            trainer.resume(step, new)
            if plan_epoch is not None:
                # the cuts' epoch its speed verdicts name; other units (a move here):
                # another forward time, and the speed watch starts again from the old
                # one scaled by the units' count (zpipe.training.forward_watch)
                scale = (end - start) / max(len(shard.units), 1) if new is not None else None
                trainer.committed(plan_epoch, scale=scale)
        elif new is not None:
            trainer.shard = new  # the next round's forward runs the new units
        log.info("repartition_committed", stage=self.name, run=run, step=step,
                 units=[start, end], moved=new is not None,
                 regroup_s=round(time.perf_counter() - started, 4))  # fmt: skip


def recent_compute(counters: StageCounters, newest: int = RECENT) -> list[list[float]]:
    """The newest ``newest`` mini-batches' forwards, ``[mb, seconds]`` oldest first. A
    look finds a change of speed inside its window from them
    (:mod:`zpipe.training.repartition_window`), which the counters' sums cannot show.
    Forwards, not forwards and backwards: at a look without a flush the stages hold
    several mini-batches between their forward and their backward (a middle stage of
    four about three), so of a window of ten only five or so had both, and a look
    right after a change had two."""
    forward: dict[int, float] = {}
    for span in counters.timeline.newest():
        if span.phase == "forward" and span.mb >= 0:
            forward.setdefault(span.mb, span.end - span.start)
            if len(forward) >= newest:
                break
    return [[mb, round(forward[mb], 6)] for mb in sorted(forward)]


def _bounds(request: RepartitionRequest) -> tuple[int, ...]:
    bounds = request.bounds
    if not isinstance(bounds, list) or not all(isinstance(b, int) for b in bounds):
        raise PipelineError(f"a repartition needs its bounds, got {bounds!r}")
    return tuple(bounds)


# a re-partition that leaves a device out re-wires the stage's data plane with it
Rewire = Callable[[TrainingSetup, dict[str, tuple[str, str | None]]], None]
# and admits its new neighbours on its data port, at the fetch (before any commit)
Allow = Callable[[dict[str, tuple[str, str | None]]], None]


def _chain(
    trainer: TrainingExecutor, chain: Mapping[str, Any]
) -> tuple[TrainingSetup, dict[str, tuple[str, str | None]]]:
    """This stage's setup in the shorter chain a commit names, and its neighbours'
    endpoints and keys; PipelineError when the coordinator's map is malformed."""
    try:
        index, n = int(chain["index"]), int(chain["num_stages"])
        sides = [_side(chain[name]) for name in ("upstream", "downstream")]
    except (KeyError, TypeError, ValueError) as exc:
        raise PipelineError(f"a malformed chain in a commit: {chain!r} ({exc})") from None
    if not 0 <= index < n:
        raise PipelineError(f"stage {index} of a chain of {n}")
    setup = replace(
        trainer.setup,
        index=index,
        num_stages=n,
        warmup=async_warmup(index, n),
        upstream=sides[0][0],
        downstream=sides[1][0],
    )
    peers = {**{k: v for k, v in sides[0][1].items() if k != CLIENT}, **sides[1][1]}
    return setup, peers


def _side(entry: Any) -> tuple[DataParallelGroup, dict[str, tuple[str, str | None]]]:
    names = tuple(str(n) for n in entry["names"])
    shares = tuple(int(x) for x in entry["shares"])
    endpoints = [str(e) for e in entry["endpoints"]]
    keys = list(entry.get("keys") or [None] * len(names))
    if not (len(names) == len(shares) == len(endpoints) == len(keys) == 1):
        raise ValueError("a leave-out re-wires one-device neighbours only")
    peers = {
        n: (e, None if k is None else str(k))
        for n, e, k in zip(names, endpoints, keys, strict=True)
    }
    return DataParallelGroup(names, shares), peers
