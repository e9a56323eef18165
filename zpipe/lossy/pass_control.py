"""One device's pass schedule of a lossy run, as a controller: events in, commands out.

EdgePipe's device waits, for each pass, for the partial results the pass reads
and null-fills those that do not come (the paper's answer to a lost message and
to a device malfunction). Every decision of that wait is made here, on plain
data, without a socket, a thread or a clock:

- the waiting rule (:func:`waiting_rule`): ``emulated``: until every partial the
  run's shared seeded loss lets through has come, at most ``wait_s``;
  ``deadline``: until the end of the timeslot the partials were sent in;
- which partial is filed, which is a duplicate copy (r-TX, ACK) and which came
  late (its pass already ran: dropped and counted);
- when a pass may compute, with which partials, and which of its senders are
  null-filled (each exactly once, never one that is also used);
- dead peers (the coordinator's ``lossy_dead``): not waited for, not sent to,
  recorded with the first mini-batch whose passes ran without them; under a remap
  the passes hold at a frontier until the coordinator decides where the
  allocation switches (:mod:`zpipe.lossy.remap`).

The stage's threads (:mod:`zpipe.stage.executors.lossy_passes`) only move bytes: they feed
:meth:`PassControl.on_event` what happened and carry out the commands it returns.
A command to wait names its deadline; the shell feeds :class:`DeadlineReached`
once its clock passes it. Times are the shell's: pass deadlines on the run's pass
clock (:func:`pass_clock`), a hold's deadline on the monotonic clock.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Literal

from zpipe.lossy.device_run import Switch
from zpipe.lossy.engine import LinkChannel
from zpipe.lossy.linkmodes import WaitMode
from zpipe.lossy.partial import FloatArray
from zpipe.lossy.shard import Needed

#: where a partial is filed: (data id or test step, kind, key layer)
PartialKey = tuple[int, str, int]
#: why a sender's partial is null-filled
NullReason = Literal["lost", "dead", "overdue"]
#: where a received partial belongs (:meth:`PassControl.route`)
Route = Literal["hold", "next", "now"]


# ---------------------------------------------------------------- events


@dataclass(frozen=True)
class PartialArrived:
    """A peer's partial came off the wire (every copy, duplicates included)."""

    key: PartialKey
    src: int
    values: FloatArray = field(compare=False, repr=False)


@dataclass(frozen=True)
class OwnPartial:
    """A partial this device sends itself: no link to cross, never late."""

    key: PartialKey
    src: int
    values: FloatArray = field(compare=False, repr=False)


@dataclass(frozen=True)
class PassStarted:
    """A pass starts and needs one partial from each of ``senders`` under ``key``;
    the waiting rule expects those of ``expect`` by ``deadline``. ``data``: the
    mini-batch a dead sender is recorded missing from (``record_dead``: False for a
    test pass, whose step is no mini-batch)."""

    key: PartialKey
    data: int
    senders: tuple[int, ...]
    expect: frozenset[int]
    deadline: float
    record_dead: bool = True


@dataclass(frozen=True)
class DeadlineReached:
    """The open pass's deadline has passed on the shell's clock."""


@dataclass(frozen=True)
class PeerDead:
    """The coordinator declared ``device`` dead; ``remap``: the run re-maps it, so hold
    (``now``: the monotonic time, from which the coordinator has ``wait_s`` to decide)."""

    device: int
    remap: bool = False
    now: float = 0.0


@dataclass(frozen=True)
class RemapDecided:
    """The coordinator's answer to a hold: switch allocation (``switch``) or go on."""

    switch: Switch | None


@dataclass(frozen=True)
class BeginPass:
    """The schedule reached a pass of mini-batch ``data``: run it now?"""

    data: int


@dataclass(frozen=True)
class SegmentEnded:
    """The running allocation's passes are done: what next?"""


@dataclass(frozen=True)
class Switched:
    """The switch is made: partials are checked against the run's state again."""


@dataclass(frozen=True)
class SendDue:
    """A copy of a partial is due to device ``dst``."""

    dst: int


@dataclass(frozen=True)
class RunEnding:
    """The last pass ran: the result may go once no hold is undecided."""


Event = (
    PartialArrived | OwnPartial | PassStarted | DeadlineReached | PeerDead | RemapDecided
    | BeginPass | SegmentEnded | Switched | SendDue | RunEnding
)  # fmt: skip


# ---------------------------------------------------------------- commands


