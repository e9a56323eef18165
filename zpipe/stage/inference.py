"""The inference loop of one assignment: receive -> compute (thread) -> send.

Three data tasks keep compute overlapped with the network::

    receive ──inbox(2)──> compute (thread) ──outbox(2)──> send (emulated link)

The bounded queues are the backpressure: a slow downstream fills the outbox,
which stalls compute, which fills the inbox, which stops receiving, which
fills the upstream's zmq queue. The event loop never computes, so it keeps
answering heartbeats while a layer runs for seconds.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import zmq.asyncio

from zpipe._errors import TransportTimeout
from zpipe.log import get_logger
from zpipe.stage.metrics import LinkMeter, StageCounters
from zpipe.stage.shard import Shard
from zpipe.transport.codec import Message
from zpipe.transport.emulation import EmulatedLink, LinkSpec
from zpipe.transport.sockets import send

log = get_logger("zpipe.stage")

QUEUE_DEPTH = 2


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
        self._inbox: asyncio.Queue[Message] = asyncio.Queue(QUEUE_DEPTH)
        self._outbox: asyncio.Queue[Message] = asyncio.Queue(QUEUE_DEPTH)
        self._link = None if link.is_ideal else EmulatedLink(link, self._send_downstream)
        # how long the bytes take to leave, and a bound on what is on its way
        self._meter = LinkMeter(counters)

    async def deliver(self, message: Message) -> None:
        """A checked message of this assignment's epoch (waits while the inbox is full)."""
        await self._inbox.put(message)

    async def compute_loop(self) -> None:
        loop = asyncio.get_running_loop()
        counters = self._counters
        streaming = False  # idle time counts from the first input, not from the assignment
        while True:
            waited_from = time.perf_counter()
            message = await self._inbox.get()
            if streaming:
                counters.idle_s += time.perf_counter() - waited_from
            streaming = True
            mb = int(message["mb"])
            if message.kind == "error":
                # Someone upstream failed on this micro-batch: pass the word on.
                out = Message("error", {**message.body, "src": self.name}, epoch=self.epoch)
            else:
                computing_from = time.perf_counter()
                try:
                    outputs, _ = await loop.run_in_executor(
                        self._compute, self._shard.forward, message.tensors
                    )
                    computed_at = time.perf_counter()
                    counters.busy_s += computed_at - computing_from
                    counters.timeline.record(mb, "compute", computing_from, computed_at)
                    counters.microbatches += 1
                    out = Message(
                        "data",
                        {"run": self.run, "mb": mb, "src": self.name},
                        epoch=self.epoch,
                        tensors=outputs,
                    )
                except Exception as exc:  # a bad input must not take the stage down
                    counters.busy_s += time.perf_counter() - computing_from
                    counters.errors += 1
                    log.warning(
                        "microbatch_failed",
                        stage=self.name,
                        epoch=self.epoch,
                        mb=mb,
                        error=str(exc),
                    )
                    out = Message(
                        "error",
                        {
                            "run": self.run,
                            "mb": mb,
                            "src": self.name,
                            "stage": self.name,
                            "message": f"{type(exc).__name__}: {exc}",
                        },
                        epoch=self.epoch,
                    )
            log.debug("microbatch_done", stage=self.name, epoch=self.epoch, mb=mb)
            blocked_from = time.perf_counter()
            await self._outbox.put(out)
            counters.blocked_s += time.perf_counter() - blocked_from

    async def send_loop(self) -> None:
        while True:
            message = await self._outbox.get()
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
                    mb=message["mb"],
                    error=str(exc),
                )
            sent_at = time.perf_counter()
            self._counters.send_s += sent_at - started
            self._counters.timeline.record(int(message["mb"]), "send", started, sent_at)

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
