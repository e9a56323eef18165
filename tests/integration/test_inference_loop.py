"""The inference loop of one assignment, in-process over real loopback sockets.

What it must keep whatever path a micro-batch takes (sent by the compute task
itself when there is room, or through the send task; computed alone or in a
group with the inputs waiting behind it): every output goes downstream once,
in the order the inputs came, with its compute recorded; a forward that raises
becomes an "error" message and the loop goes on; an upstream "error" is passed
on uncomputed; a downstream that stops reading holds the loop back (nothing is
dropped) and everything arrives once it reads again.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import zmq
import zmq.asyncio

from zpipe.protocol.data_plane import Data, MicroBatchError
from zpipe.stage.executors import inference
from zpipe.stage.executors.inference import InferenceLoop
from zpipe.stage.metrics import LinkMeter, StageCounters
from zpipe.stage.shard import Shard
from zpipe.transport.codec import Message, encode
from zpipe.transport.emulation import LinkSpec
from zpipe.transport.sockets import (
    SocketOptions,
    bind_endpoint,
    decode_frames,
    new_context,
    open_socket,
)

WAIT_S = 60.0


class DoublingShard(Shard):
    """Doubles its input; raises on an input whose first element is negative; can be
    held (the test releases it) to let inputs pile up; records each call's inputs."""

    def __init__(self) -> None:
        super().__init__([torch.nn.Identity()])
        self.calls: list[float] = []
        self.threads: set[str] = set()
        self.release = threading.Event()
        self.release.set()

    def forward(self, inputs: Sequence[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], float]:
        self.release.wait(WAIT_S)
        self.threads.add(threading.current_thread().name)
        first = float(inputs[0][0])
        self.calls.append(first)
        if first < 0:
            raise ValueError("negative input")
        return (inputs[0] * 2,), 0.0


@pytest.fixture
def context() -> Iterator[zmq.asyncio.Context]:
    ctx = new_context()
    yield ctx
    ctx.term()


def data(mb: int, value: float, size: int = 16) -> Data:
    return Data(run=1, mb=mb, src="up", epoch=3, tensors=(torch.full((size,), value),))


