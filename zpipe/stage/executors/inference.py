"""The inference loop of one assignment: receive -> compute (thread) -> send.

Three data tasks keep compute overlapped with the network::

    receive ──admitted(6)──> compute (thread) ──outbox(2)──> send (emulated link)

The bounds are the backpressure: a slow downstream fills the outbox, which
stalls the compute task's hand-off to the sender, which keeps inputs admitted,
which stops receiving, which fills the upstream's zmq queue. The event loop
never computes, so it keeps answering heartbeats while a layer runs for seconds.

Inputs go to the compute thread and their outputs come back in batches
(:class:`~zpipe.stage.executors.compute_batches.ComputeBatches`): the inputs a
loop pass received go over together, waking the thread only when it is idle,
the thread takes batch after batch without sleeping, and results come back with
one call into the loop per stretch the loop has not looked. Behind short
forwards a batch takes every input waiting (up to ``MAX_GROUP`` and
``GROUP_BELOW_BYTES``); behind long ones, one at a time, so each output leaves
as soon as it is computed.

When nothing waits in the outbox or in the send task, the link is not
emulated and both the send window and the downstream's queue have room, the
compute task queues its output itself, in the same loop pass (a send that
could wait still goes through the send task, with its deadline): a hand-off
between tasks costs more than a small message's send. Such an output with
another one right behind it (later in its batch, or an input already admitted
after short forwards) may go untracked, riding on the link meter's next tracked
message (:meth:`~zpipe.stage.metrics.LinkMeter.may_copy`): copied when it is small, or,
whatever its size, as the very frame it was received in when the shard passed
a tensor on unchanged (libzmq counts one more reference to its own message: no
copy, and no Python buffer for pyzmq's collector thread to release).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import zmq.asyncio

from zpipe._errors import ProtocolError, TransportTimeout
from zpipe.log import get_logger
from zpipe.protocol.data_plane import Data, Grad, Labels, MicroBatchError
from zpipe.stage.executors.compute_batches import ComputeBatches, Computed
from zpipe.stage.metrics import LinkMeter, StageCounters
from zpipe.stage.shard import Shard
from zpipe.transport.codec import Message, shares_received_frame
from zpipe.transport.emulation import EmulatedLink, LinkSpec
from zpipe.transport.sockets import send, send_nowait

log = get_logger("zpipe.stage")
# structlog runs its processors before the level filter: checked once per message instead
_std_log = logging.getLogger("zpipe.stage")

QUEUE_DEPTH = 2  # the outbox's
# Inputs held between the data port and the sender at once: waiting for the
# compute thread, computing, or computed and not yet handed to the sender (each
# decoded zero-copy over its received frames). The old inbox (4) plus a group of
# two large inputs: a full stage stops receiving, and the upstream's zmq queue
# holds the rest. Deeper than the outbox, so that inputs waiting behind short
# forwards go to the compute thread together: a trip there and back costs both
# threads wake-ups and GIL hand-offs whatever the input's size
# (bench/stage_relay.py, 64 KiB: 469 -> 398 us of CPU per message with an inbox
# of 4 instead of 2, four alternating pairs, load 19-22).
ADMITTED_MAX = 6
# Forwards shorter than this (the last batch's longest) take the inputs waiting
# behind them along, at most MAX_GROUP at once: one hand-off each way for the
# batch instead of one per micro-batch, where the hand-offs cost more than the
# compute; the first output then waits for the others' compute, at most
# (MAX_GROUP - 1) x GROUP_BELOW_S.
GROUP_BELOW_S = 0.002
MAX_GROUP = 5
# ... and while the batch's inputs hold less than this: a batch of large outputs
# fills the link meter's window at once, and its waiter thread then wakes for each
# (1 MiB inputs, load 3: 884-972 -> 899-1209 us of CPU per message in groups of up
# to 5 against 2), so large inputs go two at a time.
GROUP_BELOW_BYTES = 2 << 20


@dataclass(frozen=True)
class ComputedMicrobatch:
    outputs: tuple[torch.Tensor, ...]
    started: float  # perf_counter, in the compute thread
    ended: float


# what computing one input gave: its outputs, what its forward raised, or nothing (an
# upstream error passed on uncomputed)
MicroBatchResult = ComputedMicrobatch | Exception | None


def _copied_bytes(message: Message) -> int:
    """The tensor bytes an untracked send of ``message`` copies: all but those of
    tensors that go on as the frame they were received in."""
    return sum(t.nbytes for t in message.tensors if not shares_received_frame(t))


def _input_bytes(message: Data | MicroBatchError) -> int:
    return sum(t.nbytes for t in message.tensors) if isinstance(message, Data) else 0


class InferenceLoop:
    """Computes the micro-batches of one inference assignment and sends them on."""

    def __init__(
        self,
        *,
        name: str,
        run: int,
        epoch: int,
        shard: Shard,
        compute: ThreadPoolExecutor,
        counters: StageCounters,
        downstream: zmq.asyncio.Socket,
        downstream_name: str,
        link: LinkSpec,
        send_timeout_s: float,
    ) -> None:
        self.name = name
        self.run = run
        self.epoch = epoch
        self._shard = shard
        self._counters = counters
        self._downstream = downstream
        self._downstream_name = downstream_name
        self._send_timeout_s = send_timeout_s
        self._batches: ComputeBatches[Data | MicroBatchError, MicroBatchResult] = ComputeBatches(
            executor=compute, compute=self._forward_all, next_batch=self._next_batch
        )
        self._admission = asyncio.Semaphore(ADMITTED_MAX)
        self._admitted = 0  # inputs delivered whose outputs are not yet with the sender
        self._busy_from = 0.0  # when the last input came to a stage that held none
        self._short_forwards = False  # the compute thread's: its last batch's were short
        # (micro-batch, its encoded output): the timeline needs the number when it leaves
        self._outbox: asyncio.Queue[tuple[int, Message]] = asyncio.Queue(QUEUE_DEPTH)
        self._link = None if link.is_ideal else EmulatedLink(link, self._send_downstream)
        # how long the bytes take to leave, and a bound on what is on its way
        self._meter = LinkMeter(counters)
        self._sending = False  # the send task holds a message (later ones queue behind it)

    async def deliver(self, message: Data | Grad | Labels | MicroBatchError) -> None:
        """A checked message of this assignment's epoch (waits while ``ADMITTED_MAX``
        inputs are held). It goes to the compute thread at the end of this loop pass,
        with every other input the pass delivered."""
        # The data port's verdict admits only an inference route's classes; a gradient or
        # labels here would be a routing bug, refused like any other bad input.
        if not isinstance(message, Data | MicroBatchError):
            raise ProtocolError(f"an inference stage got {message.KIND!r}")
        await self._admission.acquire()
        if self._admitted == 0:
            self._busy_from = time.perf_counter()
        self._admitted += 1
        self._batches.put(message)

    async def compute_loop(self) -> None:
        """Hands each computed batch's outputs to the sender, in the inputs' order.

        The counters: ``busy_s`` is the forwards' time on the compute thread,
        ``idle_s`` this task's wait for outputs while no input is held (from the
        first input on), ``blocked_s`` its wait for room to hand an output on."""
        streaming = False  # idle time counts from the first input, not from the assignment
        while True:
            waited_from = time.perf_counter()
            held_none = self._admitted == 0
            computed = await self._batches.results()
            if streaming and held_none:  # until an input came, nothing was on its way
                self._counters.idle_s += max(self._busy_from - waited_from, 0.0)
            streaming = True
            for batch in computed:
                await self._hand_on(batch)

    async def _hand_on(self, batch: Computed[Data | MicroBatchError, MicroBatchResult]) -> None:
        if batch.failure is not None:  # _forward_all keeps each input's error: a bug
            raise batch.failure
        forwards = [r.ended - r.started for r in batch.results if isinstance(r, ComputedMicrobatch)]
        self._counters.busy_s += sum(forwards)
        short = max(forwards, default=0.0) < GROUP_BELOW_S
        last = len(batch.inputs) - 1
        for i, (message, result) in enumerate(zip(batch.inputs, batch.results, strict=True)):
            out = self._output(message, result)
            if _std_log.isEnabledFor(logging.DEBUG):
                log.debug("microbatch_done", stage=self.name, epoch=self.epoch, mb=message.mb)
            # another output follows soon: this batch's next, or the output of an input
            # already admitted when the forwards are short
            more_behind = i < last or (short and self._admitted > 1)
            await self._hand_to_sender(message.mb, out.to_message(), more_behind)
            self._admitted -= 1
            self._admission.release()

    def _next_batch(self, queued: deque[Data | MicroBatchError]) -> list[Data | MicroBatchError]:
        """In the compute thread: the inputs that go together (see ``GROUP_BELOW_S``)."""
        batch = [queued.popleft()]
        if self._short_forwards:
            nbytes = _input_bytes(batch[0])
            while queued and len(batch) < MAX_GROUP and nbytes < GROUP_BELOW_BYTES:
                batch.append(queued.popleft())
                nbytes += _input_bytes(batch[-1])
        return batch

    def _forward_all(self, group: list[Data | MicroBatchError]) -> list[MicroBatchResult]:
        """In the compute thread: each data message's outputs (or what it raised)."""
        results: list[MicroBatchResult] = []
        for message in group:
            if isinstance(message, MicroBatchError):
                results.append(None)
                continue
            started = time.perf_counter()
            try:
                outputs, _ = self._shard.forward(message.tensors)
            except Exception as exc:  # a bad input must not take the stage down
                results.append(exc)
                continue
            results.append(ComputedMicrobatch(outputs, started, time.perf_counter()))
        self._short_forwards = all(
            r.ended - r.started < GROUP_BELOW_S
            for r in results
            if isinstance(r, ComputedMicrobatch)
        )
        return results

    def _output(
        self, message: Data | MicroBatchError, result: MicroBatchResult
    ) -> Data | MicroBatchError:
        """What goes downstream for ``message``, given what computing it gave."""
        mb = message.mb
        counters = self._counters
        if isinstance(message, MicroBatchError):  # passed on, as from this stage
            return dataclasses.replace(message, src=self.name, epoch=self.epoch)
        if isinstance(result, ComputedMicrobatch):
            counters.timeline.record(mb, "compute", result.started, result.ended)
            counters.microbatches += 1
            return Data(
                run=self.run, mb=mb, src=self.name, epoch=self.epoch, tensors=result.outputs
            )
        assert result is not None  # only an error message is not computed
        counters.errors += 1
        log.warning("microbatch_failed", stage=self.name, epoch=self.epoch, mb=mb,
                    error=str(result))  # fmt: skip
        return MicroBatchError(
            run=self.run,
            mb=mb,
            src=self.name,
            stage=self.name,
            message=f"{type(result).__name__}: {result}",
            epoch=self.epoch,
        )

    async def _hand_to_sender(self, mb: int, out: Message, more_behind: bool = False) -> None:
        if await self._send_now(mb, out, more_behind):
            return
        blocked_from = time.perf_counter()
        await self._outbox.put((mb, out))
        self._counters.blocked_s += time.perf_counter() - blocked_from

    async def _send_now(self, mb: int, message: Message, more_behind: bool = False) -> bool:
        """Queue ``message`` downstream at once if nothing is ahead of it and there is
        room everywhere; False (nothing sent, the window place given back) otherwise.
        With ``more_behind`` (another message follows soon) it may go copied and
        untracked (see the module notes)."""
        meter = self._meter
        if self._link is not None or self._sending or not self._outbox.empty():
            return False
        if not meter.has_room():
            return False
        started = time.perf_counter()
        copy = more_behind and meter.may_copy(_copied_bytes(message), more_behind=True)
        await meter.room(timeout_s=self._send_timeout_s)  # at once: there is room
        try:
            if copy:
                nbytes = send_nowait(self._downstream, message)
            else:
                nbytes = send_nowait(self._downstream, message, on_queued=meter.track)
        except Exception:  # e.g. an output the codec refuses: the send task reports it
            nbytes = None
        if nbytes is None:
            meter.release()
            return False
        if copy:
            meter.copied(nbytes)
        self._counters.bytes_out += nbytes
        sent_at = time.perf_counter()
        self._counters.send_s += sent_at - started
        self._counters.timeline.record(mb, "send", started, sent_at)
        return True

    async def send_loop(self) -> None:
        while True:
            self._sending = False
            mb, message = await self._outbox.get()
            self._sending = True
            started = time.perf_counter()
            try:
                if self._link is not None:
                    nbytes = sum(t.numel() * t.element_size() for t in message.tensors)
                    delivered = await self._link.submit(message, nbytes)
                    if not delivered:
                        self._counters.lost += 1
                else:
                    await self._send_downstream(message)
            except TransportTimeout as exc:
                # The coordinator decides what a stuck downstream means; keep serving.
                log.error(
                    "send_failed",
                    stage=self.name,
                    epoch=self.epoch,
                    mb=mb,
                    error=str(exc),
                )
            sent_at = time.perf_counter()
            self._counters.send_s += sent_at - started
            self._counters.timeline.record(mb, "send", started, sent_at)

    async def _send_downstream(self, item: object) -> None:
        assert isinstance(item, Message)
        peer, timeout_s = self._downstream_name, self._send_timeout_s
        await self._meter.room(timeout_s=timeout_s)
        try:
            self._counters.bytes_out += await send(
                self._downstream, item, timeout_s=timeout_s, peer=peer, on_queued=self._meter.track
            )
        except BaseException:
            self._meter.release()  # not queued: its place in the window is free again
            raise

    async def close(self) -> None:
        self._batches.close()
        self._meter.close()
        if self._link is not None:
            await self._link.close()
            self._link = None