@dataclass(frozen=True)
class Filed:
    key: PartialKey
    src: int


@dataclass(frozen=True)
class DropDuplicate:
    """A later copy of a partial already filed (r-TX, ACK): discard, count."""

    key: PartialKey
    src: int


@dataclass(frozen=True)
class DropLate:
    """A partial whose pass already ran, null-filled: discard, count."""

    key: PartialKey
    src: int


@dataclass(frozen=True)
class WaitForPartials:
    """The open pass waits for partials until ``until`` (pass clock)."""

    key: PartialKey
    until: float


@dataclass(frozen=True)
class NullFill:
    """Sender ``src``'s partial of the pass under ``key`` is zeros (``why``: lost by the
    seeded loss, its sender dead, or expected and not come by the deadline)."""

    key: PartialKey
    src: int
    why: NullReason


@dataclass(frozen=True)
class Compute:
    """The pass under ``key`` runs now on ``partials`` (src -> values); its senders
    absent from them are null-filled (the :class:`NullFill` commands before it)."""

    key: PartialKey
    partials: dict[int, FloatArray] = field(compare=False, repr=False)


@dataclass(frozen=True)
class SendHold:
    """Tell the coordinator the frontier this device holds at (``lossy_hold``)."""

    frontier: int


@dataclass(frozen=True)
class WaitForDecision:
    """A hold is undecided: wait until ``until`` (monotonic) for ``lossy_remap``;
    past it the run ends with a timeout (never a hang)."""

    until: float


@dataclass(frozen=True)
class RunPass:
    data: int


@dataclass(frozen=True)
class SkipPass:
    """The pass belongs to the allocation a remap switches to: it runs there."""

    data: int


@dataclass(frozen=True)
class MakeSwitch:
    switch: Switch


@dataclass(frozen=True)
class TrainingOver:
    """No switch is left to make: the training passes are done here."""


@dataclass(frozen=True)
class SendPartial:
    dst: int


@dataclass(frozen=True)
class DropSend:
    """Its receiver is dead: nobody to send to."""

    dst: int


Command = (
    Filed | DropDuplicate | DropLate | WaitForPartials | NullFill | Compute | SendHold
    | WaitForDecision | RunPass | SkipPass | MakeSwitch | TrainingOver | SendPartial | DropSend
)  # fmt: skip


# ---------------------------------------------------------------- the waiting rule


def pass_clock(mode: WaitMode) -> Literal["monotonic", "wall"]:
    """The clock a mode's pass deadlines are on: deadline mode counts timeslots on the
    wall clock from the run's common start; emulated waits are intervals."""
    return "monotonic" if mode == "emulated" else "wall"


def waiting_rule(
    mode: WaitMode,
    needed: Needed,
    *,
    index: int,
    data: int,
    timeslot: int,
    now: float,
    wait_s: float,
    start_at: float,
    slot_s: float,
    channel: LinkChannel,
) -> tuple[frozenset[int], float]:
    """Whose partials a pass of device ``index`` waits for, and until when (on
    :func:`pass_clock`'s clock, which reads ``now``): emulated, those the seeded loss
    lets through, at most ``wait_s``; deadline, all, until the end of the timeslot
    before the pass's ``timeslot`` (the one the partials were sent in)."""
    senders = [src for src, _ in needed.senders]
    if mode == "emulated":
        expect = frozenset(
            src
            for src in senders
            if channel.would_deliver(src, index, needed.layer, data, needed.direction)
        )
        return expect, now + wait_s
    return frozenset(senders), start_at + timeslot * slot_s


# ---------------------------------------------------------------- the controller


