"""bench/stage_relay.py's ``stage-sync`` relay: the ceiling of a synchronous data
plane (see that module's notes). The event loop only answers the feeder; one
thread receives, checks, computes, encodes and sends."""

from __future__ import annotations

import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
import zmq

from zpipe.stage.dataport import DataPort
from zpipe.stage.lifecycle import StageLifecycle
from zpipe.stage.metrics import StageCounters
from zpipe.stage.shard import Shard
from zpipe.transport.codec import encode
from zpipe.transport.sockets import new_context, open_socket

try:
    from bench._relay_parts import (
        EPOCH,
        LOOPBACK,
        OPTIONS,
        RUN,
        readable,
        running_lifecycle,
        timed,
        usage,
    )
except ImportError:  # run as a script: bench/ itself is sys.path[0]
    from _relay_parts import (  # type: ignore[no-redef]
        EPOCH,
        LOOPBACK,
        OPTIONS,
        RUN,
        readable,
        running_lifecycle,
        timed,
        usage,
    )

# stage-sync: how long the data thread's poll waits before it looks at its stop flag
SYNC_POLL_MS = 50
# stage-sync: one message in this many goes tracked (its tracker looked at, without
# waiting, before the next tracked send), as a stand-in for the link meter's
# delivery tracking; the others go copied and untracked, riding on it
SYNC_TRACK_EVERY = 4


async def stage_sync_relay(
    conn: Connection, steps: bool = False, track_every: int = SYNC_TRACK_EVERY
) -> None:
    """stage-sync: the event loop only answers the feeder (as a stage's loop would
    answer heartbeats and plans); one data thread receives, checks (the real
    :meth:`DataPort.accept`), computes (the real shard), encodes and sends, all
    synchronously on the shadows of the stage's own one-way sockets."""
    ctx = new_context()
    data_in = open_socket(ctx, zmq.PULL, OPTIONS)
    data_in.bind(LOOPBACK)
    conn.send(data_in.getsockopt_string(zmq.LAST_ENDPOINT))
    await readable(conn)
    downstream = open_socket(ctx, zmq.PUSH, OPTIONS)
    downstream.connect(conn.recv())
    counters = StageCounters()
    port = DataPort(
        socket=data_in,
        lifecycle=running_lifecycle(),
        counters=counters,
        name="relay",
        max_message_bytes=OPTIONS.max_message_bytes,
    )
    stop = threading.Event()
    thread = threading.Thread(
        target=_sync_data_thread,
        args=(
            data_in,
            downstream,
            port,
            Shard([torch.nn.Identity()]),
            counters,
            stop,
            steps,
            track_every,
        ),
        name="compute-sync",
        daemon=True,
    )
    thread.start()
    while True:
        await readable(conn)
        if conn.recv() == "stop":
            break
        conn.send(usage())
    stop.set()
    thread.join(timeout=10)
    data_in.close(linger=0)
    downstream.close(linger=0)
    ctx.term()


def _sync_data_thread(
    data_in: Any,
    downstream: Any,
    port: DataPort,
    shard: Shard,
    counters: StageCounters,
    stop: threading.Event,
    steps: bool = False,
    track_every: int = SYNC_TRACK_EVERY,
) -> None:
    """The synchronous data plane: receive -> check -> forward -> encode -> send.
    With ``steps``, this thread's CPU is split by step (``loop_us_<step>``)."""
    from zpipe.protocol import REGISTRY
    from zpipe.protocol.data_plane import Data
    from zpipe.stage.timeline import Timeline
    from zpipe.transport import codec
    from zpipe.transport.fd_wait import send_whole_nowait, take_queued
    from zpipe.transport.over_bounds import message_bounds_of
    from zpipe.transport.sockets import COPY_BELOW_BYTES, _outgoing

    encode_message = encode
    if steps:  # wrapped here: timed charges the thread that wraps
        codec.decode = timed("decode", codec.decode)
        REGISTRY.parse_checked = timed("parse", REGISTRY.parse_checked)  # type: ignore[method-assign]
        verdict = timed("verdict", StageLifecycle.data_verdict)
        StageLifecycle.data_verdict = verdict  # type: ignore[method-assign]
        Data.to_message = timed("to_message", Data.to_message)  # type: ignore[method-assign]
        Timeline.record = timed("timeline", Timeline.record)  # type: ignore[method-assign]
        encode_message = timed("encode", encode)
        take_queued = timed("zmq_recv", take_queued)
        send_whole_nowait = timed("zmq_queue", send_whole_nowait)
        _outgoing = timed("outgoing", _outgoing)
        shard.forward = timed("forward", shard.forward)  # type: ignore[method-assign]

    pull, push = data_in._shadow_sock, downstream._shadow_sock
    bounds = message_bounds_of(data_in)
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    writable = zmq.Poller()
    writable.register(push, zmq.POLLOUT)
    tracker: Any = None
    sent = 0
    while not stop.is_set():
        got = take_queued(pull, bounds)
        if got is None:
            poller.poll(SYNC_POLL_MS)  # a stop or a new epoch is seen within this
            continue
        if not isinstance(got, list):  # over its bounds: dropped, as a stage does
            counters.dropped += 1
            continue
        try:
            message = port.accept(got)
        except Exception:
            counters.dropped += 1
            continue
        if message is None or not isinstance(message, Data):
            continue
        started = time.perf_counter()
        outputs, _ = shard.forward(message.tensors)
        counters.timeline.record(message.mb, "compute", started, time.perf_counter())
        out = Data(run=RUN, mb=message.mb, src="relay", epoch=EPOCH, tensors=outputs)
        track = sent % track_every == 0
        if track and tracker is not None and tracker.done:
            counters.link_delivered_bytes += 1  # what the meter would count
        frames, copy, nbytes = _outgoing(
            encode_message(out.to_message()), track=track, copy_below=COPY_BELOW_BYTES
        )
        send_at = time.perf_counter()
        while True:
            try:
                queued = send_whole_nowait(push, frames, copy=copy, track=track)
                break
            except zmq.Again:
                if time.perf_counter() - send_at > 30.0:
                    raise TimeoutError("the sink took nothing for 30 s") from None
                writable.poll(SYNC_POLL_MS)
        if track:
            tracker = queued
        sent += 1
        counters.bytes_out += nbytes
        counters.timeline.record(message.mb, "send", send_at, time.perf_counter())
