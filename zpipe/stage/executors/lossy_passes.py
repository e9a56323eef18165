"""A stage's passes of one lossy run, run whole in the stage's compute thread.

A pass of a lossy run is small (a slice of a dense layer on one mini-batch:
well under a millisecond of compute), so handing every pass from the event
loop to the compute thread and back costs more than the pass itself: two
cross-thread wake-ups per pass, on a machine whose cores the other stages
share. So the compute thread runs the whole pass sequence
(:func:`zpipe.lossy.schedule.events`): it waits for a pass's partials on a
condition the receive loop notifies, computes, and queues the pass's partials
itself on the peers' PUSH sockets (non-blocking, then polled until the send's
deadline). The event loop only receives: it files each partial in the
:class:`SharedInbox` and keeps answering heartbeats. The loop never computes,
and no socket is used by two threads: the PUSH sockets belong to the pass loop
from ``run`` until it returns (the executor closes them after).

Every decision of the schedule is the controller's
(:class:`zpipe.lossy.pass_control.PassControl`: the waiting rules, null-filling,
late and duplicate partials, dead peers and remap holds); this module only feeds
it events, under one lock, and carries out its commands: it waits on the clocks
they name, computes, and moves the bytes.

After its training passes, a run whose spec asks for test passes
(:mod:`zpipe.lossy.evaluation`) runs them the same way: each test step's forward
passes layer by layer over the same lossy links (their own drop keys), then each
output owner assembles its view of the logits and keeps its predictions. In
deadline mode a test pass takes ``L + 1`` timeslots after the training's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import zmq

from zpipe._errors import TransportTimeout
from zpipe.log import get_logger
from zpipe.lossy.device_run import TEST_KINDS, DeviceRun, Switch
from zpipe.lossy.engine import record_arrival
from zpipe.lossy.partial import FloatArray
from zpipe.lossy.partition import NeuronSlice
from zpipe.lossy.pass_control import (
    BeginPass,
    Command,
    Compute,
    DeadlineReached,
    DropDuplicate,
    DropLate,
    Event,
    MakeSwitch,
    NullFill,
    OwnPartial,
    PartialArrived,
    PartialKey,
    PassControl,
    PassStarted,
    PeerDead,
    RemapDecided,
    Route,
    RunEnding,
    RunPass,
    SegmentEnded,
    SendDue,
    SendHold,
    SendPartial,
    Switched,
    WaitForDecision,
    WaitForPartials,
    pass_clock,
    waiting_rule,
)
from zpipe.lossy.remap import assemble_slices
from zpipe.lossy.schedule import PassEvent, events, total_timeslots
from zpipe.lossy.shard import DeviceShard, Needed, Outgoing, ShardFactory
from zpipe.lossy.wire import partial_message
from zpipe.stage.executors.lossy_recovery import AckBook, AckId, WireCounts
from zpipe.transport.codec import Message, encode
from zpipe.transport.emulation import KeyedLinks, LossKey

log = get_logger("zpipe.stage")

# How often a blocked send looks whether the run was stopped.
_STOP_POLL_S = 0.2


#: takes a replica: the mini-batch it follows, and by layer (slice, W, b)
ReplicaSink = Callable[[int, dict[int, tuple[NeuronSlice, FloatArray, FloatArray]]], None]


class RunStopped(Exception):
    """The run was replaced or the stage is stopping: the pass loop ends early."""


class SharedInbox:
    """One run's :class:`~zpipe.lossy.pass_control.PassControl` under one lock.

    The receive loop (event loop thread) and the pass loop (compute thread) both
    feed the controller its events; every decision (filing, waiting, null-filling,
    holds, dead peers) is the controller's. This class only guards it, wakes the
    pass loop when the controller has settled its open pass or a hold was decided,
    and waits on the clocks the controller's commands name.
    """

    def __init__(self, st: DeviceRun) -> None:
        self.st = st
        self.control = PassControl(n_data=st.spec.n_data, wait_s=st.spec.wait_s)
        self._cond = threading.Condition()
        self.stopped = False
        # what crossed the wire; the partials filed (a repeat is an r-TX or ACK copy)
        self.wire = WireCounts()
        self.acks = AckBook(self.wire)
        # the open pass's NullFill and Compute commands, once the controller settled it
        self._settled: list[Command] | None = None

    def _feed(self, event: Event) -> list[Command]:
        """The controller's commands for ``event`` (the lock held); hands a settled
        pass to the pass loop, wherever the event came from."""
        commands = self.control.on_event(event)
        if any(isinstance(c, Compute) for c in commands):
            self._settled = [c for c in commands if isinstance(c, NullFill | Compute)]
            self._cond.notify_all()
        return commands

    @property
    def dead(self) -> dict[int, int | None]:
        """Device -> the first mini-batch whose passes ran without it."""
        return self.control.dead

    @property
    def pending(self) -> Switch | None:
        return self.control.pending

    @property
    def past_training(self) -> bool:
        return self.control.past_training

    def file(self, key: PartialKey, src: int, values: FloatArray) -> bool:
        """File a partial; False if its pass has already run (it came late). A copy
        after the first is discarded and counted as a duplicate."""
        with self._cond:
            first = self._feed(PartialArrived(key, src, values))[0]
            if isinstance(first, DropDuplicate):
                self.wire.duplicates += 1
            elif isinstance(first, DropLate):
                self.st.late += 1
                return False
            return True

    def mark_dead(self, device: int) -> None:
        with self._cond:
            self._feed(PeerDead(device))

    def hold(self, device: int) -> int:
        """``device`` died and the run re-maps it: null-fill it from now on, and start
        no mini-batch beyond the last one started until :meth:`decide`. Returns that
        frontier (``n_data + 1`` once training is over here)."""
        with self._cond:
            commands = self._feed(PeerDead(device, remap=True, now=time.monotonic()))
            self._cond.notify_all()
            return next(c.frontier for c in commands if isinstance(c, SendHold))

    def _wait_decision(self, wait: WaitForDecision) -> None:
        """Wait (the lock held) for the coordinator's decision on a hold, until the
        controller's deadline: a coordinator that never decides ends the run with a
        clear error, never a hang (a restarted one sets the stages up anew)."""
        remaining = wait.until - time.monotonic()
        if remaining <= 0:
            raise TransportTimeout("coordinator", "lossy_remap", self.st.spec.wait_s)
        self._cond.wait(remaining)

    def decide(self, switch: Switch | None) -> None:
        """The coordinator's answer to a hold: switch allocation from ``switch.first``
        on, or (None) go on as before, null-filling the dead device."""
        with self._cond:
            self._feed(RemapDecided(switch))
            self._cond.notify_all()

    def route(self, data: int, test: bool) -> Route:
        with self._cond:
            return self.control.route(data, test)

    def begin(self, data: int) -> bool:
        """Whether to run a pass of mini-batch ``data`` now (False: a later allocation
        runs it); waits while a hold keeps this stage from starting it."""
        with self._cond:
            while True:
                if self.stopped:
                    raise RunStopped()
                (command,) = self._feed(BeginPass(data))
                if not isinstance(command, WaitForDecision):
                    return isinstance(command, RunPass)
                self._wait_decision(command)

    def next_switch(self) -> Switch | None:
        """At the end of an allocation's passes: the switch to make, or None (training
        is over here), once no hold is undecided."""
        with self._cond:
            while True:
                if self.stopped:
                    raise RunStopped()
                (command,) = self._feed(SegmentEnded())
                if not isinstance(command, WaitForDecision):
                    return command.switch if isinstance(command, MakeSwitch) else None
                self._wait_decision(command)

    def switched(self) -> None:
        """The switch is made: partials are checked against the run's state again (until
        now those of the new allocation were checked against the switch)."""
        with self._cond:
            self._feed(Switched())

    def finish(self) -> None:
        """Before the result goes: no hold may be left undecided."""
        with self._cond:
            while not self.stopped:
                commands = self._feed(RunEnding())
                if not commands:
                    return
                assert isinstance(commands[0], WaitForDecision)
                self._wait_decision(commands[0])

    def stop(self) -> None:
        with self._cond:
            self.stopped = True
            self._cond.notify_all()

    def collect(
        self, started: PassStarted, clock: Callable[[], float]
    ) -> tuple[list[NullFill], dict[int, FloatArray], float]:
        """Start the pass ``started`` describes and wait, on ``clock``, until the
        controller settles it: returns its null-filled senders, the partials it runs
        on and the time the wait ended."""
        with self._cond:
            if self.stopped:
                raise RunStopped()
            self._settled = None
            commands = self._feed(started)
            while self._settled is None:
                wait = commands[-1]
                assert isinstance(wait, WaitForPartials)
                remaining = wait.until - clock()
                if remaining <= 0:
                    self._feed(DeadlineReached())
                    continue
                self._cond.wait(remaining)
                if self.stopped:
                    raise RunStopped()
            settled, self._settled = self._settled, None
            fills = [c for c in settled if isinstance(c, NullFill)]
            (compute,) = (c for c in settled if isinstance(c, Compute))
            return fills, compute.partials, clock()

    def keep_own(self, key: PartialKey, src: int, values: FloatArray) -> None:
        """A partial this device sends itself: no link to cross."""
        with self._cond:
            self._feed(OwnPartial(key, src, values))

    def may_send(self, dst: int) -> bool:
        """Whether a copy may go to ``dst`` (not to a dead device)."""
        with self._cond:
            return isinstance(self._feed(SendDue(dst))[0], SendPartial)

    def is_dead(self, device: int) -> bool:
        with self._cond:
            return self.control.is_dead(device)


class PassLoop:
    """One run's passes on this stage (see the module docstring)."""

    def __init__(
        self,
        st: DeviceRun,
        inbox: SharedInbox,
        *,
        index: int,
        epoch: int,
        peers: Mapping[int, zmq.Socket[Any]],
        send_timeout_s: float,
        stage: str,
        shard_factory: ShardFactory = DeviceShard,
        on_replica: ReplicaSink | None = None,
    ) -> None:
        self._shard_factory = shard_factory
        self._on_replica = on_replica
        self.st = st
        self.inbox = inbox
        self.index = index
        self.epoch = epoch
        self._peers = peers
        self._send_timeout_s = send_timeout_s
        self._stage = stage
        # this device's emulated links: they, not the sender, drop each copy
        self._keyed_loss = st.channel.keyed_loss()
        self._links = KeyedLinks(self._keyed_loss)

    def run(self) -> None:
        """Every pass of this device, in order; raises what stopped it. After a remap's
        switch, mini-batches ``switch.first..n_data`` run the new allocation's
        pipeline from its first timeslot (as zpipe.lossy.death_sim simulates)."""
        st = self.st
        alloc, first = st.spec.alloc, 1
        while True:
            for ev in events(alloc, st.spec.n_data - first + 1):
                data = ev.data + first - 1
                if ev.layer in st.shard.slices and self.inbox.begin(data):
                    self._pass(ev if first == 1 else replace(ev, data=data))
                    self._replica_after(ev.kind, ev.layer, data)
            switch = self.inbox.next_switch()
            if switch is None:
                break
            self._switch(switch)
            self.inbox.switched()
            alloc, first = switch.alloc, switch.first
        if st.tests:
            self._test_passes()
        self.inbox.finish()

    def _replica_after(self, kind: str, layer: int, data: int) -> None:
        """Every ``replica_every``-th mini-batch, once this device's last pass of it (the
        backward pass of its lowest dense layer) is done: its slices to the coordinator,
        what a remap gives whoever takes its neurons over (zpipe.lossy.remap)."""
        st, every = self.st, self.st.replica_every
        dense = [n for n in st.shard.slices if n >= 1]
        if self._on_replica is None or every is None or kind != "B" or not dense:
            return
        if layer == min(dense) and data % every == 0:
            weights = st.shard.weights
            self._on_replica(data, {n: (st.shard.slices[n], *weights[n]) for n in weights})

    def _switch(self, switch: Switch) -> None:
        """Take the new allocation: this device's slices grown by what it takes over."""
        st = self.st
        own = {layer: (st.shard.slices[layer], w, b) for layer, (w, b) in st.shard.weights.items()}
        weights = assemble_slices(switch.alloc, self.index, own, switch.pieces)
        st.topo = switch.topo
        st.spec = replace(st.spec, alloc=switch.alloc)
        st.shard = self._shard_factory(switch.topo, self.index, weights, lr=st.spec.lr)
        if switch.inputs is not None:
            st.inputs = switch.inputs
            st.x_test = switch.x_test
        if switch.labels is not None:
            st.labels = switch.labels
        log.info("lossy_switched", stage=self._stage, run=st.run, first=switch.first,
                 layers=sorted(st.shard.slices))  # fmt: skip

    def _test_passes(self) -> None:
        """Every test pass of the run's spec, in order, on the final weights."""
        st = self.st
        topo, mine = st.topo, st.shard.slices
        first_slot = total_timeslots(st.spec.alloc, st.spec.n_data)
        for i, t in enumerate(st.tests.values()):
            slot = first_slot + i * (topo.n_layers + 1)
            for layer in range(topo.n_layers):
                if layer not in mine:
                    continue
                needed = topo.needed("F", layer, test=True)
                got = (
                    {} if needed is None else self._collect(t.step, slot + layer, needed, test=True)
                )
                x = st.x_test[t.start : t.stop] if st.x_test is not None and layer == 0 else None
                outgoing = st.shard.forward(t.step, layer, t.rows, got, x=x, train=False)
                self._post(t.step, outgoing, test=True)
            if topo.last in mine:
                share = topo.needed("B", topo.last, test=True)
                assert share is not None
                got = self._collect(t.step, slot + topo.n_layers, share, test=True)
                logits = st.shard.logits_view(t.rows, got)
                st.predictions[t.step] = [int(c) for c in np.argmax(logits, axis=1)]

    def _pass(self, ev: PassEvent) -> None:
        st = self.st
        needed = st.topo.needed(ev.kind, ev.layer)
        got: dict[int, FloatArray] = {}
        if needed is not None:
            got = self._collect(ev.data, ev.timeslot, needed)
            record_arrival(st.propagation, st.arrivals, ev.data, self.index, needed, got)
        outgoing: list[Outgoing]
        if ev.kind == "F":
            x = st.inputs[ev.data - 1] if st.inputs is not None and ev.layer == 0 else None
            outgoing = st.shard.forward(ev.data, ev.layer, st.spec.batch, got, x=x)
        else:
            # only the output layer reads the labels; other layers only their count
            labels = (
                st.labels[ev.data - 1]
                if st.labels is not None and ev.layer == st.topo.last
                else np.zeros(st.spec.batch, dtype=np.int64)
            )
            outgoing, loss = st.shard.backward(ev.data, ev.layer, labels, got)
            if loss is not None:
                st.losses.append([ev.data, loss])
        self._post(ev.data, outgoing)

    def _collect(
        self, data: int, timeslot: int, needed: Needed, *, test: bool = False
    ) -> dict[int, FloatArray]:
        """One pass's partials, as the controller's waiting rule settles them: all that
        can come, or what came by the deadline; the others are null-filled."""
        st = self.st
        kind = TEST_KINDS[needed.kind] if test else needed.kind
        key = (data, kind, needed.key_layer)
        senders = tuple(src for src, _ in needed.senders)
        clock = time.monotonic if pass_clock(st.spec.mode) == "monotonic" else time.time
        expect, deadline = waiting_rule(
            st.spec.mode, needed, index=self.index, data=data, timeslot=timeslot, now=clock(),
            wait_s=st.spec.wait_s, start_at=st.start_at, slot_s=st.spec.slot_s,
            channel=st.channel,
        )  # fmt: skip
        started = PassStarted(key, data, senders, expect, deadline, record_dead=not test)
        fills, got, proceeded = self.inbox.collect(started, clock)
        if test:
            st.test_arrivals[(data, kind, needed.key_layer, self.index)] = tuple(
                sorted(src for src in senders if src in got)
            )
            st.test_null_filled += int(bool(fills))
        elif fills:  # null-filled by the shard
            st.waits.append([data, needed.kind, needed.key_layer, len(fills), deadline, proceeded])
        overdue = sorted(fill.src for fill in fills if fill.why == "overdue")
        if st.spec.mode == "emulated" and overdue:
            log.warning("lossy_partial_overdue", stage=self._stage, key=key,
                        missing=overdue, wait_s=st.spec.wait_s)  # fmt: skip
        return got

    def _post(self, data: int, outgoing: Sequence[Outgoing], *, test: bool = False) -> None:
        st = self.st
        for out in outgoing:
            kind = TEST_KINDS[out.kind] if test else out.kind
            if out.dst == self.index:
                self.inbox.keep_own((data, kind, out.key_layer), self.index, out.values)
                continue
            put: list[int | None] = []  # the copies the emulated link let through
            left: set[int] = set()  # those of them that really left (sent in time)

            def transmit(
                key: LossKey,
                out: Outgoing = out,
                kind: str = kind,
                put: list[int | None] = put,
                left: set[int] = left,
            ) -> bool:
                if key.src != self.index:  # ACK: does copy key.copy's acknowledgement come?
                    return self._ack_comes(data, kind, out, key, sent=key.copy in left)
                if not self._links.transmit(key):  # the emulated link lost this copy
                    self.inbox.wire.copies_lost += 1
                    return False
                put.append(key.copy)
                if self._put(data, kind, out, key.copy):
                    left.add(key.copy)
                return True

            delivered = st.channel.send(
                self.index, out.dst, out.layer, data, out.direction, transmit=transmit
            )
            if delivered and not put:  # lossless: no link decided, the partial goes once
                self._put(data, kind, out, None)

    def _put(self, data: int, kind: str, out: Outgoing, copy: int | None) -> bool:
        """One copy of a partial on the wire (``copy``: its number, under r-TX and ACK);
        False if it did not leave (its receiver is dead, or its send timed out)."""
        st = self.st
        if not self.inbox.may_send(out.dst):
            return False  # nobody to receive it
        scheme = st.spec.recovery.scheme
        number = None if scheme == "none" else copy
        ack = scheme == "ack" and number is not None
        message = partial_message(
            st.run, data, kind, out.key_layer, self.index, out.values, copy=number,
            link_layer=out.layer if ack else None, direction=int(out.direction) if ack else None,
            epoch=self.epoch,
        )  # fmt: skip
        if ack:  # registered before it goes, so its acknowledgement is never unexpected
            self.inbox.acks.expect(_ack_id(data, kind, out, number))
        try:
            self._send(out.dst, message)
        except TransportTimeout as exc:  # the receiver null-fills it at its deadline
            log.warning("lossy_partial_not_sent", stage=self._stage, error=str(exc))
            return False
        self.inbox.wire.copies_sent += 1
        return True

    def _ack_comes(self, data: int, kind: str, out: Outgoing, key: LossKey, *, sent: bool) -> bool:
        """Whether copy ``key.copy``'s acknowledgement comes back: the seeded decision of
        the receiver's link back. Where it comes, the emulated wait mode waits for the
        real ``lossy_ack`` (at most ``wait_s``) before the next copy, unless the copy
        never left (``sent``) or its receiver is silent since an overdue one
        (:mod:`zpipe.lossy.ack_patience`); the count of copies stays the decision's,
        whatever the wait did, so the run equals its simulation."""
        comes = not self._keyed_loss(key)
        st = self.st
        if not comes or not sent or st.spec.mode != "emulated" or self.inbox.is_dead(out.dst):
            return comes
        ack = _ack_id(data, kind, out, key.copy)
        stopped = lambda: self.inbox.stopped or self.inbox.is_dead(out.dst)  # noqa: E731
        outcome = self.inbox.acks.await_ack(ack, st.spec.wait_s, stopped)
        if outcome == "cut" and self.inbox.stopped:
            raise RunStopped()
        if outcome == "overdue":
            log.warning("lossy_ack_overdue", stage=self._stage, ack=ack, wait_s=st.spec.wait_s,
                        receiver=out.dst, waits_again="once heard from")  # fmt: skip
        return comes

    def _send(self, dst: int, message: Message) -> None:
        """Queue ``message`` on ``dst``'s PUSH socket by the send deadline."""
        sock = self._peers[dst]
        frames = encode(message)
        deadline = time.monotonic() + self._send_timeout_s
        while True:
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                pass
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.inbox.stopped or self.inbox.is_dead(dst):
                raise TransportTimeout(f"device {dst}", f"room to send {message.kind}",
                                       self._send_timeout_s)  # fmt: skip
            sock.poll(int(1000 * min(remaining, _STOP_POLL_S)) + 1, zmq.POLLOUT)


def _ack_id(data: int, kind: str, out: Outgoing, copy: int | None) -> AckId:
    return (data, kind, out.key_layer, out.dst, 0 if copy is None else copy)
