"""One lossy edge device as a real process: ``python -m zpipe.lossy.device``.

A device process owns the slices of an allocation mapped to its index, runs
its passes of the timeslot pipeline in order (:func:`zpipe.lossy.schedule.events`)
on a :class:`~zpipe.lossy.shard.DeviceShard` (the class the in-process engine
runs) and exchanges partials with the other device processes over ZeroMQ
(``lossy_partial`` messages, :mod:`zpipe.lossy.wire`). A launcher
(:mod:`zpipe.lossy.multiprocess`) starts it, sends each run's setup, starts
the run and collects the result; the process serves run after run until told
to shut down, its launcher dies, or it has been idle too long.

Loss is decided at the sender: before putting a partial on the wire it asks
:func:`zpipe.lossy.links.deliver` with the same key the in-process engine
uses, and a message decided lost is never sent (TCP under ZeroMQ loses
nothing by itself). A receiver waits for each pass's partials until its
deadline, then null-fills what is missing and records which senders arrived.
Two ways to know when to stop waiting:

- ``deadline`` (the real protocol): wait for every sender until the end of
  the timeslot the partials were sent in (``start_at + timeslot * slot_s`` on
  the shared wall clock); a lost partial costs the rest of the timeslot.
- ``emulated`` (the default, an emulation shortcut): the receiver shares the
  seed and reception ratios, so it computes the same ``deliver`` decisions and
  stops as soon as every partial that can arrive has; ``wait_s`` bounds the
  wait all the same. Results are identical, without waiting out timeslots.

Every network await has a timeout; a malformed message is logged, counted
and dropped, and the process keeps serving.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence

import numpy as np
import torch
import zmq
import zmq.asyncio

from zpipe._errors import ProtocolError, TransportTimeout
from zpipe.log import LOG_FORMATS, LOG_LEVELS, configure_logging, get_logger
from zpipe.lossy.device_run import DeviceRun, build_run, partial_shape
from zpipe.lossy.engine import record_arrival
from zpipe.lossy.links import Direction, deliver
from zpipe.lossy.partial import FloatArray
from zpipe.lossy.schedule import PassEvent, events
from zpipe.lossy.shard import Needed, Outgoing
from zpipe.lossy.wire import (
    partial_message,
    peers_from_body,
    to_array,
    to_tensor,
)
from zpipe.protocol import Message
from zpipe.protocol.lossy import (
    LossyGo,
    LossyHello,
    LossyPartial,
    LossyProbe,
    LossyProbeEnd,
    LossyProbeReport,
    LossyProbeRequest,
    LossyReady,
    LossyResult,
    LossySetup,
)
from zpipe.transport.sockets import (
    SocketOptions,
    bind_endpoint,
    decode_frames,
    new_context,
    open_socket,
    recv_frames,
    send,
)

log = get_logger("zpipe.lossy.device")

# Partials are small and a pipeline keeps only a few mini-batches in flight, but
# a probe burst is 50 messages per link: room for all of it, so a send waits
# only on a peer that is really stuck.
SOCKET_OPTIONS = SocketOptions(send_hwm=4096, recv_hwm=4096)
CONTROL_KINDS = frozenset({"lossy_setup", "lossy_go", "lossy_probe_request", "shutdown"})
# How often an idle device checks that its launcher still lives.
_PARENT_CHECK_S = 1.0


class LossyDevice:
    """The device process's sockets, receive loop and pass runner."""

    def __init__(
        self,
        index: int,
        control: str,
        *,
        host: str = "127.0.0.1",
        parent_pid: int | None = None,
        idle_timeout_s: float = 600.0,
        send_timeout_s: float = 10.0,
    ) -> None:
        self.index = index
        self.control_endpoint = control
        self.host = host
        self.parent_pid = parent_pid
        self.idle_timeout_s = idle_timeout_s
        self.send_timeout_s = send_timeout_s
        self.protocol_errors = 0
        self.state: DeviceRun | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._control: zmq.asyncio.Socket | None = None
        self._peer_socks: dict[str, zmq.asyncio.Socket] = {}
        self._controls: asyncio.Queue[Message] = asyncio.Queue()
        self._arrived = asyncio.Event()
        # probes by measurement run: received per sender, and each sender's count
        self._probes: dict[int, dict[int, int]] = {}
        self._probe_ends: dict[int, dict[int, int]] = {}

    # -- lifetime ---------------------------------------------------------------

    async def serve(self) -> int:
        self._ctx = new_context()
        self._pull = open_socket(self._ctx, zmq.PULL, SOCKET_OPTIONS)
        endpoint = bind_endpoint(self._pull, f"tcp://{self.host}:0")
        self._control = open_socket(self._ctx, zmq.PUSH, SOCKET_OPTIONS)
        self._control.connect(self.control_endpoint)
        receiver = asyncio.create_task(self._receive_loop())
        try:
            await self._to_launcher(
                LossyHello(device=self.index, endpoint=endpoint, pid=os.getpid()).to_message()
            )
            while True:
                msg = await self._next_control()
                if msg is None or msg.kind == "shutdown":
                    break
                try:
                    await self._handle_control(msg)
                except ProtocolError as exc:
                    self._bad_message(exc)
            return 0
        finally:
            receiver.cancel()
            try:
                await receiver
            except asyncio.CancelledError:
                pass
            for sock in [self._pull, self._control, *self._peer_socks.values()]:
                sock.close(linger=0)
            self._ctx.term()

    async def _next_control(self) -> Message | None:
        """The launcher's next command; ``None`` once the launcher is gone or the
        device has idled past its timeout (so a crashed test leaves no orphan)."""
        idle_since = time.monotonic()
        while True:
            try:
                return await asyncio.wait_for(self._controls.get(), _PARENT_CHECK_S)
            except asyncio.TimeoutError:
                pass
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                log.warning("lossy_launcher_gone", device=self.index)
                return None
            if time.monotonic() - idle_since > self.idle_timeout_s:
                log.warning("lossy_idle_timeout", device=self.index, s=self.idle_timeout_s)
                return None

    async def _handle_control(self, msg: Message) -> None:
        if msg.kind == "lossy_setup":
            await self._setup(LossySetup.from_message(msg))
        elif msg.kind == "lossy_go":
            await self._run(LossyGo.from_message(msg))
        elif msg.kind == "lossy_probe_request":
            await self._probe(LossyProbeRequest.from_message(msg))

    # -- receiving --------------------------------------------------------------

    async def _receive_loop(self) -> None:
        assert self._pull is not None
        while True:
            # Cancelled on shutdown, so it may wait without a deadline.
            frames = await recv_frames(
                self._pull, timeout_s=None, peer="any peer", awaited="a message"
            )
            try:
                self._dispatch(decode_frames(frames, SOCKET_OPTIONS.max_message_bytes))
            except ProtocolError as exc:
                self._bad_message(exc)

    def _bad_message(self, exc: ProtocolError) -> None:
        self.protocol_errors += 1
        log.warning("lossy_bad_message", device=self.index, error=str(exc))

    def _dispatch(self, msg: Message) -> None:
        if msg.kind == "lossy_partial":
            self._on_partial(LossyPartial.from_message(msg))
        elif msg.kind == "lossy_probe":
            probe = LossyProbe.from_message(msg)
            by_src = self._probes.setdefault(probe.run, {})
            by_src[probe.src] = by_src.get(probe.src, 0) + 1
        elif msg.kind == "lossy_probe_end":
            end = LossyProbeEnd.from_message(msg)
            self._probe_ends.setdefault(end.run, {})[end.src] = end.sent
            self._arrived.set()
        elif msg.kind in CONTROL_KINDS:
            self._controls.put_nowait(msg)
        else:
            raise ProtocolError(f"a lossy device does not take {msg.kind!r} messages")

    def _on_partial(self, msg: LossyPartial) -> None:
        st = self.state
        if st is None or msg.run != st.run:
            log.debug("lossy_stale_partial", device=self.index, run=msg.run)
            return
        data, kind, layer, src = msg.data, msg.kind, msg.layer, msg.src
        shape = partial_shape(st, self.index, data, kind, layer, src)
        if len(msg.tensors) != 1:
            raise ProtocolError(f"lossy_partial: carries {len(msg.tensors)} tensors, not 1")
        what = f"lossy_partial {kind}{layer}:{data} from device {src}"
        values = to_array(msg.tensors[0], shape=shape, dtype=torch.float64, what=what)
        key = (data, kind, layer)
        if key in st.consumed:
            # It missed its deadline: the pass has run with zeros in its place.
            st.late += 1
            log.info("lossy_late_partial", device=self.index, key=key, src=src)
            return
        st.inbox.setdefault(key, {}).setdefault(src, values)
        self._arrived.set()

    # -- a run ------------------------------------------------------------------

    async def _setup(self, msg: LossySetup) -> None:
        error = ""
        run = msg.run
        try:
            self.state = build_run(msg, self.index)
            for endpoint in self.state.peers.values():
                self._peer(endpoint)
        except ProtocolError as exc:
            self._bad_message(exc)
            self.state = None
            error = str(exc)
        await self._to_launcher(LossyReady(run=run, device=self.index, error=error).to_message())

    async def _run(self, msg: LossyGo) -> None:
        st = self.state
        if st is None or st.run != msg.run:
            raise ProtocolError(f"lossy_go for run {msg.run}, which is not set up here")
        st.start_at = float(msg.start_at)
        started = time.perf_counter()
        error = ""
        try:
            # Deadline mode counts timeslots from start_at on the shared clock.
            await asyncio.sleep(max(0.0, st.start_at - time.time()))
            for ev in events(st.spec.alloc, st.spec.n_data):
                if ev.layer in st.shard.slices:
                    await self._pass(st, ev)
        except Exception as exc:
            # Whatever went wrong, the launcher hears it from the result instead
            # of waiting out its deadline for a device that is still alive.
            log.exception("lossy_run_failed", device=self.index, run=st.run)
            error = f"{type(exc).__name__}: {exc}"
        await self._send_result(st, error, time.perf_counter() - started)

    async def _pass(self, st: DeviceRun, ev: PassEvent) -> None:
        needed = st.topo.needed(ev.kind, ev.layer)
        got: dict[int, FloatArray] = {}
        if needed is not None:
            got = await self._collect(st, ev, needed)
            record_arrival(st.propagation, st.arrivals, ev.data, self.index, needed, got)
        outgoing: list[Outgoing]
        # Compute runs off the event loop, so partials keep arriving meanwhile.
        if ev.kind == "F":
            x = st.inputs[ev.data - 1] if st.inputs is not None and ev.layer == 0 else None
            outgoing = await asyncio.to_thread(
                st.shard.forward, ev.data, ev.layer, st.spec.batch, got, x=x
            )
        else:
            # Only the output layer reads the labels; other layers only their count.
            labels = (
                st.labels[ev.data - 1]
                if st.labels is not None and ev.layer == st.topo.last
                else np.zeros(st.spec.batch, dtype=np.int64)
            )
            outgoing, loss = await asyncio.to_thread(
                st.shard.backward, ev.data, ev.layer, labels, got
            )
            if loss is not None:
                st.losses.append([ev.data, loss])
        await self._post(st, ev.data, outgoing)

    async def _collect(self, st: DeviceRun, ev: PassEvent, needed: Needed) -> dict[int, FloatArray]:
        """The partials of one pass: wait until all that can come have, or the deadline."""
        key = (ev.data, needed.kind, needed.key_layer)
        senders = [src for src, _ in needed.senders]
        if st.spec.mode == "emulated":
            expect = {
                src
                for src in senders
                if st.channel.would_deliver(
                    src, self.index, needed.layer, ev.data, needed.direction
                )
            }
            clock = time.monotonic
            deadline = clock() + st.spec.wait_s
        else:
            expect = set(senders)
            clock = time.time
            # the end of the timeslot the partials were sent in
            deadline = st.start_at + ev.timeslot * st.spec.slot_s
        while not expect <= st.inbox.get(key, {}).keys():
            remaining = deadline - clock()
            if remaining <= 0:
                break
            # No await between the check above and clear(): no wake-up is lost.
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except asyncio.TimeoutError:
                break
        proceeded = clock()
        st.consumed.add(key)
        got = st.inbox.pop(key, {})
        missing = len(senders) - sum(1 for src in senders if src in got)
        if missing:
            st.waits.append([ev.data, needed.kind, needed.key_layer, missing, deadline, proceeded])
        if st.spec.mode == "emulated" and not expect <= got.keys():
            log.warning(
                "lossy_partial_overdue",
                device=self.index,
                key=key,
                missing=sorted(expect - got.keys()),
                wait_s=st.spec.wait_s,
            )
        return got

    async def _post(self, st: DeviceRun, data: int, outgoing: Sequence[Outgoing]) -> None:
        for out in outgoing:
            if out.dst == self.index:  # no link to cross
                st.inbox.setdefault((data, out.kind, out.key_layer), {})[self.index] = out.values
                continue
            if not st.channel.send(self.index, out.dst, out.layer, data, out.direction):
                continue  # decided lost: it never reaches the wire
            await send(
                self._peer(st.peers[out.dst]),
                partial_message(st.run, data, out.kind, out.key_layer, self.index, out.values),
                timeout_s=self.send_timeout_s,
                peer=f"device {out.dst}",
            )

    async def _send_result(self, st: DeviceRun, error: str, wall_s: float) -> None:
        layers = sorted(st.shard.weights)
        tensors = []
        for layer in layers:
            w, b = st.shard.weights[layer]
            tensors += [to_tensor(w), to_tensor(b)]
        prop = st.propagation
        result = LossyResult(
            run=st.run,
            device=self.index,
            error=error,
            layers=layers,
            losses=st.losses,
            propagation={
                "expected": dict(prop.expected),
                "received": dict(prop.received),
                "assemblies": dict(prop.assemblies),
                "complete": dict(prop.complete),
            },
            traffic={k: v.as_dict() for k, v in st.channel.traffic.items()},
            arrivals=[
                [data, kind, layer, list(senders)]
                for (data, kind, layer, _), senders in sorted(st.arrivals.items())
            ],
            waits=st.waits,
            late=st.late,
            protocol_errors=self.protocol_errors,
            wall_s=wall_s,
            tensors=tuple(tensors),
        )
        await self._to_launcher(result.to_message())

    # -- link measurement -------------------------------------------------------

    async def _probe(self, msg: LossyProbeRequest) -> None:
        """Send ``count`` probes over each of my links (each decided by the link's
        reception ratio, as partials are), then report what reached me."""
        run, count, seed = msg.run, msg.count, msg.seed
        peers = peers_from_body(msg.peers, "lossy_probe_request")
        try:
            prr = np.asarray(msg.prr, dtype=np.float64)
        except (TypeError, ValueError):  # ragged or not numbers
            raise ProtocolError("lossy_probe_request: bad reception ratios") from None
        n = len(prr)
        if prr.shape != (n, n) or n <= max(peers, default=0) or count < 1:
            raise ProtocolError("lossy_probe_request: bad reception ratios or count")
        others = sorted(d for d in peers if d != self.index)
        for dst in others:
            sock = self._peer(peers[dst])
            for seq in range(count):
                fate = deliver(
                    seed, self.index, dst, 0, seq, Direction.PROBE, prr=prr[self.index, dst]
                )
                if fate.delivered:
                    await send(
                        sock,
                        LossyProbe(run=run, src=self.index, seq=seq).to_message(),
                        timeout_s=self.send_timeout_s,
                        peer=f"device {dst}",
                    )
            # TCP keeps a link's order: when this arrives, every probe sent has.
            await send(
                sock,
                LossyProbeEnd(run=run, src=self.index, sent=count).to_message(),
                timeout_s=self.send_timeout_s,
                peer=f"device {dst}",
            )
        deadline = time.monotonic() + float(msg.timeout_s)
        ends = self._probe_ends.setdefault(run, {})
        while not set(others) <= ends.keys():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except asyncio.TimeoutError:
                break
        missing = sorted(set(others) - ends.keys())
        received = self._probes.pop(run, {})
        self._probe_ends.pop(run, None)
        report = LossyProbeReport(
            run=run,
            device=self.index,
            received={str(src): received.get(src, 0) for src in others},
            sent={str(src): ends[src] for src in others if src in ends},
            error=f"no probes finished from devices {missing}" if missing else "",
        )
        await self._to_launcher(report.to_message())

    # -- sockets ----------------------------------------------------------------

    def _peer(self, endpoint: str) -> zmq.asyncio.Socket:
        sock = self._peer_socks.get(endpoint)
        if sock is None:
            assert self._ctx is not None
            sock = open_socket(self._ctx, zmq.PUSH, SOCKET_OPTIONS)
            sock.connect(endpoint)
            self._peer_socks[endpoint] = sock
        return sock

    async def _to_launcher(self, msg: Message) -> None:
        assert self._control is not None
        try:
            await send(self._control, msg, timeout_s=self.send_timeout_s, peer="launcher")
        except TransportTimeout as exc:
            log.warning("lossy_launcher_unreachable", device=self.index, error=str(exc))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m zpipe.lossy.device",
        description="One lossy edge device; serves the runs its launcher sends.",
    )
    p.add_argument("--index", type=int, required=True, help="this device's index")
    p.add_argument("--control", required=True, help="the launcher's endpoint, tcp://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1", help="address to bind the data socket on")
    p.add_argument("--parent-pid", type=int, help="exit when this process is no longer the parent")
    p.add_argument("--idle-timeout-s", type=float, default=600.0, help="exit after this idle time")
    p.add_argument("--send-timeout-s", type=float, default=10.0, help="deadline of every send")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="warning")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="console")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(log_format=args.log_format, level=args.log_level, device=args.index)
    device = LossyDevice(
        args.index,
        args.control,
        host=args.host,
        parent_pid=args.parent_pid,
        idle_timeout_s=args.idle_timeout_s,
        send_timeout_s=args.send_timeout_s,
    )
    try:
        return asyncio.run(device.serve())
    except KeyboardInterrupt:
        return 130


def exit_now(code: int) -> None:
    """End the process without the interpreter's teardown: a device has closed its
    sockets by now, and unloading torch takes seconds on a loaded machine, enough for
    the launcher's bounded wait to give up and kill it (with a warning) after a
    clean run. multiprocessing ends its workers the same way."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
