"""A stage's part of an EdgePipe (lossy) run: its super neuron's partial layers.

The coordinator's lossy run (:mod:`zpipe.coordinator.lossy_run`) sends each
stage a ``lossy_setup`` (its device index, the run spec, its weight slices and,
for input and output owners, every mini-batch's inputs or labels, its peers'
data endpoints, names and keys) and then ``lossy_go``. The executor:

- stops whatever assignment ran and takes the stage's data socket for the run:
  ``lossy_partial`` messages from the run's peers only (their CURVE keys, the
  run id, the plan epoch and a shape check per partial; anything else is
  counted and dropped, and the loop goes on);
- runs its passes of the eq. 2 timeslot pipeline in order on a
  :class:`~zpipe.lossy.torch_partial.TorchDeviceShard`, the whole pass sequence
  in the stage's compute thread (:mod:`zpipe.stage.lossy_passes`: waiting for a
  pass's partials with an explicit timeout, null-filling what has not come,
  sending each pass's partials to every device that needs them (every copy
  r-TX or ACK sends, each a message of its own), each send
  with a deadline); the event loop only receives partials and hands them over;
- answers ``lossy_ready`` and, at the end, ``lossy_result`` with its counters,
  its arrivals and its final weight slices.

Loss is emulated at the sender with :func:`zpipe.lossy.links.deliver`, keyed as
in the in-process simulation, so that a run on stages drops exactly the
messages its simulation drops. Under r-TX and ACK each copy is a message of its
own, and under ACK this stage answers each copy it receives with a ``lossy_ack``
from the event loop, on sockets of its own (:mod:`zpipe.stage.lossy_recovery`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch
import zmq
import zmq.asyncio

from zpipe._errors import ProtocolError
from zpipe.log import get_logger
from zpipe.lossy.device_run import DeviceRun, build_run, build_switch, partial_shape
from zpipe.lossy.partial import FloatArray
from zpipe.lossy.partition import NeuronSlice
from zpipe.lossy.torch_partial import TorchDeviceShard
from zpipe.lossy.wire import to_array, to_tensor
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
    LossyReplica,
    LossyResult,
    LossySetup,
)
from zpipe.stage.assignment import PushConnector
from zpipe.stage.lossy_passes import PassLoop, ReplicaSink, SharedInbox
from zpipe.stage.lossy_probes import LinkProbes, probe_links
from zpipe.stage.lossy_recovery import AckSender
from zpipe.stage.supervision import TaskSupervisor, describe_error, serve_messages
from zpipe.transport import security
from zpipe.transport.codec import Message
from zpipe.transport.sockets import ReceiveLimits, decode_frames, recv_frames

log = get_logger("zpipe.stage")

#: the control kinds this module takes (the lifecycle hands them over)
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
        self._data_allow = data_allow
        self._connect = connector
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
        self._peers: dict[int, zmq.asyncio.Socket] = {}
        # by device: (data endpoint, CURVE key, name) of the set-up run's peers
        self._pending_peers: dict[int, tuple[str, str | None, str]] = {}
        self._inbox: SharedInbox | None = None
        self._probes: LinkProbes | None = None  # a link measurement, before a run
        # partials that came while a remap was undecided (zpipe.lossy.remap)
        self._held_partials: list[Message] = []
        # ACK runs: this stage's acknowledgements (the event loop's own sockets)
        self._acks: AckSender | None = None

    # ------------------------------------------------------------ control

    async def on_control(self, message: Message) -> None:
        """A lossy run's control message from the coordinator."""
        if message.kind == "lossy_setup":
            await self._setup(message)
        elif message.kind == "lossy_probe_request":
            await self._setup_probes(message)
        elif message.kind == "lossy_go":
            go = LossyGo.from_message(message)
            probes = self._probes
            if probes is not None and probes.run == go.run and message.epoch == self.epoch:
                self._connect_peers()
                self._supervisor.start(RUN_TASK, lambda: self._probe(probes))
                return
            st = self.state
            if st is None or st.run != go.run or message.epoch != self.epoch:
                raise ProtocolError(f"lossy_go for run {go.run}, which is not set up here")
            self._connect_peers()
            self._supervisor.start(RUN_TASK, lambda: self._run(st, go))
        elif message.kind == "lossy_dead":
            await self._peer_died(LossyDead.from_message(message), message.epoch)
        elif message.kind == "lossy_remap":
            self._remap(LossyRemap.from_message(message), message.epoch)
        else:
            raise ProtocolError(f"{message.kind!r} is not a lossy control message")

    async def _peer_died(self, notice: LossyDead, epoch: int) -> None:
        """The coordinator declared a device of this run dead: its partials are
        null-filled from now on (EdgePipe's device malfunction case). When the run
        re-maps it, this stage also holds at the last mini-batch it started and says
        which (``lossy_hold``) until ``lossy_remap`` says where the allocation switches."""
        st, inbox = self.state, self._inbox
        if st is None or inbox is None or st.run != notice.run or epoch != self.epoch:
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
        hold = LossyHold(run=st.run, device=self.index, frontier=frontier).to_message()
        await self._send_control(Message(hold.kind, hold.body, epoch=epoch))

    def _remap(self, msg: LossyRemap, epoch: int) -> None:
        """The coordinator's answer to the holds: switch allocation (or not), then file
        the partials kept while it was undecided."""
        st, inbox = self.state, self._inbox
        if st is None or inbox is None or st.run != msg.run or epoch != self.epoch:
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
        for message in held:
            try:
                self._on_partial(message)
            except ProtocolError as exc:
                self._dropped([], exc)

    def _connect_peers(self) -> None:
        self._close_peers()
        for device, (endpoint, key, peer) in self._pending_peers.items():
            self._peers[device] = self._connect(endpoint, key, peer)
            if self._acks is not None:  # kept past the run's end: late copies get theirs
                self._acks.sockets[device] = self._connect(endpoint, key, peer)

    def _allow_peers(self, names: dict[int, str], keys: dict[int, str], me: int,
                     endpoints: dict[int, str]) -> None:  # fmt: skip
        """Allow the peers' keys before any connects (a refused CURVE handshake is not
        retried); connect to them at lossy_go, once every stage allows this one's."""
        if self._data_allow is not None:
            self._data_allow.replace({names.get(d, str(d)): k.encode() for d, k in keys.items()})
        self._pending_peers = {
            d: (endpoint, keys.get(d), names.get(d, f"device {d}"))
            for d, endpoint in endpoints.items()
            if d != me
        }

    async def _setup_probes(self, message: Message) -> None:
        """A ``lossy_probe_request``: take probes on the data port, answer
        ``lossy_ready``; the probes go at ``lossy_go`` (:mod:`zpipe.stage.lossy_probes`)."""
        req = LossyProbeRequest.from_message(message)
        await self._reset()
        error = ""
        try:
            probes = LinkProbes.from_request(req)
            names = _by_index(req.names, "names")
            self._allow_peers(names, _by_index(req.keys, "keys"), probes.device, probes.peers)
        except ProtocolError as exc:
            self._pending_peers = {}
            self.protocol_errors += 1
            error = describe_error(exc)
            log.warning("lossy_probes_refused", stage=self.name, run=req.run, error=error)
        else:
            self._probes, self.epoch, self.index = probes, message.epoch, probes.device
            self._supervisor.start(RECEIVE_TASK, self._receive_loop)
        device = -1 if req.device is None else req.device
        ready = LossyReady(run=req.run, device=device, error=error).to_message()
        await self._send_control(Message(ready.kind, ready.body, epoch=message.epoch))

    async def _probe(self, probes: LinkProbes) -> None:
        try:
            report = await probe_links(
                probes, self._peers, epoch=self.epoch, timeout_s=self._send_timeout_s
            )
        except Exception as exc:  # the coordinator hears it instead of waiting out its deadline
            log.exception("lossy_probes_failed", stage=self.name, run=probes.run)
            report = replace(probes.report(), error=describe_error(exc))
        self._close_peers(linger_s=min(self._send_timeout_s, PEER_LINGER_S))
        message = report.to_message()
        await self._send_control(Message(message.kind, message.body, epoch=self.epoch))

    async def _reset(self) -> None:
        """Whatever ran on the data socket stops: a new run or measurement takes it."""
        await self._stop_data()
        await self._supervisor.stop([RECEIVE_TASK, RUN_TASK])
        self._close_peers()
        self._pending_peers = {}
        self.state = None
        self._inbox = None
        self._probes = None
        self._held_partials = []
        self.stale = 0
        if self._acks is not None:
            self._acks.close()
            self._acks = None

    async def _setup(self, message: Message) -> None:
        setup = LossySetup.from_message(message)
        await self._reset()
        error = ""
        try:
            st = build_run(setup, setup.device, shard_factory=TorchDeviceShard)
            # An idle port takes 64 KiB messages, an assignment's those of its model: a
            # larger partial would cost its connection. Set before any peer connects.
            await self._raise_limits(st.spec.batch * max(st.spec.alloc.layer_sizes) * 8)
            names = _by_index(setup.names, "names")
            self._allow_peers(names, _by_index(setup.keys, "keys"), setup.device, st.peers)
        except Exception as exc:  # any failure to set up is reported: the stage keeps serving
            self._pending_peers = {}
            self.protocol_errors += 1
            error = describe_error(exc)
            log.warning("lossy_setup_refused", stage=self.name, run=setup.run, error=error)
        else:
            self.state, self.epoch, self.index = st, message.epoch, setup.device
            self._inbox = SharedInbox(st)
            if st.spec.recovery.scheme == "ack":
                self._acks = AckSender(
                    run=st.run, index=setup.device, epoch=message.epoch,
                    keyed_loss=st.channel.keyed_loss(), counts=self._inbox.wire,
                    timeout_s=self._send_timeout_s,
                )  # fmt: skip
            self._supervisor.start(RECEIVE_TASK, self._receive_loop)
            log.info("lossy_setup", stage=self.name, run=setup.run, device=setup.device,
                     layers=sorted(st.shard.slices))  # fmt: skip
        ready = LossyReady(run=setup.run, device=setup.device, error=error).to_message()
        await self._send_control(Message(ready.kind, ready.body, epoch=message.epoch))

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
        self._close_peers()
        if self._acks is not None:
            self._acks.close()
            self._acks = None
        self.state = None

    def _close_peers(self, *, linger_s: float = 0.0) -> None:
        for sock in self._peers.values():
            sock.close(linger=int(linger_s * 1000))
        self._peers.clear()

    # ------------------------------------------------------------ receiving

    async def _receive_loop(self) -> None:
        async def receive() -> list[zmq.Frame]:
            # cancelled when the run is replaced or the stage stops: no deadline needed
            return await recv_frames(
                self._data_in(), timeout_s=None, peer="lossy peers", awaited="a partial"
            )

        async def handle(frames: list[zmq.Frame]) -> None:
            self._check_sender(frames[0])
            partial = self._on_partial(decode_frames(frames, self._max_bytes))
            if partial is not None and self._acks is not None:
                await self._acks.acknowledge(partial)

        await serve_messages(receive, handle, self._dropped)

    def _check_sender(self, frame: zmq.Frame) -> None:
        if self._data_allow is None:
            return
        key = security.sender_public_key(frame)
        if key is None or key not in self._data_allow:
            raise ProtocolError("a partial from a peer that is not in this lossy run")

    def _dropped(self, frames: list[zmq.Frame], exc: Exception) -> None:
        self.protocol_errors += 1
        log.warning(
            "dropped_message", stage=self.name, peer="lossy peer", error=describe_error(exc)
        )

    def _on_partial(self, message: Message) -> LossyPartial | None:
        """File a partial; returns it when it is this run's (a copy to acknowledge)."""
        if message.kind in ("lossy_probe", "lossy_probe_end"):
            self._on_probe(message)
            return None
        if message.kind == "lossy_ack":
            self._on_ack(message)
            return None
        if message.kind != "lossy_partial":
            raise ProtocolError(f"{message.kind!r} does not belong on a lossy run's data port")
        msg = LossyPartial.from_message(message)
        st = self.state
        if st is None or msg.run != st.run or message.epoch != self.epoch:
            self.stale += 1  # a late one of an earlier run, or one for a run not set up here
            log.debug("lossy_stale_partial", stage=self.name, run=msg.run, epoch=message.epoch)
            return None
        if msg.src not in st.peers or msg.src == self.index:
            raise ProtocolError(f"lossy_partial from device {msg.src}, not a peer of this run")
        assert self._inbox is not None  # set up with the state
        self._inbox.acks.heard_from(msg.src)  # alive: its acknowledgements are awaited again
        where = self._inbox.route(msg.data, msg.kind in ("TF", "TS"))
        if where == "hold":  # it may belong to an allocation not decided yet
            self._held_partials.append(message)
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

    def _on_ack(self, message: Message) -> None:
        """An acknowledgement (ACK): one of a copy this stage did not send (another step,
        layer or peer, or heard already) is dropped and counted, not an error."""
        ack = LossyAck.from_message(message)
        st, inbox = self.state, self._inbox
        if st is None or inbox is None or ack.run != st.run or message.epoch != self.epoch:
            self.stale += 1
            return
        if not inbox.acks.arrived((ack.data, ack.kind, ack.layer, ack.src, ack.copy)):
            log.info("lossy_ack_dropped", stage=self.name, data=ack.data, kind=ack.kind,
                     layer=ack.layer, src=ack.src, copy=ack.copy)  # fmt: skip

    def _on_probe(self, message: Message) -> None:
        probe = (LossyProbe if message.kind == "lossy_probe" else LossyProbeEnd).from_message(
            message
        )
        probes = self._probes
        if probes is None or probe.run != probes.run or message.epoch != self.epoch:
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
            peers={d: zmq.Socket.shadow(sock.underlying) for d, sock in self._peers.items()},
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
        self._close_peers(linger_s=min(self._send_timeout_s, PEER_LINGER_S))
        await self._send_result(st, error, time.perf_counter() - started)

    def _replica_sink(self, st: DeviceRun, loop: asyncio.AbstractEventLoop) -> ReplicaSink:
        """What the pass loop (compute thread) calls with a replica of the slices: the
        event loop sends it to the coordinator (``lossy_replica``)."""
        epoch = self.epoch

        def sink(step: int, slices: dict[int, tuple[NeuronSlice, FloatArray, FloatArray]]) -> None:
            layers = sorted(slices)
            message = LossyReplica(
                run=st.run,
                device=self.index,
                step=step,
                slices=[[n, slices[n][0].start, slices[n][0].stop] for n in layers],
                name=self.name,
                tensors=tuple(to_tensor(a) for n in layers for a in slices[n][1:]),
            ).to_message()
            replica = Message(message.kind, message.body, epoch=epoch, tensors=message.tensors)

            async def send() -> None:
                try:
                    await self._send_control(replica)
                except Exception as exc:  # a lost replica costs a remap only training
                    log.warning("lossy_replica_not_sent", stage=self.name, error=repr(exc))

            asyncio.run_coroutine_threadsafe(send(), loop)

        return sink

    async def _send_result(self, st: DeviceRun, error: str, wall_s: float) -> None:
        weights = st.shard.weights
        layers = sorted(weights)
        tensors = []
        for layer in layers:
            w, b = weights[layer]
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
            traffic={k: v.as_dict() for k, v in st.channel.traffic.items() if k != "test"},
            arrivals=[
                [data, kind, layer, list(senders)]
                for (data, kind, layer, _), senders in sorted(st.arrivals.items())
            ],
            waits=st.waits,
            late=st.late,
            protocol_errors=self.protocol_errors,
            stale=self.stale,
            test=_test_body(st),
            on_wire=None if self._inbox is None else self._inbox.wire.as_dict(),
            ack_waits=(self._inbox.acks.waits_body() or None) if self._inbox is not None else None,
            wall_s=wall_s,
            name=self.name,
            dead={str(d): first for d, first in self._inbox.dead.items()}
            if self._inbox is not None and self._inbox.dead
            else None,
            tensors=tuple(tensors),
        ).to_message()
        await self._send_control(
            Message(result.kind, result.body, epoch=self.epoch, tensors=result.tensors)
        )


def _test_body(st: DeviceRun) -> dict[str, Any] | None:
    """What this device's test passes did (None: the run had none)."""
    if not st.tests:
        return None
    test = st.channel.traffic.get("test")
    return {
        "predictions": [[step, classes] for step, classes in st.predictions.items()],
        "traffic": test.as_dict() if test is not None else {},
        "arrivals": [
            [step, kind, layer, list(senders)]
            for (step, kind, layer, _), senders in sorted(st.test_arrivals.items())
        ],
        "null_filled": st.test_null_filled,
    }


def _by_index(body: Any, what: str) -> dict[int, str]:
    """A map keyed by device index as a string (msgpack keys are strings)."""
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise ProtocolError(f"lossy_setup: {what} must be a map")
    try:
        return {int(k): str(v) for k, v in body.items()}
    except ValueError:
        raise ProtocolError(f"lossy_setup: {what} keys must be device indices") from None
