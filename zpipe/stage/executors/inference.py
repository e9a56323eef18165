"""The inference loop of one assignment: receive -> compute (thread) -> send.

Three data tasks keep compute overlapped with the network::

    receive ──inbox(4)──> compute (thread) ──outbox(2)──> send (emulated link)

The bounded queues are the backpressure: a slow downstream fills the outbox,
which stalls compute, which fills the inbox, which stops receiving, which
fills the upstream's zmq queue. The event loop never computes, so it keeps
answering heartbeats while a layer runs for seconds.

When nothing waits in the outbox or in the send task, the link is not
emulated and both the send window and the downstream's queue have room, the
compute task queues its output itself, in the same loop pass (a send that
could wait still goes through the send task, with its deadline): a hand-off
between tasks costs more than a small message's send. Such an output with
another one right behind it (later in its group, or an input already waiting
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
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import torch
import zmq.asyncio

from zpipe._errors import ProtocolError, TransportTimeout
from zpipe.log import get_logger
from zpipe.protocol.data_plane import Data, Grad, Labels, MicroBatchError
from zpipe.stage.metrics import LinkMeter, StageCounters
from zpipe.stage.shard import Shard
from zpipe.transport.codec import Message, shares_received_frame
from zpipe.transport.emulation import EmulatedLink, LinkSpec
from zpipe.transport.sockets import send, send_nowait

log = get_logger("zpipe.stage")
# structlog runs its processors before the level filter: checked once per message instead
_std_log = logging.getLogger("zpipe.stage")

QUEUE_DEPTH = 2  # the outbox's
# Deeper than the outbox: inputs waiting here go to the compute thread together
# behind short forwards (below), one trip there and back for the group, and a
# trip costs both threads wake-ups and GIL hand-offs whatever the input's size
# (bench/stage_relay.py, 64 KiB: 469 -> 398 us of CPU per message with 4 instead
# of 2, 1 MiB: 1204 -> 1039; four alternating pairs, load 19-22). Costs two more
# decoded inputs held (zero-copy over their received frames).
INBOX_DEPTH = 4
# Forwards shorter than this (the last group's longest) take the inputs already
# waiting behind them along to the compute thread, at most MAX_GROUP at once: one
# hand-off each way for the group instead of one per micro-batch, where the
# hand-offs cost more than the compute; the first output then waits for the
# others' compute, at most (MAX_GROUP - 1) x GROUP_BELOW_S.
GROUP_BELOW_S = 0.002
MAX_GROUP = INBOX_DEPTH + 1
# ... and while the group's inputs hold less than this: a group of large outputs
# fills the link meter's window at once, and its waiter thread then wakes for each
# (1 MiB inputs, load 3: 884-972 -> 899-1209 us of CPU per message in groups of up
# to 5 against 2), so large inputs go two at a time as before.
GROUP_BELOW_BYTES = 2 << 20


def _settle(future: asyncio.Future[Any], outcome: Any, failed: bool) -> None:
    """On the loop: the compute thread's ``outcome`` into ``future`` (unless it was
    cancelled meanwhile)."""
    if future.done():
        return
    if failed:
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


class ComputedMicrobatch(NamedTuple):
    """A forward's outputs and when it ran. A tuple, not a frozen dataclass: one is
    built per micro-batch, and a frozen dataclass's ``__init__`` sets each field
    through ``object.__setattr__`` (bench/_relay_counts.py --opcodes)."""

    outputs: tuple[torch.Tensor, ...]
    started: float  # perf_counter, in the compute thread
    ended: float


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
        self._compute = compute
        self._counters = counters
        self._downstream = downstream
        self._downstream_name = downstream_name
        self._send_timeout_s = send_timeout_s
        self._inbox: asyncio.Queue[Data | MicroBatchError] = asyncio.Queue(INBOX_DEPTH)
        # (micro-batch, its encoded output): the timeline needs the number when it leaves
        self._outbox: asyncio.Queue[tuple[int, Message]] = asyncio.Queue(QUEUE_DEPTH)
        self._link = None if link.is_ideal else EmulatedLink(link, self._send_downstream)
        # how long the bytes take to leave, and a bound on what is on its way
        self._meter = LinkMeter(counters)
        self._sending = False  # the send task holds a message (later ones queue behind it)
        self._longest_forward_s = 0.0  # the last group's (set on the compute thread)

    async def deliver(self, message: Data | Grad | Labels | MicroBatchError) -> None:
        """A checked message of this assignment's epoch (waits while the inbox is full)."""
        # The data port's verdict admits only an inference route's classes; a gradient or
        # labels here would be a routing bug, refused like any other bad input.
        if not isinstance(message, Data | MicroBatchError):
            raise ProtocolError(f"an inference stage got {message.KIND!r}")
        await self._inbox.put(message)

    async def compute_loop(self) -> None:
        loop = asyncio.get_running_loop()
        counters = self._counters
        streaming = False  # idle time counts from the first input, not from the assignment
        grouping = False  # the last forwards were short: send waiting inputs along
        while True:
            waited_from = time.perf_counter()
            group = [await self._inbox.get()]
            if streaming:
                counters.idle_s += time.perf_counter() - waited_from
            streaming = True
            if grouping:
                nbytes = _input_bytes(group[0])
                while len(group) < MAX_GROUP and nbytes < GROUP_BELOW_BYTES:
                    if self._inbox.empty():
                        break
                    group.append(self._inbox.get_nowait())
                    nbytes += _input_bytes(group[-1])
            computing_from = time.perf_counter()
            # One trip to the compute thread and back for the whole group; messages
            # of kind "error" (someone upstream failed) pass the word on uncomputed.
            results = await self._computed(loop, group)
            counters.busy_s += time.perf_counter() - computing_from
            grouping = self._longest_forward_s < GROUP_BELOW_S
            last = len(group) - 1
            for i, (message, result) in enumerate(zip(group, results, strict=True)):
                out = self._output(message, result)
                if _std_log.isEnabledFor(logging.DEBUG):
                    log.debug("microbatch_done", stage=self.name, epoch=self.epoch,
                              mb=message.mb)  # fmt: skip
                # another output follows soon: this group's next, or the output of an
                # input already waiting when the forwards are short
                more_behind = i < last or (grouping and not self._inbox.empty())
                await self._hand_to_sender(message.mb, out.to_message(), more_behind)

    async def _computed(
        self, loop: asyncio.AbstractEventLoop, group: list[Data | MicroBatchError]
    ) -> list[ComputedMicrobatch | Exception | None]:
        """The group's results, computed on the compute thread, which hands them back
        itself: one call into the loop, where ``run_in_executor`` chains a concurrent
        future to an asyncio one through callbacks on both threads (measured: 65-85
        against 43-52 us of CPU per round trip on a loaded 2-core machine)."""
        future: asyncio.Future[list[ComputedMicrobatch | Exception | None]] = loop.create_future()
        job = self._compute.submit(self._forward_and_hand_back, loop, future, group)
        try:
            return await future
        except asyncio.CancelledError:
            job.cancel()  # not started yet: it never runs (as with run_in_executor)
            raise

    def _forward_and_hand_back(
        self,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[list[ComputedMicrobatch | Exception | None]],
        group: list[Data | MicroBatchError],
    ) -> None:
        """In the compute thread: compute ``group`` and settle ``future`` on its loop."""
        try:
            outcome: Any = self._forward_all(group)
            failed = False
        except BaseException as exc:  # _forward_all keeps each input's error; this is a bug
            outcome, failed = exc, True
        try:
            loop.call_soon_threadsafe(_settle, future, outcome, failed)
        except RuntimeError:  # the loop closed: nobody awaits the result any more
            pass

    def _forward_all(
        self, group: list[Data | MicroBatchError]
    ) -> list[ComputedMicrobatch | Exception | None]:
        """In the compute thread: each data message's outputs (or what it raised)."""
        results: list[ComputedMicrobatch | Exception | None] = []
        longest = 0.0
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
            ended = time.perf_counter()
            longest = max(longest, ended - started)
            results.append(ComputedMicrobatch(outputs, started, ended))
        # the group's longest forward, for the loop's next grouping decision: found
        # here, on the compute thread, not by another pass over the results on the
        # loop (read there after the results are handed back, which orders it)
        self._longest_forward_s = longest
        return results

    def _output(
        self, message: Data | MicroBatchError, result: ComputedMicrobatch | Exception | None
    ) -> Data | MicroBatchError:
        """What goes downstream for ``message``, given what computing it gave."""
        mb = message.mb
        counters = self._counters
        if isinstance(message, MicroBatchError):  # passed on, as from this stage
            return dataclasses.replace(message, src=self.name, epoch=self.epoch)
        if isinstance(result, ComputedMicrobatch):
            counters.timeline.record(mb, "compute", result.started, result.ended)
            counters.microbatches += 1
            return Data.of_microbatch(
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
        self._meter.close()
        if self._link is not None:
            await self._link.close()
            self._link = None
