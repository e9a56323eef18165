"""A stage's part in a live re-partition of an asynchronous run (FTPipeHD III-D, III-F).

The coordinator's ``repartition_request`` comes in three phases
(:mod:`zpipe.protocol.repartition`):

- ``prepare``: wait until the executor flushed before batch ``step`` (the client
  paused its feed there), keep a snapshot of every unit here (weights, optimizer
  state, the weight versions still read) in the replica store under this stage's
  name, and answer with the stage's counters (the coordinator's execution profile);
- ``fetch``: take the units of the new cuts from those snapshots, this stage's own
  or a peer's, fetched straight from the peer's probe socket (the peer answers
  from its snapshot, so it may go on serving after it switched); kept until the
  commit, nothing changes yet;
- ``commit``: build the shard of the new range from what was fetched and resume the
  executor from batch ``step`` (without new cuts: resume on the same shard).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from zpipe._errors import PipelineError
from zpipe.log import get_logger
from zpipe.stage.async_shard import AsyncShard
from zpipe.stage.async_trainer import AsyncTrainingExecutor
from zpipe.stage.metrics import StageCounters
from zpipe.stage.snapshots import SnapshotService
from zpipe.stage.supervision import describe_error
from zpipe.stage.trainer import TrainingExecutor
from zpipe.transport.codec import Message

log = get_logger("zpipe.stage")


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

    async def reply(self, message: Message, trainer: TrainingExecutor | None) -> dict[str, Any]:
        run, step, phase = int(message["run"]), int(message["step"]), str(message["phase"])
        body: dict[str, Any] = {
            "run": run,
            "name": self.name,
            "step": step,
            "phase": phase,
            "error": "",
        }
        try:
            if not isinstance(trainer, AsyncTrainingExecutor) or trainer.setup.run != run:
                raise PipelineError(f"this stage is not training asynchronous run {run}")
            if phase == "prepare":
                await self._prepare(trainer, run, step)
                body["metrics"] = self._counters.to_dict()
            elif phase == "fetch":
                bounds = _bounds(message)
                state = await self._snapshots.fetched_state(list(message.get("fetch") or []))
                self._fetched = (run, step, bounds, state)
            elif phase == "commit":
                await self._commit(trainer, run, step, _bounds(message))
                shard = trainer.async_shard  # the units it trains from here on
                body["metrics"] = {"start": shard.start, "end": shard.start + len(shard.units)}
            else:
                raise PipelineError(f"unknown repartition phase {phase!r}")
        except Exception as exc:  # reported: the coordinator decides what it means
            body["error"] = describe_error(exc)
            log.error("repartition_failed", stage=self.name, phase=phase, error=body["error"])
        return body

    async def _prepare(self, trainer: AsyncTrainingExecutor, run: int, step: int) -> None:
        await trainer.wait_flushed(step, self._timeout_s)
        shard = trainer.async_shard
        loop = asyncio.get_running_loop()
        n = trainer.setup.num_stages
        snapshot = await loop.run_in_executor(self._compute, shard.unit_snapshot, n)
        self._snapshots.replicas.put(self.name, run, step, snapshot)
        self._fetched = None
        log.info("repartition_prepared", stage=self.name, run=run, step=step,
                 units=[shard.start, shard.start + len(shard.units)])  # fmt: skip

    async def _commit(
        self, trainer: AsyncTrainingExecutor, run: int, step: int, bounds: tuple[int, ...]
    ) -> None:
        if trainer.flushed_at != step:
            if trainer.flushed_at is None and self._fetched is None:
                return  # a commit sent again after it resumed: done already
            raise PipelineError(f"commit at batch {step}, but flushed at {trainer.flushed_at}")
        i = trainer.setup.index
        start, end = bounds[i], bounds[i + 1]
        shard = trainer.async_shard
        new: AsyncShard | None = None
        if (start, end) != (shard.start, shard.start + len(shard.units)):
            fetched = self._fetched
            if fetched is None or fetched[:3] != (run, step, bounds):
                raise PipelineError(f"commit of cuts {list(bounds)} that were not fetched")
            loop = asyncio.get_running_loop()
            new = await loop.run_in_executor(self._compute, shard.regrouped, start, end, fetched[3])
        self._fetched = None
        trainer.resume(step, new)
        log.info("repartition_committed", stage=self.name, run=run, step=step,
                 units=[start, end], moved=new is not None)  # fmt: skip


def _bounds(message: Message) -> tuple[int, ...]:
    bounds = message.get("bounds")
    if not isinstance(bounds, list) or not all(isinstance(b, int) for b in bounds):
        raise PipelineError(f"a repartition needs its bounds, got {bounds!r}")
    return tuple(bounds)
