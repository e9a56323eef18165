"""A stage's part of an EdgePipe (lossy) run: its super neuron's partial layers.

The coordinator's lossy run (:mod:`zpipe.coordinator.runs.lossy`) sends each
stage a ``lossy_setup`` (its device index, the run spec, its weight slices and,
for input and output owners, every mini-batch's inputs or labels, its peers'
data endpoints, names and keys) and then ``lossy_go``. The executor:

- stops whatever assignment ran and takes the stage's data socket for the run:
  ``lossy_partial`` messages from the run's peers only (their CURVE keys, the
  run id, the plan epoch and a shape check per partial; anything else is
  counted and dropped, and the loop goes on);
- runs its passes of the eq. 2 timeslot pipeline in order on a
  :class:`~zpipe.lossy.torch_partial.TorchDeviceShard`, the whole pass sequence
  in the stage's compute thread (:mod:`zpipe.stage.executors.lossy_passes`: waiting for a
  pass's partials with an explicit timeout, null-filling what has not come,
  sending each pass's partials to every device that needs them (every copy
  r-TX or ACK sends, each a message of its own), each send
  with a deadline); the event loop only receives partials and hands them over;
- answers ``lossy_ready`` and, at the end, ``lossy_result`` with its counters,
  its arrivals and its final weight slices (built by :mod:`zpipe.stage.executors.lossy_report`).

Its peers' data connections are :class:`zpipe.stage.executors.lossy_peers.LossyPeers`: keys
allowed at set-up, sockets connected at ``lossy_go``. Every message is parsed into
its protocol class once, where it comes in (the lifecycle's control messages, the
data port's frames), and dispatched by class.

Loss is emulated at the sender with :func:`zpipe.lossy.links.deliver`, keyed as
in the in-process simulation, so that a run on stages drops exactly the
messages its simulation drops. Under r-TX and ACK each copy is a message of its
own, and under ACK this stage answers each copy it receives with a ``lossy_ack``
from the event loop, on sockets of its own (:mod:`zpipe.stage.executors.lossy_recovery`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch
import zmq
import zmq.asyncio

from zpipe._errors import ProtocolError
from zpipe.log import get_logger
from zpipe.lossy.device_run import DeviceRun, build_run, build_switch, partial_shape
from zpipe.lossy.torch_partial import TorchDeviceShard
from zpipe.lossy.wire import to_array
from zpipe.protocol import REGISTRY, WireMessage
from zpipe.protocol.lossy import (
    LossyAck,
    LossyDead,
    LossyGo,
    LossyHold,
    LossyPartial,
    LossyProbe,
    LossyProbeEnd,
    LossyProbeRequest,
    LossyReady,
    LossyRemap,
    LossySetup,
)
from zpipe.stage.assignment import PushConnector
from zpipe.stage.executors.lossy_passes import PassLoop, ReplicaSink, SharedInbox
from zpipe.stage.executors.lossy_peers import LossyPeers
from zpipe.stage.executors.lossy_probes import LinkProbes, probe_links
from zpipe.stage.executors.lossy_recovery import AckSender
from zpipe.stage.executors.lossy_report import Slices, replica, run_result
from zpipe.stage.supervision import TaskSupervisor, describe_error, serve_messages
from zpipe.transport import security
from zpipe.transport.address_auth import AddressAllowList
from zpipe.transport.codec import Message, decode_typed
from zpipe.transport.sockets import ReceiveLimits, recv_frames

log = get_logger("zpipe.stage")

#: the control messages this module takes (the lifecycle hands them over)
LossyControlMessage = LossySetup | LossyGo | LossyDead | LossyRemap | LossyProbeRequest
#: their kinds
LOSSY_CONTROL_KINDS = frozenset(
    {"lossy_setup", "lossy_go", "lossy_dead", "lossy_remap", "lossy_probe_request"}
)
# The supervisor's names of a running assignment's data tasks: a later assignment
# (DataPlane.stop) stops a lossy run's tasks as it stops any other run's.
RECEIVE_TASK = "data-receive"
RUN_TASK = "compute"

SendControl = Callable[[Message], Awaitable[None]]
# How long a partial still queued when a run ends may take to reach its peer.
PEER_LINGER_S = 5.0


class LossyExecutor:
    """One stage's lossy runs, one at a time (see the module docstring)."""

    def __init__(
        self,
        *,
        name: str,
        data_in: Callable[[], zmq.asyncio.Socket],
        data_allow: security.PeerAllowList | None,
        data_addresses: AddressAllowList | None = None,
        connector: PushConnector,
        compute: ThreadPoolExecutor,
        supervisor: TaskSupervisor,
        send_control: SendControl,
        stop_data: Callable[[], Awaitable[None]],
        apply_limits: Callable[[ReceiveLimits], Awaitable[None]],
        max_message_bytes: int,
        send_timeout_s: float,
    ) -> None:
        self.name = name
        self._data_in = data_in
        self._peers = LossyPeers(connector, data_allow, data_addresses)
        self._compute = compute
        self._supervisor = supervisor
        self._send_control = send_control
        self._stop_data = stop_data
        self._apply_limits = apply_limits
        self._max_bytes = max_message_bytes
        self._send_timeout_s = send_timeout_s
        self.state: DeviceRun | None = None
        self.epoch = 0
        self.index = -1
        self.protocol_errors = 0
        # partials of another run or plan epoch, dropped since the latest set-up
        self.stale = 0
        self._inbox: SharedInbox | None = None
        self._probes: LinkProbes | None = None  # a link measurement, before a run
        # partials that came while a remap was undecided (zpipe.lossy.remap)
        self._held_partials: list[LossyPartial] = []
        # ACK runs: this stage's acknowledgements (the event loop's own sockets)
        self._acks: AckSender | None = None

    # ------------------------------------------------------------ control

    async def on_control(self, message: Message | LossyControlMessage) -> None:
        """A lossy run's control message from the coordinator (parsed here if the
        lifecycle hands it over untyped)."""
        control = REGISTRY.parse(message) if isinstance(message, Message) else message
        match control:
            case LossySetup():
                await self._setup(control)
            case LossyProbeRequest():
                await self._setup_probes(control)
            case LossyGo():
                self._go(control)
            case LossyDead():
                await self._peer_died(control)
            case LossyRemap():
                self._remap(control)
            case _:
                raise ProtocolError(f"{control.KIND!r} is not a lossy control message")

    def _go(self, go: LossyGo) -> None:
        probes = self._probes
        if probes is not None and probes.run == go.run and go.epoch == self.epoch:
            self._peers.connect(self._acks)
            self._supervisor.start(RUN_TASK, lambda: self._probe(probes))
            return
        st = self.state
        if st is None or st.run != go.run or go.epoch != self.epoch:
            raise ProtocolError(f"lossy_go for run {go.run}, which is not set up here")
        self._peers.connect(self._acks)
        self._supervisor.start(RUN_TASK, lambda: self._run(st, go))

    async def _peer_died(self, notice: LossyDead) -> None:
        """The coordinator declared a device of this run dead: its partials are
        null-filled from now on (EdgePipe's device malfunction case). When the run
        re-maps it, this stage also holds at the last mini-batch it started and says
        which (``lossy_hold``) until ``lossy_remap`` says where the allocation switches."""
        st, inbox = self.state, self._inbox
        if st is None or inbox is None or st.run != notice.run or notice.epoch != self.epoch:
            log.info("lossy_stale_notice", stage=self.name, run=notice.run, device=notice.device)
            return
        if notice.device == self.index or notice.device not in st.peers:
            raise ProtocolError(f"lossy_dead: device {notice.device} is not a peer of this run")
        if not notice.remap:
            inbox.mark_dead(notice.device)
            log.warning("lossy_peer_dead", stage=self.name, run=st.run, device=notice.device)
            return
        frontier = inbox.hold(notice.device)
        log.warning("lossy_peer_dead", stage=self.name, run=st.run, device=notice.device,
                    held_at=frontier)  # fmt: skip
        hold = LossyHold(run=st.run, device=self.index, frontier=frontier, epoch=notice.epoch)
        await self._send_control(hold.to_message())

    def _remap(self, msg: LossyRemap) -> None:
        """The coordinator's answer to the holds: switch allocation (or not), then file
        the partials kept while it was undecided."""
        st, inbox = self.state, self._inbox
        if st is None or inbox is None or st.run != msg.run or msg.epoch != self.epoch:
            log.info("lossy_stale_notice", stage=self.name, run=msg.run, kind="lossy_remap")
            return
        try:
            switch = build_switch(msg, st, self.index)
        except ProtocolError:
            inbox.decide(None)  # a bad remap must not leave the passes held forever
            raise
        finally:
            held, self._held_partials = self._held_partials, []
        inbox.decide(switch)
        log.info("lossy_remap", stage=self.name, run=st.run,
                 switch_at=None if switch is None else switch.first)  # fmt: skip
        for partial in held:
            try:
                self._on_data(partial)
            except ProtocolError as exc:
                self._dropped([], exc)

    async def _setup_probes(self, req: LossyProbeRequest) -> None:
        """A ``lossy_probe_request``: take probes on the data port, answer
        ``lossy_ready``; the probes go at ``lossy_go``
        (:mod:`zpipe.stage.executors.lossy_probes`)."""
        await self._reset()
        error = ""
        try:
            probes = LinkProbes.from_request(req)
            self._peers.allow(req.names, req.keys, probes.device, probes.peers)
        except ProtocolError as exc:
            self._peers.forget()
            self.protocol_errors += 1
            error = describe_error(exc)
            log.warning("lossy_probes_refused", stage=self.name, run=req.run, error=error)
        else:
            self._probes, self.epoch, self.index = probes, req.epoch, probes.device
            self._supervisor.start(RECEIVE_TASK, self._receive_loop)
        device = -1 if req.device is None else req.device
        ready = LossyReady(run=req.run, device=device, error=error, epoch=req.epoch)
        await self._send_control(ready.to_message())

    async def _probe(self, probes: LinkProbes) -> None:
        try:
            report = await probe_links(
                probes, self._peers.sockets, epoch=self.epoch, timeout_s=self._send_timeout_s
            )
        except Exception as exc:  # the coordinator hears it instead of waiting out its deadline
            log.exception("lossy_probes_failed", stage=self.name, run=probes.run)
            report = replace(probes.report(), error=describe_error(exc))
        self._peers.close(linger_s=min(self._send_timeout_s, PEER_LINGER_S))
        await self._send_control(replace(report, epoch=self.epoch).to_message())

    async def _reset(self) -> None:
        """Whatever ran on the data socket stops: a new run or measurement takes it."""
        await self._stop_data()
        await self._supervisor.stop([RECEIVE_TASK, RUN_TASK])
        self._peers.close()
        self._peers.forget()
        self.state = None
        self._inbox = None
        self._probes = None
        self._held_partials = []
        self.stale = 0
        if self._acks is not None:
            self._acks.close()
            self._acks = None

    async def _setup(self, setup: LossySetup) -> None:
        await self._reset()
        error = ""
        try:
            st = build_run(setup, setup.device, shard_factory=TorchDeviceShard)
            # An idle port takes 64 KiB messages, an assignment's those of its model: a
            # larger partial would cost its connection. Set before any peer connects.
            await self._raise_limits(st.spec.batch * max(st.spec.alloc.layer_sizes) * 8)
            self._peers.allow(setup.names, setup.keys, setup.device, st.peers)
        except Exception as exc:  # any failure to set up is reported: the stage keeps serving
            self._peers.forget()
            self.protocol_errors += 1
            error = describe_error(exc)
            log.warning("lossy_setup_refused", stage=self.name, run=setup.run, error=error)
        else:
            self.state, self.epoch, self.index = st, setup.epoch, setup.device
            self._inbox = SharedInbox(st)
            if st.spec.recovery.scheme == "ack":
                self._acks = AckSender(
                    run=st.run, index=setup.device, epoch=setup.epoch,
                    keyed_loss=st.channel.keyed_loss(), counts=self._inbox.wire,
                    timeout_s=self._send_timeout_s,
                )  # fmt: skip
            self._supervisor.start(RECEIVE_TASK, self._receive_loop)
            log.info("lossy_setup", stage=self.name, run=setup.run, device=setup.device,
                     layers=sorted(st.shard.slices))  # fmt: skip
        ready = LossyReady(run=setup.run, device=setup.device, error=error, epoch=setup.epoch)
        await self._send_control(ready.to_message())

    async def _raise_limits(self, largest: int) -> None:
        """Reopen the data port with room for a ``largest``-byte partial, only where its
        limit is smaller: reopening tears down the connections it has (libzmq
        crashed in its I/O thread re-binding one socket while peers sent, so the
        port is a fresh socket now: :mod:`zpipe.transport.reopen`)."""
        limit = self._data_in().getsockopt(zmq.MAXMSGSIZE)
        needed = ReceiveLimits.for_largest_message(min(largest, self._max_bytes))
        if 0 <= int(limit) < needed.max_message_bytes:
            await self._apply_limits(needed)

    async def close(self) -> None:
        await self._supervisor.stop([RECEIVE_TASK, RUN_TASK])
        self._peers.close()
        if self._acks is not None:
            self._acks.close()
            self._acks = None
        self.state = None

    # ------------------------------------------------------------ receiving

    async def _receive_loop(self) -> None:
        async def receive() -> list[zmq.Frame]:
            # cancelled when the run is replaced or the stage stops: no deadline needed
            return await recv_frames(
                self._data_in(), timeout_s=None, peer="lossy peers", awaited="a partial"
            )

        async def handle(frames: list[zmq.Frame]) -> None:
            self._peers.check_sender(frames[0])
            # parsed once, its body checked once: see _on_data
            partial = self._on_data(decode_typed(frames, max_message_bytes=self._max_bytes))
            if partial is not None and self._acks is not None:
                await self._acks.acknowledge(partial)

        await serve_messages(receive, handle, self._dropped)

    def _dropped(self, frames: list[zmq.Frame], exc: Exception) -> None:
        self.protocol_errors += 1
        log.warning(
            "dropped_message", stage=self.name, peer="lossy peer", error=describe_error(exc)
        )

    def _on_data(self, item: WireMessage) -> LossyPartial | None:
        """File a partial; returns it when it is this run's (a copy to acknowledge)."""
        match item:
            case LossyProbe() | LossyProbeEnd():
                self._on_probe(item)
                return None
            case LossyAck():
                self._on_ack(item)
                return None
            case LossyPartial():
                return self._file(item)
        raise ProtocolError(f"{item.KIND!r} does not belong on a lossy run's data port")

    def _file(self, msg: LossyPartial) -> LossyPartial | None:
        st = self.state
        if st is None or msg.run != st.run or msg.epoch != self.epoch:
            self.stale += 1  # a late one of an earlier run, or one for a run not set up here
            log.debug("lossy_stale_partial", stage=self.name, run=msg.run, epoch=msg.epoch)
            return None
        if msg.src not in st.peers or msg.src == self.index:
            raise ProtocolError(f"lossy_partial from device {msg.src}, not a peer of this run")
        assert self._inbox is not None  # set up with the state
        self._inbox.acks.heard_from(msg.src)  # alive: its acknowledgements are awaited again
        where = self._inbox.route(msg.data, msg.kind in ("TF", "TS"))
        if where == "hold":  # it may belong to an allocation not decided yet
            self._held_partials.append(msg)
            return msg
        switch = self._inbox.pending if where == "next" else None
        shape = partial_shape(st, self.index, msg.data, msg.kind, msg.layer, msg.src,
                              switch=switch)  # fmt: skip
        if len(msg.tensors) != 1:
            raise ProtocolError(f"lossy_partial: carries {len(msg.tensors)} tensors, not 1")
        what = f"lossy_partial {msg.kind}{msg.layer}:{msg.data} from device {msg.src}"
        values = to_array(msg.tensors[0], shape=shape, dtype=torch.float64, what=what)
        key = (msg.data, msg.kind, msg.layer)
        if not self._inbox.file(key, msg.src, values):  # its pass ran with zeros instead
            log.info("lossy_late_partial", stage=self.name, key=key, src=msg.src)
        return msg

    def _on_ack(self, ack: LossyAck) -> None:
        """An acknowledgement (ACK): one of a copy this stage did not send (another step,
        layer or peer, or heard already) is dropped and counted, not an error."""
        st, inbox = self.state, self._inbox
        if st is None or inbox is None or ack.run != st.run or ack.epoch != self.epoch:
            self.stale += 1
            return
        if not inbox.acks.arrived((ack.data, ack.kind, ack.layer, ack.src, ack.copy)):
            log.info("lossy_ack_dropped", stage=self.name, data=ack.data, kind=ack.kind,
                     layer=ack.layer, src=ack.src, copy=ack.copy)  # fmt: skip

    def _on_probe(self, probe: LossyProbe | LossyProbeEnd) -> None:
        probes = self._probes
        if probes is None or probe.run != probes.run or probe.epoch != self.epoch:
            self.stale += 1
            return
        if isinstance(probe, LossyProbe):
            probes.on_probe(probe)
        else:
            probes.on_end(probe)

    # ------------------------------------------------------------ the run

    async def _run(self, st: DeviceRun, go: LossyGo) -> None:
        started = time.perf_counter()
        delay = 0.0 if go.start_in_s is None else max(0.0, float(go.start_in_s))
        # Deadline mode counts timeslots from start_at on this stage's wall clock.
        st.start_at = time.time() + delay if go.start_in_s is not None else float(go.start_at)
        inbox = self._inbox
        assert inbox is not None and inbox.st is st
        # The pass loop owns the peers' sockets (their synchronous shadows) until it
        # returns: no socket is used from two threads.
        passes = PassLoop(
            st,
            inbox,
            index=self.index,
            epoch=self.epoch,
            peers={d: zmq.Socket.shadow(s.underlying) for d, s in self._peers.sockets.items()},
            send_timeout_s=self._send_timeout_s,
            stage=self.name,
            shard_factory=TorchDeviceShard,
            on_replica=self._replica_sink(st, asyncio.get_running_loop()),
        )
        error = ""
        log.info("lossy_started", stage=self.name, run=st.run, device=self.index)
        try:
            await asyncio.sleep(max(0.0, st.start_at - time.time()))
            running = asyncio.get_running_loop().run_in_executor(self._compute, passes.run)
            try:
                await asyncio.shield(running)
            except asyncio.CancelledError:
                # Replaced or stopping: the pass loop ends at its next wait or send,
                # and must have let go of the sockets before anyone closes them.
                inbox.stop()
                await asyncio.wait([running], timeout=PEER_LINGER_S)
                if running.done() and not running.cancelled():
                    running.exception()  # RunStopped, as asked: retrieved, not logged
                raise
        except Exception as exc:  # the coordinator hears it instead of waiting out its deadline
            log.exception("lossy_run_failed", stage=self.name, run=st.run)
            error = describe_error(exc)
        # Done sending: the peers' connections end now rather than at the next run's
        # set-up (a partial still queued gets PEER_LINGER_S to be delivered).
        self._peers.close(linger_s=min(self._send_timeout_s, PEER_LINGER_S))
        await self._send_result(st, error, time.perf_counter() - started)

    def _replica_sink(self, st: DeviceRun, loop: asyncio.AbstractEventLoop) -> ReplicaSink:
        """What the pass loop (compute thread) calls with a replica of the slices: the
        event loop sends it to the coordinator (``lossy_replica``)."""
        epoch = self.epoch

        def sink(step: int, slices: Slices) -> None:
            message = replica(st, slices, device=self.index, step=step, name=self.name,
                              epoch=epoch).to_message()  # fmt: skip

            async def send() -> None:
                try:
                    await self._send_control(message)
                except Exception as exc:  # a lost replica costs a remap only training
                    log.warning("lossy_replica_not_sent", stage=self.name, error=repr(exc))

            asyncio.run_coroutine_threadsafe(send(), loop)

        return sink

    async def _send_result(self, st: DeviceRun, error: str, wall_s: float) -> None:
        result = run_result(
            st, self._inbox, device=self.index, error=error, protocol_errors=self.protocol_errors,
            stale=self.stale, wall_s=wall_s, name=self.name, epoch=self.epoch,
        )  # fmt: skip
        await self._send_control(result.to_message())