async def until(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` (state of the loop under test) until it holds, at most WAIT_S."""
    for _ in range(int(WAIT_S / 0.001)):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"still not the case after {WAIT_S} s")


async def _run(
    context: zmq.asyncio.Context,
    inputs: list[Data | MicroBatchError],
    *,
    options: SocketOptions,
    hold_downstream: bool = False,
    hold_compute: bool = False,
    written_out: bool = False,
) -> tuple[list[Message], DoublingShard, StageCounters]:
    # TCP, not inproc: over inproc a zero-copy message is released (its tracker
    # done, its place in the send window free) only when the receiver frees it
    sink = open_socket(context, zmq.PULL, options)
    endpoint = bind_endpoint(sink, "tcp://127.0.0.1:0")
    downstream = open_socket(context, zmq.PUSH, options)
    downstream.connect(endpoint)
    shard = DoublingShard()
    counters = StageCounters()
    compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute-test")
    loop = InferenceLoop(
        name="s1",
        run=1,
        epoch=3,
        shard=shard,
        compute=compute,
        counters=counters,
        downstream=downstream,
        downstream_name="s2",
        link=LinkSpec(),
        send_timeout_s=WAIT_S,
    )
    tasks = [asyncio.create_task(loop.compute_loop()), asyncio.create_task(loop.send_loop())]
    received: list[Message] = []
    try:
        if hold_compute:
            shard.release.clear()

        async def feed() -> None:
            for message in inputs:
                await asyncio.wait_for(loop.deliver(message), WAIT_S)

        feeding = asyncio.create_task(feed())
        if hold_compute:
            # the first input is in the compute thread, the next ones wait in the inbox
            await until(lambda: loop._inbox.qsize() == inference.INBOX_DEPTH)
            shard.release.set()
        if hold_downstream:
            # nobody reads: zmq's queue, the window, the outbox and the inbox fill up
            await until(lambda: loop._inbox.full() and loop._outbox.full())
            assert not feeding.done()
        for _ in inputs:
            frames = await asyncio.wait_for(sink.recv_multipart(copy=False), WAIT_S)
            received.append(decode_frames(frames, 1 << 30))
        await asyncio.wait_for(feeding, WAIT_S)
        if written_out:  # the link meter saw every sent message leave, the last one too
            await until(lambda: counters.link_delivered_bytes == counters.bytes_out)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await loop.close()
        compute.shutdown(wait=True)
        downstream.close(linger=0)
        sink.close(linger=0)
    return received, shard, counters


def test_every_output_goes_downstream_once_in_order(context: zmq.asyncio.Context) -> None:
    inputs = [data(mb, float(mb)) for mb in range(40)]
    received, shard, counters = asyncio.run(_run(context, inputs, options=SocketOptions()))
    assert [m.body["mb"] for m in received] == list(range(40))
    assert all(m.kind == "data" and m.body["src"] == "s1" and m.epoch == 3 for m in received)
    assert [float(m.tensors[0][0]) for m in received] == [2.0 * mb for mb in range(40)]
    assert counters.microbatches == 40 and counters.errors == 0
    assert shard.threads == {"compute-test_0"}  # never on the event loop's thread
    spans = counters.timeline.spans()
    assert sorted(s.mb for s in spans if s.phase == "compute") == list(range(40))
    assert sorted(s.mb for s in spans if s.phase == "send") == list(range(40))
    assert counters.bytes_out > 40 * 16 * 4


def test_large_outputs_are_each_counted_written_out_once_the_link_took_them(
    context: zmq.asyncio.Context,
) -> None:
    # 256 KiB outputs: shared with libzmq and tracked; anything that kept a sent frame
    # alive would hold its tracker open, and the stage would count it on its way
    inputs = [data(mb, float(mb), size=64 << 10) for mb in range(12)]
    received, _, counters = asyncio.run(
        _run(context, inputs, options=SocketOptions(), written_out=True)
    )
    assert [m.body["mb"] for m in received] == list(range(12))
    assert [float(m.tensors[0][-1]) for m in received] == [2.0 * mb for mb in range(12)]
    assert counters.link_delivered_bytes == counters.bytes_out > 12 * (256 << 10)


def test_an_output_with_another_behind_it_goes_copied_and_counts_with_the_tracked_one(
    context: zmq.asyncio.Context,
) -> None:
    # 64 KiB outputs, inputs piling up behind short forwards: an output with another
    # right behind it goes copied and untracked; every one is still counted written
    # out (the copied ones with the tracked one behind them), so a copied one never
    # ends the stream and the values that arrive are the ones computed
    inputs = [data(mb, float(mb), size=16 << 10) for mb in range(24)]
    sends: list[str] = []
    copied, track = LinkMeter.copied, LinkMeter.track

    def noting_copied(self: LinkMeter, nbytes: int) -> None:
        sends.append("copied")
        copied(self, nbytes)

    def noting_track(self: LinkMeter, tracker: zmq.MessageTracker, nbytes: int) -> None:
        sends.append("tracked")
        track(self, tracker, nbytes)

    with pytest.MonkeyPatch.context() as mp:
        # every forward counts as short, however loaded the machine: inputs go together
        mp.setattr(inference, "GROUP_BELOW_S", WAIT_S)
        mp.setattr(LinkMeter, "copied", noting_copied)
        mp.setattr(LinkMeter, "track", noting_track)
        received, _, counters = asyncio.run(
            _run(context, inputs, options=SocketOptions(), hold_compute=True, written_out=True)
        )
    assert [m.body["mb"] for m in received] == list(range(24))
    assert [float(m.tensors[0][-1]) for m in received] == [2.0 * mb for mb in range(24)]
    assert len(sends) == 24 and "copied" in sends
    assert sends[-1] == "tracked"
    assert counters.link_delivered_bytes == counters.bytes_out > 24 * (64 << 10)


def test_inputs_waiting_behind_a_short_forward_are_computed_in_one_trip(
    context: zmq.asyncio.Context,
) -> None:
    inputs = [data(mb, float(mb)) for mb in range(12)]
    trips: list[int] = []
    original = InferenceLoop._forward_all

    def counting(self: InferenceLoop, group: list[Data]) -> object:
        trips.append(len(group))
        return original(self, group)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(InferenceLoop, "_forward_all", counting)
        received, _, _ = asyncio.run(
            _run(context, inputs, options=SocketOptions(), hold_compute=True)
        )
    assert [m.body["mb"] for m in received] == list(range(12))
    assert sum(trips) == 12
    # the inputs held in the inbox (all of it: deeper than the outbox) went together
    assert max(trips) >= inference.INBOX_DEPTH > inference.QUEUE_DEPTH
    assert max(trips) <= inference.MAX_GROUP


def test_large_inputs_waiting_behind_a_short_forward_go_two_at_a_time(
    context: zmq.asyncio.Context,
) -> None:
    # 1 MiB inputs: a group stops once it holds GROUP_BELOW_BYTES (2 MiB), however
    # many wait in the inbox
    inputs = [data(mb, float(mb), size=1 << 18) for mb in range(8)]
    trips: list[int] = []
    original = InferenceLoop._forward_all

    def counting(self: InferenceLoop, group: list[Data]) -> object:
        trips.append(len(group))
        return original(self, group)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(inference, "GROUP_BELOW_S", WAIT_S)
        mp.setattr(InferenceLoop, "_forward_all", counting)
        received, _, _ = asyncio.run(
            _run(context, inputs, options=SocketOptions(), hold_compute=True)
        )
    assert [m.body["mb"] for m in received] == list(range(8))
    assert sum(trips) == 8
    assert max(trips) == inference.GROUP_BELOW_BYTES // (1 << 20) == 2


def test_a_failing_forward_becomes_an_error_and_upstream_errors_pass_on(
    context: zmq.asyncio.Context,
) -> None:
    upstream_error = MicroBatchError(run=1, mb=2, src="up", stage="s0", message="boom", epoch=3)
    inputs = [data(0, 1.0), data(1, -1.0), upstream_error, data(3, 3.0)]
    received, shard, counters = asyncio.run(_run(context, inputs, options=SocketOptions()))
    assert [(m.kind, m.body["mb"]) for m in received] == [
        ("data", 0),
        ("error", 1),
        ("error", 2),
        ("data", 3),
    ]
    assert "ValueError: negative input" in received[1].body["message"]
    assert received[2].body["message"] == "boom" and received[2].body["src"] == "s1"
    assert shard.calls == [1.0, -1.0, 3.0]  # the upstream error was not computed
    assert counters.errors == 1 and counters.microbatches == 2


def test_a_downstream_that_stops_reading_holds_the_loop_and_loses_nothing(
    context: zmq.asyncio.Context,
) -> None:
    # One-message queues: the compute task's own send finds no room at once, so
    # later outputs take the send task's path behind it, and order must hold.
    options = SocketOptions(send_hwm=1, recv_hwm=1)
    inputs = [data(mb, float(mb), size=1 << 16) for mb in range(30)]
    received, _, counters = asyncio.run(
        _run(context, inputs, options=options, hold_downstream=True)
    )
    assert [m.body["mb"] for m in received] == list(range(30))
    assert [float(m.tensors[0][0]) for m in received] == [2.0 * mb for mb in range(30)]
    assert counters.microbatches == 30


async def _cancelled_mid_compute(context: zmq.asyncio.Context) -> tuple[bool, list[str]]:
    """compute_loop cancelled while its group is on the compute thread, then the
    thread finishes: the late result is dropped on the loop without an error."""
    sink = open_socket(context, zmq.PULL, SocketOptions())
    downstream = open_socket(context, zmq.PUSH, SocketOptions())
    downstream.connect(bind_endpoint(sink, "tcp://127.0.0.1:0"))
    shard = DoublingShard()
    shard.release.clear()
    compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute-test")
    loop = InferenceLoop(
        name="s1", run=1, epoch=3, shard=shard, compute=compute, counters=StageCounters(),
        downstream=downstream, downstream_name="s2", link=LinkSpec(), send_timeout_s=WAIT_S,
    )  # fmt: skip
    errors: list[str] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, ctx: errors.append(str(ctx)))
    try:
        computing = asyncio.create_task(loop.compute_loop())
        await loop.deliver(data(0, 1.0))
        await until(lambda: loop._inbox.empty())  # taken: held in the compute thread
        computing.cancel()
        await asyncio.gather(computing, return_exceptions=True)
        shard.release.set()  # the thread ends its forward and hands back to the loop
        await asyncio.to_thread(compute.shutdown, wait=True)
        await asyncio.sleep(0.05)  # the hand-back, if any, runs on the loop now
        return computing.cancelled(), errors
    finally:
        await loop.close()
        downstream.close(linger=0)
        sink.close(linger=0)


def test_a_result_that_comes_back_after_the_loop_was_cancelled_is_dropped_quietly(
    context: zmq.asyncio.Context,
) -> None:
    cancelled, errors = asyncio.run(_cancelled_mid_compute(context))
    assert cancelled
    assert errors == []  # no "Future already cancelled" (InvalidStateError) on the loop


async def _sent_as(context: zmq.asyncio.Context, from_frame: bool) -> tuple[list[str], Message]:
    """How _send_now sends a 1 MiB output with another behind it, the tensor either
    decoded over a received frame (passed on unchanged) or a tensor of the stage's."""
    source = open_socket(context, zmq.PUSH, SocketOptions())
    inbox = open_socket(context, zmq.PULL, SocketOptions())
    source.connect(bind_endpoint(inbox, "tcp://127.0.0.1:0"))
    sink = open_socket(context, zmq.PULL, SocketOptions())
    downstream = open_socket(context, zmq.PUSH, SocketOptions())
    downstream.connect(bind_endpoint(sink, "tcp://127.0.0.1:0"))
    compute = ThreadPoolExecutor(max_workers=1)
    loop = InferenceLoop(
        name="s1", run=1, epoch=3, shard=Shard([torch.nn.Identity()]), compute=compute,
        counters=StageCounters(), downstream=downstream, downstream_name="s2",
        link=LinkSpec(), send_timeout_s=WAIT_S,
    )  # fmt: skip
    sends: list[str] = []
    try:
        tensor = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB
        if from_frame:
            sent = Data(run=1, mb=0, src="s0", epoch=3, tensors=(tensor,))
            await source.send_multipart(encode(sent.to_message()), copy=False)
            frames = await asyncio.wait_for(inbox.recv_multipart(copy=False), WAIT_S)
            tensor = decode_frames(frames, 1 << 30).tensors[0]
        out = Data(run=1, mb=0, src="s1", epoch=3, tensors=(tensor,)).to_message()
        meter = loop._meter
        copied, track = meter.copied, meter.track

        def noting_copied(nbytes: int) -> None:
            sends.append("untracked")
            copied(nbytes)

        def noting_track(tracker: zmq.MessageTracker, nbytes: int) -> None:
            sends.append("tracked")
            track(tracker, nbytes)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(meter, "copied", noting_copied)
            mp.setattr(meter, "track", noting_track)
            assert await loop._send_now(0, out, more_behind=True)
        frames = await asyncio.wait_for(sink.recv_multipart(copy=False), WAIT_S)
        return sends, decode_frames(frames, 1 << 30)
    finally:
        await loop.close()
        compute.shutdown(wait=True)
        for sock in (source, inbox, downstream, sink):
            sock.close(linger=0)


def test_a_large_tensor_passed_on_unchanged_may_go_untracked_as_its_received_frame(
    context: zmq.asyncio.Context,
) -> None:
    # 1 MiB: over what an untracked send copies, so a tensor of the stage's own is
    # shared with libzmq and tracked; one that is still the frame it came in goes
    # as that frame (no copy, nothing for pyzmq's collector to release), untracked
    sends, received = asyncio.run(_sent_as(context, from_frame=True))
    assert sends == ["untracked"]
    assert torch.equal(received.tensors[0], torch.arange(1 << 18, dtype=torch.float32))
    sends, received = asyncio.run(_sent_as(context, from_frame=False))
    assert sends == ["tracked"]
    assert torch.equal(received.tensors[0], torch.arange(1 << 18, dtype=torch.float32))