class PassControl:
    """The pass schedule of one run on one device (see the module docstring).

    Not thread-safe: the shell calls it under one lock.
    """

    def __init__(self, *, n_data: int, wait_s: float) -> None:
        self.n_data = n_data
        self.wait_s = wait_s
        #: partials filed and not yet taken by their pass
        self.partials: dict[PartialKey, dict[int, FloatArray]] = {}
        #: the keys whose pass ran: a partial of one of them is late
        self.consumed: set[PartialKey] = set()
        #: device -> the first mini-batch whose passes ran without it (None: none yet)
        self.dead: dict[int, int | None] = {}
        # the (key, src) of every partial received, so a later copy is a duplicate
        self._filed: set[tuple[PartialKey, int]] = set()
        # the pass waiting for its partials (one at a time)
        self._open: PassStarted | None = None
        # A remap (zpipe.lossy.remap): the last mini-batch whose passes started, whether
        # training is over here, the frontier held at until the coordinator decides
        # (None: not held) and by when, the last mini-batch of the running allocation
        # and the switch decided and not yet made.
        self.started = 0
        self.past_training = False
        self.held: int | None = None
        self.decide_by = 0.0
        self.segment_end = n_data
        self.pending: Switch | None = None

    # ------------------------------------------------------------ queries

    def is_dead(self, device: int) -> bool:
        return device in self.dead

    def route(self, data: int, test: bool) -> Route:
        """Where a partial of mini-batch (or test step) ``data`` belongs: ``"hold"``
        (a hold is undecided and it may belong to a switch not yet known: keep it
        until the decision), ``"next"`` (the decided switch's allocation) or ``"now"``."""
        if self.held is not None and (test or data > self.held):
            return "hold"
        if self.pending is not None and (test or data >= self.pending.first):
            return "next"
        return "now"

    # ------------------------------------------------------------ events

    def on_event(self, event: Event) -> list[Command]:
        match event:
            case PartialArrived():
                return self._arrived(event)
            case OwnPartial(key=key, src=src, values=values):
                self.partials.setdefault(key, {})[src] = values
                return self._settle()
            case PassStarted():
                assert self._open is None, "one pass waits at a time"
                self._open = event
                return self._settle()
            case DeadlineReached():
                return self._settle(deadline_passed=True)
            case PeerDead():
                return self._peer_dead(event)
            case RemapDecided(switch=switch):
                if switch is not None:
                    self.segment_end = switch.first - 1
                    self.pending = switch
                self.held = None
                return []
            case BeginPass(data=data):
                return [self._begin(data)]
            case SegmentEnded():
                return [self._segment_ended()]
            case Switched():
                self.pending = None
                return []
            case SendDue(dst=dst):
                return [DropSend(dst) if dst in self.dead else SendPartial(dst)]
            case RunEnding():
                return [] if self.held is None else [WaitForDecision(self.decide_by)]
        raise TypeError(f"not an event of a lossy pass schedule: {event!r}")

    def _arrived(self, event: PartialArrived) -> list[Command]:
        key, src = event.key, event.src
        if (key, src) in self._filed:
            return [DropDuplicate(key, src)]
        self._filed.add((key, src))
        if key in self.consumed:
            return [DropLate(key, src)]
        self.partials.setdefault(key, {}).setdefault(src, event.values)
        return [Filed(key, src), *self._settle()]

    def _peer_dead(self, event: PeerDead) -> list[Command]:
        self.dead.setdefault(event.device, None)
        out: list[Command] = []
        if event.remap:
            frontier = self.n_data + 1 if self.past_training else self.started
            self.held = frontier
            self.decide_by = event.now + self.wait_s
            out.append(SendHold(frontier))
        return out + self._settle()

    def _settle(self, *, deadline_passed: bool = False) -> list[Command]:
        """The open pass's next step: wait on, or run with what came."""
        if self._open is None:
            return []
        started = self._open
        came = self.partials.get(started.key, {})
        alive = started.expect - self.dead.keys()
        if not deadline_passed and not alive <= came.keys():
            return [WaitForPartials(started.key, started.deadline)]
        self._open = None
        if started.record_dead:
            for device, since in self.dead.items():
                if since is None and device in started.senders:
                    self.dead[device] = started.data
        self.consumed.add(started.key)
        # a pass reads its senders' partials only (the shell files no other's)
        got = {s: v for s, v in self.partials.pop(started.key, {}).items() if s in started.senders}
        out: list[Command] = [
            NullFill(started.key, src, self._why(src, started.expect))
            for src in started.senders
            if src not in got
        ]
        out.append(Compute(started.key, got))
        return out

    def _why(self, src: int, expect: Collection[int]) -> NullReason:
        if src in self.dead:
            return "dead"
        return "overdue" if src in expect else "lost"

    def _begin(self, data: int) -> Command:
        if self.held is not None and data > self.held:
            return WaitForDecision(self.decide_by)
        if data > self.segment_end:
            return SkipPass(data)
        self.started = max(self.started, data)
        return RunPass(data)

    def _segment_ended(self) -> Command:
        if self.held is not None:
            return WaitForDecision(self.decide_by)
        switch = self.pending
        if switch is None:
            self.past_training = True
            return TrainingOver()
        self.segment_end = self.n_data
        return MakeSwitch(switch)
