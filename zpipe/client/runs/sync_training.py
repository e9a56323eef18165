"""One attempt of a training run on the client side: feed, losses, replicas, weights.

:func:`zpipe.client.fit` makes one :class:`TrainingRun` per attempt (a
recovery or a rebalance starts the next one from the replica). The attempt
feeds each mini-batch's micro-batches to the first stage's devices and their
labels to the last's, collects the losses from the sink, has the coordinator
keep a replica every ``replicate_every`` mini-batches, and gathers the trained
weights at the end. It is the I/O shell of one attempt: when to look, replicate or
stop is the fit's :class:`~zpipe.client.runs.training_attempts.TrainingAttempts`'s
decision, and which loss answers which mini-batch its
:class:`~zpipe.client.runs.training_attempts.StepLedger`'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq.asyncio

from zpipe._errors import PipelineError, ProtocolError, StageFailedError, TransportTimeout
from zpipe.client.batches import (
    BatchSource,
    TrainBatch,
    check_fits_first_stage,
    first_stage_limits,
    split_minibatch,
)
from zpipe.client.connection import CLIENT_NAME
from zpipe.client.failures import run_failed_error
from zpipe.client.reports import TrainReport
from zpipe.client.runs.async_repartition import (
    looked_epoch,
    predicted_period,
    repartition_before,
    room_or_verdict,
)
from zpipe.client.runs.training_attempts import (
    Acknowledged,
    Command,
    EndAttempt,
    FeedAt,
    KeepReplica,
    Looked,
    RepartitionLook,
    ReplicaKept,
    ReplicaRefused,
    SendMiniBatch,
    StartAttempt,
    StepLedger,
    TrainingAttempts,
)
from zpipe.client.session import RunSession
from zpipe.log import get_logger
from zpipe.models import ModelSpec
from zpipe.planner import Plan
from zpipe.planner.training_plan import TrainingPlan
from zpipe.progress import TerminalProgress
from zpipe.protocol import WireMessage
from zpipe.protocol.client_control import Checkpoint, Replicate, Replicated, RunFailed, RunReady
from zpipe.protocol.data_plane import Data, Labels, Loss, MicroBatchError
from zpipe.protocol.stage_control import WeightsRequest
from zpipe.training.routing import split_rows
from zpipe.transport.sockets import send

log = get_logger("zpipe.client")


@dataclass(frozen=True)
class AttemptEnd:
    """How an attempt ended, when not with an error: it finished (both None), a stage
    died (``stage_failure``: resume from the replica), or the coordinator proposed a
    better-balanced plan at the replica just kept (``rebalance_to``)."""

    stage_failure: StageFailedError | None = None
    rebalance_to: TrainingPlan | None = None


class TrainingRun:
    """One attempt: its data sockets, its losses and its report."""

    def __init__(
        self,
        session: RunSession,
        ready: RunReady,
        spec: ModelSpec,
        attempts: TrainingAttempts,
        start: StartAttempt,
        *,
        max_steps_in_flight: int | None,
    ) -> None:
        self.session = session
        self.connection = session.connection
        self.timeouts = session.timeouts
        self.run = session.run
        self.attempts = attempts
        self.m = start.num_microbatches
        self.report = TrainReport(
            run=self.run,
            plan=Plan.from_dict(ready.plan),
            model_spec=spec,
            schedule=start.schedule,
            num_microbatches=start.num_microbatches,
        )
        self.first_group: list[tuple[str, zmq.asyncio.Socket]] = []
        self.last_group: list[tuple[str, zmq.asyncio.Socket]] = []
        described = ready.training_plan
        if described is None:
            raise PipelineError("the coordinator sent no training plan")
        tplan = TrainingPlan.from_dict(described)
        self.report.training_plan = tplan
        endpoints, keys = dict(described["endpoints"]), dict(described["keys"])
        first, last = tplan.stages[0], tplan.stages[-1]
        # (device, socket): inputs go to the first group, labels to the last, by shares
        push = self.connection.push_to
        try:
            for n in first.devices:
                self.first_group.append((n, push(str(endpoints[n]), keys.get(n), n)))
            for n in last.devices:
                self.last_group.append((n, push(str(endpoints[n]), keys.get(n), n)))
        except BaseException:
            self.close()  # an open socket would keep the context from terminating
            raise
        self.first_shares = list(first.shares)
        # each first-stage device's data port limit per frame (None: not said)
        self.first_limits = first_stage_limits(
            first.devices, described, ready.first_max_message_bytes
        )
        self.last_shares = list(last.shares)
        self.last_names = set(last.devices)
        session.allow_sink_senders([keys.get(n) for n in last.devices])
        self.window = asyncio.Semaphore(max_steps_in_flight or self.default_window(tplan))
        self.started = time.perf_counter()
        self.step_samples: dict[int, int] = {}  # samples of each mini-batch in flight
        self.ledger = StepLedger(self.m, last.devices)
        self.all_sent = asyncio.Event()
        self.finished = asyncio.Event()
        self.step_finished = asyncio.Event()
        self.rebalance_to: TrainingPlan | None = None
        # the first mini-batch's number across recoveries, and the replica period
        self.offset = start.offset
        self.replicate_every = start.replicate_every
        self._step_done: Callable[[int, float], None] = lambda step, loss: None

    @property
    def sent_steps(self) -> int:
        return self.ledger.sent

    @property
    def done_steps(self) -> int:
        return self.ledger.done

    def default_window(self, plan: TrainingPlan) -> int:
        """Mini-batches fed ahead of their losses when the options name no bound."""
        return 2

    async def feed_ended(self) -> None:
        """Every mini-batch was sent (a run kind that must say so, says so here)."""

    async def pause_feed(self) -> None:
        """The feed stops for a live re-partition (a run kind whose stages must be told
        to flush, tells them here); a synchronous round ends with its update anyway."""

    async def train(
        self,
        source: BatchSource,
        progress: bool | None,
        on_step: Callable[[int, float], None] | None,
        *,
        total: int | None = None,
    ) -> AttemptEnd:
        """Feed every mini-batch and collect its loss; an error of the run is raised,
        a stage's death and a rebalance are returned. ``total``: the mini-batches of
        the whole fit, when known (the bar's length and time left)."""
        left = None if total is None else max(total - self.offset, 0)
        bar = TerminalProgress(progress).bar(
            total=left, unit="batch", desc=f"training run {self.run}"
        )
        self.started = started = time.perf_counter()
        trained = 0  # samples of the mini-batches whose loss came back

        def step_done(step: int, loss: float) -> None:
            nonlocal trained
            trained += self.step_samples.pop(step, 0)
            bar.update(1)
            elapsed = time.perf_counter() - started
            bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{trained / elapsed:.1f}")
            if on_step is not None:
                on_step(self.offset + step, loss)

        self._step_done = step_done
        session = self.session
        session.watch(
            self._check,
            self._take_loss,
            awaited="the losses of the next mini-batch",
            idle_timeout_s=self.timeouts.result_s,
            # nothing in flight (a replica drained the pipeline): no loss is due
            idle_ok=lambda: self.done_steps >= self.sent_steps,
        )
        session.spawn(self._feed(source), "feed")
        try:
            await session.race(self.finished.wait(), timeout_s=None)
        except StageFailedError as failure:
            if failure is not session.stage_failure:
                raise
            return AttemptEnd(stage_failure=failure)
        finally:
            bar.close()
        return AttemptEnd(rebalance_to=self.rebalance_to)

    async def _feed(self, source: BatchSource) -> None:
        async for batch in source.iterate():
            # room first, then the decision: it sees every loss and verdict so far
            for notice in await room_or_verdict(self):
                self.attempts.handle(notice)
            commands: list[Command] = self.attempts.handle(FeedAt(self.offset + self.sent_steps))
            while commands:
                (command,) = commands
                match command:
                    case RepartitionLook(step=step):
                        moved = await repartition_before(self, step)
                        looks = self.report.repartitions
                        commands = self.attempts.handle(
                            Looked(step, moved, predicted_period(looks), looked_epoch(looks))
                        )
                    case KeepReplica(step=step, global_copy=global_copy):
                        await self.pause_feed()  # asynchronous stages flush here (sync: no-op)
                        commands = await self._replicate(step, global_copy=global_copy)
                    case EndAttempt(rebalance_to=plan):
                        self.rebalance_to = plan
                        self.finished.set()  # this attempt ends here; the next one moves
                        return
                    case SendMiniBatch():
                        await self._send_minibatch(batch)
                        commands = []
                    case _:
                        raise AssertionError(f"not a command of the feed: {command!r}")
        await self.feed_ended()
        self.all_sent.set()
        if self.done_steps == self.sent_steps:
            self.finished.set()

    async def drain_losses(self, before: str) -> None:
        """Wait until every mini-batch sent has its loss back (each wait bounded by the
        result timeout); ``before`` names what waits, for the timeout's error."""
        timeout = self.timeouts.result_s
        while self.done_steps < self.sent_steps:
            self.step_finished.clear()
            try:
                await asyncio.wait_for(self.step_finished.wait(), timeout)
            except asyncio.TimeoutError:
                raise TransportTimeout(
                    self.session.last_stage, f"the losses before {before}", timeout
                ) from None

    async def _replicate(self, step: int, *, global_copy: bool = False) -> list[Command]:
        """Drain the pipeline and have the coordinator keep a replica of every stage
        before mini-batch ``step``; what the fit does next."""
        await self.drain_losses("a replica")
        reply = await self.session.control.ask(
            Replicate(
                run=self.run, step=self.done_steps, global_copy=True if global_copy else None
            ),
            expect=(Replicated,),
            # up to four phases at the coordinator, each within result_s (an
            # asynchronous run's prepare, backups, global copy and commit)
            timeout_s=4 * self.timeouts.result_s + self.timeouts.reply_s,
            awaited="the replica",
            resend_on_reconnect=True,
            progress_run=self.run,
        )
        if reply.error:
            # The previous replica still stands; a recovery replays a little more.
            log.warning("replica_not_kept", run=self.run, error=reply.error)
            return self.attempts.handle(ReplicaRefused(step))
        rebalance = None if reply.rebalance is None else TrainingPlan.from_dict(reply.rebalance)
        if rebalance is None:
            log.info("replica_kept", run=self.run, step=step, nbytes=reply.nbytes)
        kept = ReplicaKept(
            step,
            self.run,
            self.done_steps,
            global_copy=bool(reply.global_copy),
            rebalance=rebalance,
        )
        return self.attempts.handle(kept)

    async def _send_minibatch(self, batch: TrainBatch) -> None:
        parts = split_minibatch(batch, self.m)
        samples = int(batch[0].shape[0])
        await self.window.acquire()  # at most max_steps_in_flight mini-batches outstanding
        step = self.ledger.send()
        self.session.stall.sent(time.monotonic())
        self.report.samples += samples
        self.step_samples[step] = samples
        epoch = self.session.epoch
        for i, part in enumerate(parts):
            mb = step * self.m + i
            total = int(part[0].shape[0])
            labels = part[-1:]
            for (name, sock), (lo, hi) in zip(
                self.last_group, split_rows(total, self.last_shares), strict=True
            ):
                rows = tuple(t[lo:hi] for t in labels) if hi > lo else ()
                label_rows = Labels(
                    run=self.run, mb=mb, src=CLIENT_NAME, samples=samples, rows=[lo, hi],
                    total=total, epoch=epoch, tensors=rows,
                )  # fmt: skip
                await self._send(sock, label_rows, name)
            inputs = part[:-1]
            for (name, sock), (lo, hi) in zip(
                self.first_group, split_rows(total, self.first_shares), strict=True
            ):
                rows = tuple(t[lo:hi] for t in inputs) if hi > lo else ()
                check_fits_first_stage(rows, self.first_limits[name], name)
                data = Data(run=self.run, mb=mb, src=CLIENT_NAME, rows=[lo, hi], total=total,
                            epoch=epoch, tensors=rows)  # fmt: skip
                await self._send(sock, data, name)

    async def _send(self, sock: zmq.asyncio.Socket, message: WireMessage, peer: str) -> None:
        await send(sock, message.to_message(), timeout_s=self.timeouts.send_s, peer=peer)

    def _check(self, message: WireMessage) -> None:
        session = self.session
        if not isinstance(message, (Loss, MicroBatchError)):
            raise ProtocolError(f"{message.KIND!r} does not belong on a training sink")
        if message.epoch != session.epoch or message.run != self.run:
            raise ProtocolError(f"a message of epoch {message.epoch}, expected {session.epoch}")
        if message.src not in self.last_names:  # a failure notice too: it ends the run
            raise ProtocolError(f"{message.KIND!r} from {message.src!r}, not a last-stage device")
        if isinstance(message, Loss):
            self.ledger.check(message.step, message.mb, message.src)

    async def _take_loss(self, message: WireMessage) -> None:
        assert isinstance(message, Loss)  # _check let only losses through
        done = self.ledger.answer(message.step, message.mb, message.src, float(message.loss))
        for step, loss in done:
            self.report.losses.append(loss)
            self.session.stall.completed(time.monotonic())
            self.step_finished.set()
            self.window.release()
            try:
                self._step_done(step, loss)
            except Exception as exc:  # the caller's on_step: its error ends the run
                self.session.fail(exc)
                return
        if done:
            # what no recovery can ask for again leaves the replay buffer
            self.attempts.handle(Acknowledged(self.offset + self.done_steps, time.monotonic()))
        if done and self.all_sent.is_set() and self.done_steps == self.sent_steps:
            self.finished.set()

    async def gather_weights(self, *, optimizer: bool = False) -> None:
        """The trained weights (``optimizer``: and the optimizer's state) of every stage."""
        reply = await self.session.control.ask(
            WeightsRequest(
                run=self.run, step=self.done_steps, optimizer=True if optimizer else None
            ),
            expect=(Checkpoint, RunFailed),
            timeout_s=self.timeouts.result_s + self.timeouts.reply_s,
            awaited="the trained weights",
            resend_on_reconnect=True,
            progress_run=self.run,
        )
        if isinstance(reply, RunFailed):
            raise run_failed_error(reply.error, "gather the trained weights")
        assert isinstance(reply, Checkpoint)
        keys = [str(k) for k in reply.keys]
        if len(keys) != len(reply.tensors):
            raise ProtocolError("the checkpoint's keys and tensors do not match")
        state: dict[str, torch.Tensor] = {}
        for key, tensor in zip(keys, reply.tensors, strict=True):
            kept = state.get(key)
            if kept is None:
                # A copy: the received frame's memory belongs to a zmq message.
                state[key] = tensor.clone()
            elif not tensor.is_floating_point():
                # Counters such as BatchNorm's num_batches_tracked count the forwards each
                # replica ran (none for a share of 0): keep the largest.
                state[key] = torch.maximum(kept, tensor)
            elif not torch.equal(kept, tensor):
                # Every device of a data-parallel group must hold the same weights.
                raise PipelineError(f"the replicas of {key} differ after training")
        self.report.state_dict = state

    def close(self) -> None:
        for _, sock in [*self.first_group, *self.last_group]:
            sock.close(linger=0)
