"""Ring all-reduce for the devices of one data-parallel group, over zpipe's transport.

The devices that together serve one pipeline stage (Asteroid's hybrid pipeline
parallelism) average their gradients at the end of each round. Each rank binds one
PULL socket and connects one PUSH socket to the next rank, so the group is a ring::

    rank 0 --> rank 1 --> rank 2 --> rank 0        (n = 3)

The tensors are flattened into one buffer per dtype (a dtype's lone contiguous CPU
tensor is reduced where it lies, as gloo does) and each buffer is cut into n chunks.
In the n-1 *reduce-scatter* steps every rank sends one chunk to the next rank and adds
the chunk it receives from the previous one, so after them rank r holds the complete
sum of chunk r+1; in the n-1 *all-gather* steps those complete chunks travel once
around the ring and are copied. Step by step for rank 0 (the others are the same rotated)::

    step  phase           sends chunk  receives chunk  then
    0     reduce-scatter  0 (own)      2               adds: 2 = x0 + x2
    1     reduce-scatter  2            1               adds: 1 = x0 + x1 + x2  (complete)
    2     all-gather      1            0               copies the complete 0
    3     all-gather      0            2               copies the complete 2

Each rank sends 2(n-1)/n of the buffer, Asteroid's eq. (5), which
:func:`ring_allreduce_cost_s` turns into seconds for planners and benchmarks.

Every rank ends with bit-identical tensors: each chunk is summed exactly once, along
the ring in the same order, by the ranks that forward it (and divided by n once, by
the rank that completes it, for ``op="mean"``); the all-gather only copies.

Sends are zero-copy, so a send is only queued when it returns. The all-gather forwards
the received frames themselves, and every reduce-scatter segment a rank sent has come
back to it reduced before its call returns, so no queued message points into the
caller's tensors afterwards: a rank may zero its gradients the moment allreduce_
returns, while its peers are still receiving its last messages.

Chunks are streamed in segments of at most ``segment_bytes`` (one message each), so a
rank forwards the first segment of a chunk while the rest are still arriving, no
message grows with the model, and the event loop never adds more than one segment
at a time. Every rank runs at most ``window`` messages ahead of what it has received;
with the window below what a link can queue, the ring cannot deadlock (a full ring of
blocked senders would need more messages in flight than the windows allow).

The wire: one ``allreduce`` message per segment (see ``zpipe.transport.codec``), body
``{"round", "step", "chunk", "seg", "src"}`` and one 1-D tensor frame per dtype bucket
(in the order the dtypes first appear in the caller's tensor list); the header epoch
is the plan epoch of the group. A receiver knows exactly which message must come
next and checks every field, the tensors' dtypes and sizes, and, with CurveZMQ, the
sender's public key. A message of an older epoch or round (left over from an aborted
round) is dropped quietly; any other mismatch is a :class:`ProtocolError` naming the
peer, which is logged and dropped, and the rank keeps waiting for the right message
until the deadline. A peer that dies or stays silent turns into a
:class:`TransportTimeout` that names it and the step, within ``timeout_s`` of the
last message that made progress.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

import torch
import zmq.asyncio

from zpipe._errors import ConfigError
from zpipe.log import get_logger
from zpipe.stage.data_parallel.ring_links import RingCounters, RingLinks, RingPort
from zpipe.training.ring import (
    ALL_GATHER,
    OPS,
    AllReduceStats,
    ExpectedMessage,
    ScratchBuffers,
    SegmentLayout,
    check_ring_settings,
    flatten_into,
    group_by_dtype,
    ring_schedule,
    unflatten_from,
)
from zpipe.transport import security
from zpipe.transport.sockets import SocketOptions

__all__ = ["DEFAULT_SEGMENT_BYTES", "RingAllReduce"]

log = get_logger("zpipe.allreduce")

# Large enough that per-message Python costs (msgpack header, validation, loop passes:
# about 0.2 ms on the 2-core test machine) stay small next to moving the bytes; small
# enough that adding one segment blocks the event loop for about a millisecond.
# bench/allreduce.py measured 4 MiB ahead of 1 MiB against gloo on loopback.
DEFAULT_SEGMENT_BYTES = 4 << 20
# At most this many bytes (and half the send high-water mark in messages) a rank
# sends ahead of what it has received: bounds the memory queued on each link.
_WINDOW_BYTES = 16 << 20
# Buffers above this are flattened and copied back in a worker thread (torch releases
# the GIL there), so the event loop keeps answering heartbeats meanwhile.
_OFFLOAD_BYTES = 8 << 20


class RingAllReduce:
    """One rank of a ring all-reduce group (see the module notes for the protocol).

    ``endpoints[i]`` is where rank i listens (what the others connect to); this rank
    binds ``bind`` (default: ``endpoints[rank]``), or takes ``port``, its receive
    socket bound ahead (:class:`~zpipe.stage.data_parallel.ring_links.RingPort`: a
    stage binds port 0 when assigned and reports the port it got). ``segment_bytes``
    must be the same on every rank. With ``keypair``, every link uses CurveZMQ:
    ``peer_keys[i]`` is the Z85 public key of rank i, this rank accepts only the
    previous rank's key (added to the ring domain's allow-list of ``authenticator``
    when given, the one authenticator of ``context``; otherwise this object runs its
    own on ``context``) and checks it on every message.
    ``epoch`` is the plan epoch the group belongs to; build a new object for a new
    epoch or membership.

    ``timeout_s`` bounds every wait for one message or for room to send one; a
    rank also waits that long for the slowest peer to reach the all-reduce, so it must
    cover the spread of the ranks' backward passes.
    """

    def __init__(
        self,
        *,
        context: zmq.asyncio.Context,
        rank: int,
        endpoints: Sequence[str],
        bind: str | None = None,
        port: RingPort | None = None,
        socket_options: SocketOptions | None = None,
        keypair: security.KeyPair | None = None,
        peer_keys: Sequence[bytes] | None = None,
        authenticator: security.CurveAuthenticator | None = None,
        timeout_s: float,
        epoch: int = 0,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        name: str = "",
        pace: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        n = len(endpoints)
        self.options = socket_options or SocketOptions()
        check_ring_settings(
            world_size=n,
            rank=rank,
            timeout_s=timeout_s,
            epoch=epoch,
            segment_bytes=segment_bytes,
            max_message_bytes=self.options.max_message_bytes,
            secured=keypair is not None,
            peer_keys=None if peer_keys is None else len(peer_keys),
            authenticator=authenticator is not None,
        )
        self.context = context
        self.rank = rank
        self.world_size = n
        self.endpoints = list(endpoints)
        self.keypair = keypair
        self.timeout_s = float(timeout_s)
        self.epoch = epoch
        self.segment_bytes = segment_bytes
        self.name = name or "group"
        self.prev = (rank - 1) % n
        self.next = (rank + 1) % n
        # Messages a rank may run ahead of what it received; below what one link
        # queues (at least the send high-water mark), so the ring cannot deadlock.
        self.window = max(1, min(self.options.send_hwm // 2, _WINDOW_BYTES // segment_bytes))
        self._links = RingLinks(
            context=context,
            name=self.name,
            rank=rank,
            endpoints=self.endpoints,
            bind=bind if bind is not None else self.endpoints[rank],
            port=port,
            options=self.options,
            keypair=keypair,
            peer_keys=peer_keys,
            authenticator=authenticator,
            epoch=epoch,
            pace=pace,
        )
        self._scratch = ScratchBuffers()
        self._last_round = -1
        self._busy = False
        self._closed = False

    def peer_label(self, rank: int) -> str:
        """How errors and log lines name a peer: its rank and endpoint."""
        return self._links.peer_label(rank)

    @property
    def bound_endpoint(self) -> str:
        """Where this rank's receive socket is bound (once started)."""
        return self._links.bound_endpoint

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Bind this rank's receive socket and connect to the next rank.

        Nothing waits for the peers here: connecting is asynchronous in ZeroMQ and
        the first message of the first round waits (with its deadline) instead.
        """
        if self._closed:
            raise RuntimeError("this RingAllReduce was closed; build a new one")
        if self._links.open or self.world_size == 1:
            return
        self._links.start()
        log.debug(
            "allreduce_started",
            group=self.name,
            rank=self.rank,
            world_size=self.world_size,
            bound=self.bound_endpoint,
            next=self.endpoints[self.next],
            curve=self.keypair is not None,
        )

    async def close(self, *, linger_s: float = 1.0) -> None:
        """Close the sockets; safe to call twice.

        allreduce_ returns once its last messages are queued, not delivered, so the
        send socket lingers up to ``linger_s`` to deliver them (else the next rank would
        miss the end of the last round); ``context.term()`` waits for that.
        """
        self._closed = True
        self._scratch.clear()
        self._links.close(linger_s=linger_s)

    async def __aenter__(self) -> RingAllReduce:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ----------------------------------------------------------------- all-reduce

    async def allreduce_(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        op: str = "mean",
        round_id: int,
        timeout_s: float | None = None,
    ) -> AllReduceStats:
        """Reduce ``tensors`` in place across the group; every rank ends bit-identical.

        Every rank passes tensors of the same shapes and dtypes in the same order and
        the same ``round_id``, which must grow from call to call (it is how messages
        left over from an aborted round are told apart). Raises
        :class:`TransportTimeout` naming the peer and step when a peer is dead or
        silent for ``timeout_s``; the tensors then hold undefined partial results
        (the round must be redone).
        """
        if self._busy:
            raise RuntimeError("allreduce_ is already running on this rank; await it first")
        if op not in OPS:
            raise ConfigError(f"all-reduce op must be one of {', '.join(OPS)}, got {op!r}")
        if isinstance(round_id, bool) or not isinstance(round_id, int) or round_id < 0:
            raise ConfigError(f"round_id must be a non-negative int, got {round_id!r}")
        if round_id <= self._last_round:
            raise ConfigError(
                f"round_id {round_id} does not follow round {self._last_round}; "
                "round ids must grow so stale messages can be recognised"
            )
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        if not timeout > 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s}")
        members = group_by_dtype(tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self._last_round = round_id
        started = time.perf_counter()
        if self.world_size == 1 or not tensors:
            return AllReduceStats(round_id, self.world_size, nbytes, 0, 0, 0.0, 0, 0)
        if not self._links.open:
            raise RuntimeError("call start() before allreduce_()")
        self._busy = True
        try:
            flats, copied = self._scratch.flat_buffers(members)

            def copy_in() -> None:
                for i in copied:
                    flatten_into(members[i], flats[i])

            def copy_out() -> None:
                for i in copied:
                    unflatten_from(members[i], flats[i])

            copy_bytes = sum(flats[i].numel() * flats[i].element_size() for i in copied)
            await self._maybe_offload(copy_bytes, copy_in)
            round_stats = await self._run_ring(flats, op, round_id, timeout)
            await self._maybe_offload(copy_bytes, copy_out)
        finally:
            self._busy = False
        sent_bytes, messages, stale, rejected = round_stats
        return AllReduceStats(
            round_id,
            self.world_size,
            nbytes,
            sent_bytes,
            messages,
            time.perf_counter() - started,
            stale,
            rejected,
        )

    async def _maybe_offload(self, nbytes: int, work: Callable[[], None]) -> None:
        if nbytes == 0:
            return
        if nbytes < _OFFLOAD_BYTES:
            work()
            return
        await asyncio.get_running_loop().run_in_executor(None, work)

    async def _run_ring(
        self, flats: list[torch.Tensor], op: str, round_id: int, timeout: float
    ) -> tuple[int, int, int, int]:
        """Stream the schedule's segments around the ring; returns the counters.

        What libzmq may still read when this returns (zero-copy sends are only queued):
        every reduce-scatter segment this rank sent has come back to it reduced, so
        the next rank has received it already; the all-gather sends are the received
        frames themselves (the completed chunk is summed into the frame that brought
        its last part). So nothing queued points into ``flats``, and the caller may
        change them (or the scratch buffer be reused) at once.
        """
        n = self.world_size
        layout = SegmentLayout.build(
            [f.numel() for f in flats], [f.element_size() for f in flats], n, self.segment_bytes
        )
        k = layout.segments
        schedule = ring_schedule(self.rank, n)
        total = len(schedule) * k
        last_reduce_step = n - 2
        window = min(self.window, k)
        counters = RingCounters()
        # Received frames to forward in the all-gather, by outgoing message index.
        forward: dict[int, tuple[torch.Tensor, ...]] = {}

        def views(chunk: int, seg: int) -> tuple[torch.Tensor, ...]:
            out = []
            for flat, spans in zip(flats, layout.spans, strict=True):
                offset, size = spans[chunk][seg]
                out.append(flat[offset : offset + size])
            return tuple(out)

        async def send_next(out: int) -> None:
            step = schedule[out // k]
            seg = out % k
            tensors = views(step.send_chunk, seg) if out < k * (n - 1) else forward.pop(out)
            counters.bytes_sent += await self._links.send_segment(
                step, seg, tensors, round_id, timeout
            )

        sent = 0
        for index in range(total):
            # Outgoing message o of step t >= 1 carries what incoming message o - k
            # brought, so with window <= k everything up to index + window is ready.
            while sent < min(index + window, total):
                await send_next(sent)
                sent += 1
            step = schedule[index // k]
            seg = index % k
            targets = views(step.recv_chunk, seg)
            expected = ExpectedMessage(
                epoch=self.epoch,
                round_id=round_id,
                step=step.step,
                chunk=step.recv_chunk,
                seg=seg,
                src=self.prev,
                frames=tuple((t.dtype, t.numel()) for t in targets),
            )
            message = await self._links.receive(expected, step.phase, timeout, counters)
            received = message.tensors
            # The event loop reduces one segment at a time (segment_bytes bounds it).
            if step.phase == ALL_GATHER:
                for target, got in zip(targets, received, strict=True):
                    target.copy_(got)
                forward[index + k] = received
            elif step.step < last_reduce_step:
                for target, got in zip(targets, received, strict=True):
                    target.add_(got)
            else:
                # This rank completes the chunk: sum into the received frame (a + b is
                # b + a exactly in IEEE arithmetic), divide once, keep a copy and send
                # that frame on, so no queued message points into the caller's memory.
                for target, got in zip(targets, received, strict=True):
                    got.add_(target)
                    if op == "mean":
                        got.div_(n)
                    target.copy_(got)
                forward[index + k] = received
        while sent < total:
            await send_next(sent)
            sent += 1
        return counters.bytes_sent, total, counters.stale, counters.rejected
