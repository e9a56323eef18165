"""The training executor of one stage: runs its schedule's actions, round after round.

The stage's receive loop hands over activations (``data`` from upstream),
gradients (``grad`` from downstream) and, on the last stage, ``labels`` from
the client; the executor runs each round's actions in order
(:func:`zpipe.training.schedules.stage_actions`): a forward waits for its
activation, a backward for its gradient, then ``STEP`` applies the optimizer.
Compute runs in the stage's compute thread; sends are queued on the stage's
(possibly emulated) outgoing link and overlap the next compute.

Micro-batch ids are global: round r's micro-batch m is ``r * M + m``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

from zpipe._errors import PipelineError, TransportTimeout
from zpipe.log import get_logger
from zpipe.stage.metrics import StageCounters
from zpipe.stage.train_shard import TrainShard
from zpipe.training.schedules import stage_actions
from zpipe.transport.codec import Message

log = get_logger("zpipe.stage")

# send(target, message): target is "downstream" or "upstream"
Sender = Callable[[str, Message], Awaitable[None]]
_T = TypeVar("_T")


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
    upstream: str
    downstream: str
    wait_s: float


class TrainingExecutor:
    def __init__(
        self,
        setup: TrainingSetup,
        shard: TrainShard,
        *,
        send: Sender,
        compute: ThreadPoolExecutor,
        counters: StageCounters,
    ) -> None:
        self.setup = setup
        self.shard = shard
        self._send = send
        self._compute = compute
        self.counters = counters
        self._arrived: dict[tuple[str, int], Message] = {}
        self._waiters: dict[tuple[str, int], asyncio.Future[Message]] = {}
        self.completed_steps = 0
        self._current_mb = 0  # the micro-batch being worked on, named if it fails
        self.failure: str | None = None  # set when the run broke; no more steps will come
        self._step_done = asyncio.Condition()
        self.actions = stage_actions(
            setup.schedule,
            stage=setup.index,
            num_stages=setup.num_stages,
            num_microbatches=setup.num_microbatches,
            warmup=setup.warmup,
        )

    # ------------------------------------------------------------ arrivals

    def deliver(self, message: Message) -> None:
        """An activation, gradient or label for a micro-batch, already validated."""
        key = (message.kind, int(message["mb"]))
        waiter = self._waiters.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(message)
        elif key in self._arrived:
            raise PipelineError(f"a second {key[0]} for micro-batch {key[1]}")
        else:
            self._arrived[key] = message

    async def _take(self, kind: str, mb: int, peer: str) -> Message:
        key = (kind, mb)
        message = self._arrived.pop(key, None)
        if message is not None:
            return message
        waiter: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._waiters[key] = waiter
        waited_from = time.perf_counter()
        try:
            return await asyncio.wait_for(waiter, self.setup.wait_s)
        except asyncio.TimeoutError:
            raise TransportTimeout(peer, f"{kind} of micro-batch {mb}", self.setup.wait_s) from None
        finally:
            self._waiters.pop(key, None)
            self.counters.idle_s += time.perf_counter() - waited_from

    # ------------------------------------------------------------ the rounds

    async def run(self) -> None:
        """Run rounds until cancelled; a failure is reported downstream and ends the run."""
        try:
            while True:
                await self._round(self.completed_steps)
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

    async def _round(self, step: int) -> None:
        base = step * self.setup.num_microbatches
        for action in self.actions:
            if action.kind == "F":
                assert action.microbatch is not None
                await self._forward(base + action.microbatch, step)
            elif action.kind == "B":
                assert action.microbatch is not None
                await self._backward(base + action.microbatch)
            elif action.kind == "STEP":
                await self._in_thread(self.shard.step)
                async with self._step_done:
                    self.completed_steps = step + 1
                    self._step_done.notify_all()
                log.debug("step_done", stage=self.setup.name, step=step)
            # RECV_* happen inside F/B (waiting for the message); SEND_* are queued there.

    async def _in_thread(self, fn: Callable[..., _T], *args: object) -> _T:
        started = time.perf_counter()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)
        finally:
            self.counters.busy_s += time.perf_counter() - started

    async def _forward(self, mb: int, step: int) -> None:
        s = self.setup
        self._current_mb = mb
        if s.index == 0:
            inputs = await self._take("data", mb, "client")
        else:
            inputs = await self._take("data", mb, s.upstream)
        target, samples = None, 0
        if s.index == s.num_stages - 1:
            labels = await self._take("labels", mb, "client")
            target, samples = labels.tensors[0], int(labels["samples"])
        outputs, loss, _ = await self._in_thread(
            self.shard.forward, mb, inputs.tensors, target, samples
        )
        self.counters.microbatches += 1
        self.counters.peak_live_activations = self.shard.peak_live
        self.counters.peak_activation_bytes = self.shard.peak_activation_bytes
        if loss is not None:
            await self._send(
                "downstream",
                Message(
                    "loss",
                    {"run": s.run, "mb": mb, "step": step, "loss": loss, "src": s.name},
                    epoch=s.epoch,
                ),
            )
        else:
            await self._send(
                "downstream",
                Message(
                    "data", {"run": s.run, "mb": mb, "src": s.name}, epoch=s.epoch, tensors=outputs
                ),
            )

    async def _backward(self, mb: int) -> None:
        s = self.setup
        self._current_mb = mb
        grad_outputs: tuple[torch.Tensor, ...] = ()
        if s.index != s.num_stages - 1:
            grad_outputs = (await self._take("grad", mb, s.downstream)).tensors
        grads, _ = await self._in_thread(self.shard.backward, mb, grad_outputs)
        if s.index > 0:
            body = {"run": s.run, "mb": mb, "src": s.name}
            await self._send("upstream", Message("grad", body, epoch=s.epoch, tensors=grads))

    async def _report_failure(self, exc: BaseException) -> None:
        s = self.setup
        try:
            await self._send(
                "downstream",
                Message(
                    "error",
                    {
                        "run": s.run,
                        "mb": self._current_mb,
                        "src": s.name,
                        "stage": s.name,
                        "message": f"{type(exc).__name__}: {exc}",
                    },
                    epoch=s.epoch,
                ),
            )
        except Exception as send_exc:  # the run is over either way
            log.error("failure_not_reported", stage=s.name, error=str(send_exc))

    def pass_on_error(self, message: Message) -> Awaitable[None]:
        """An upstream stage failed: tell whoever is downstream, up to the client."""
        s = self.setup
        return self._send(
            "downstream", Message("error", {**message.body, "src": s.name}, epoch=s.epoch)
        )

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
