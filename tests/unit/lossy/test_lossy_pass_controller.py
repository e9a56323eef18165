"""The stage's lossy pass schedule as a controller (zpipe.lossy.pass_control): fed
events, no sockets, no threads, no clocks. The shell that feeds it from the receive
loop and the pass loop is tested by the executor and multi-process tests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zpipe.lossy.device_run import Switch
from zpipe.lossy.engine import LinkChannel
from zpipe.lossy.links import Direction
from zpipe.lossy.partition import NeuronSlice, partition
from zpipe.lossy.pass_control import (
    BeginPass,
    Command,
    Compute,
    DeadlineReached,
    DropDuplicate,
    DropLate,
    DropSend,
    Event,
    Filed,
    MakeSwitch,
    NullFill,
    OwnPartial,
    PartialArrived,
    PartialKey,
    PassControl,
    PassStarted,
    PeerDead,
    RemapDecided,
    RunEnding,
    RunPass,
    SegmentEnded,
    SendDue,
    SendHold,
    SendPartial,
    SkipPass,
    Switched,
    TrainingOver,
    WaitForDecision,
    WaitForPartials,
    pass_clock,
    waiting_rule,
)
from zpipe.lossy.shard import Needed, Topology

KEY: PartialKey = (1, "F", 0)


def _values(v: float = 1.0) -> np.ndarray:
    return np.full((2, 3), v)


def _start(key: PartialKey = KEY, senders: tuple[int, ...] = (0, 1, 2),
           expect: frozenset[int] | None = None, deadline: float = 10.0,
           record_dead: bool = True) -> PassStarted:  # fmt: skip
    return PassStarted(key, key[0], senders, frozenset(senders) if expect is None else expect,
                       deadline, record_dead)  # fmt: skip


def _fills(commands: list[Command]) -> dict[int, str]:
    return {c.src: c.why for c in commands if isinstance(c, NullFill)}


def _compute(commands: list[Command]) -> Compute:
    (compute,) = [c for c in commands if isinstance(c, Compute)]
    return compute


def test_a_pass_waits_for_what_it_expects_and_null_fills_what_cannot_come() -> None:
    control = PassControl(n_data=4, wait_s=1.0)
    # the seeded loss drops device 2's partial: it is not waited for
    assert control.on_event(_start(expect=frozenset({0, 1}))) == [WaitForPartials(KEY, 10.0)]
    assert control.on_event(PartialArrived(KEY, 0, _values())) == [
        Filed(KEY, 0), WaitForPartials(KEY, 10.0)
    ]  # fmt: skip
    out = control.on_event(PartialArrived(KEY, 1, _values(2.0)))
    assert out[0] == Filed(KEY, 1) and _fills(out) == {2: "lost"}
    assert sorted(_compute(out).partials) == [0, 1]
    assert float(_compute(out).partials[1][0, 0]) == 2.0
    # after the pass: a late partial is dropped, a repeated copy is a duplicate
    assert control.on_event(PartialArrived(KEY, 2, _values())) == [DropLate(KEY, 2)]
    assert control.on_event(PartialArrived(KEY, 0, _values())) == [DropDuplicate(KEY, 0)]
    assert KEY not in control.partials and KEY in control.consumed


def test_at_its_deadline_a_pass_runs_with_what_came() -> None:
    control = PassControl(n_data=4, wait_s=1.0)
    control.on_event(PartialArrived(KEY, 1, _values()))  # before its pass: kept
    assert control.on_event(_start()) == [WaitForPartials(KEY, 10.0)]
    out = control.on_event(DeadlineReached())
    assert _fills(out) == {0: "overdue", 2: "overdue"} and list(_compute(out).partials) == [1]
    assert control.on_event(DeadlineReached()) == []  # nothing is open any more


def test_a_dead_peer_is_not_waited_for_not_sent_to_and_recorded_once() -> None:
    control = PassControl(n_data=4, wait_s=1.0)
    control.on_event(OwnPartial(KEY, 0, _values()))
    control.on_event(PartialArrived(KEY, 1, _values()))
    assert control.on_event(_start()) == [WaitForPartials(KEY, 10.0)]
    out = control.on_event(PeerDead(2))  # the last one missing: the pass runs now
    assert _fills(out) == {2: "dead"} and sorted(_compute(out).partials) == [0, 1]
    assert control.dead == {2: 1}  # missing from mini-batch 1 on
    assert control.on_event(SendDue(2)) == [DropSend(2)]
    assert control.on_event(SendDue(1)) == [SendPartial(1)]
    later = (3, "F", 0)  # the dead device is not waited for
    assert control.on_event(_start(later)) == [WaitForPartials(later, 10.0)]
    out = control.on_event(DeadlineReached())
    assert _fills(out) == {0: "overdue", 1: "overdue", 2: "dead"}
    assert control.dead == {2: 1}  # the first mini-batch stays recorded
    # a test pass records nobody: a test step is no mini-batch
    control = PassControl(n_data=4, wait_s=1.0)
    control.on_event(PeerDead(0))
    out = control.on_event(_start((0, "TF", 0), senders=(0,), record_dead=False))
    assert _fills(out) == {0: "dead"} and control.dead == {0: None}


def test_a_remap_holds_the_passes_at_the_frontier_until_the_coordinator_decides() -> None:
    control = PassControl(n_data=6, wait_s=5.0)
    assert [control.on_event(BeginPass(d)) for d in (1, 2)] == [[RunPass(1)], [RunPass(2)]]
    assert control.on_event(PeerDead(3, remap=True, now=100.0)) == [SendHold(2)]
    assert control.on_event(BeginPass(2)) == [RunPass(2)]  # at the frontier: goes on
    assert control.on_event(BeginPass(3)) == [WaitForDecision(105.0)]
    assert control.on_event(SegmentEnded()) == [WaitForDecision(105.0)]
    assert control.on_event(RunEnding()) == [WaitForDecision(105.0)]
    assert (control.route(2, False), control.route(3, False), control.route(0, True)) == (
        "now", "hold", "hold"
    )  # fmt: skip
    alloc = partition("hybrid", [6, 4, 3], 2)
    switch = Switch(4, alloc, Topology(alloc), ())
    assert control.on_event(RemapDecided(switch)) == []
    assert control.on_event(BeginPass(3)) == [RunPass(3)]
    assert control.on_event(BeginPass(4)) == [SkipPass(4)]  # the new allocation runs it
    assert control.route(4, False) == "next" and control.route(3, False) == "now"
    assert control.on_event(SegmentEnded()) == [MakeSwitch(switch)]
    assert control.on_event(Switched()) == []
    assert control.on_event(BeginPass(4)) == [RunPass(4)] and control.route(4, False) == "now"
    assert control.on_event(SegmentEnded()) == [TrainingOver()] and control.past_training
    assert control.on_event(PeerDead(1, remap=True, now=0.0)) == [SendHold(7)]  # past training
    assert control.on_event(RemapDecided(None)) == [] and control.on_event(RunEnding()) == []


def test_the_waiting_rule_of_each_mode() -> None:
    channel = LinkChannel(prr=np.full((3, 3), 0.5), seed=3)
    needed = Needed("F", 0, 0, Direction.FORWARD,
                    ((0, NeuronSlice(0, 0, 2)), (1, NeuronSlice(0, 2, 4))))  # fmt: skip
    expects = set()
    for data in range(1, 40):
        expect, deadline = waiting_rule(
            "emulated", needed, index=2, data=data, timeslot=7, now=50.0, wait_s=2.0,
            start_at=1000.0, slot_s=0.5, channel=channel,
        )  # fmt: skip
        want = {s for s in (0, 1) if channel.would_deliver(s, 2, 0, data, Direction.FORWARD)}
        assert expect == want and deadline == 52.0
        expects.add(expect)
    assert len(expects) > 1  # the seeded loss decides some of them lost
    expect, deadline = waiting_rule(
        "deadline", needed, index=2, data=1, timeslot=7, now=50.0, wait_s=2.0,
        start_at=1000.0, slot_s=0.5, channel=channel,
    )  # fmt: skip
    assert expect == {0, 1} and deadline == 1003.5  # the end of the timeslot before 7
    assert (pass_clock("emulated"), pass_clock("deadline")) == ("monotonic", "wall")


def test_one_pass_waits_at_a_time_and_unknown_events_are_refused() -> None:
    control = PassControl(n_data=2, wait_s=1.0)
    control.on_event(_start())
    with pytest.raises(AssertionError):
        control.on_event(_start((2, "F", 0)))
    with pytest.raises(TypeError):
        control.on_event("partial")  # type: ignore[arg-type]


# ---------------------------------------------------------------- properties

DEVICES = range(5)


@dataclass(frozen=True)
class _Pass:
    senders: tuple[int, ...]
    expect: frozenset[int]
    # what happens while it waits: ("arrive", src, which pass: -1 earlier, 0, +1 later),
    # ("dead", device) or ("deadline",)
    steps: tuple[tuple[object, ...], ...]


@st.composite
def _passes(draw: st.DrawFn) -> list[_Pass]:
    out = []
    for _ in range(draw(st.integers(1, 6))):
        senders = tuple(sorted(draw(st.sets(st.sampled_from(DEVICES), min_size=1))))
        expect = frozenset(draw(st.sets(st.sampled_from(senders))))
        step = st.one_of(
            st.tuples(st.just("arrive"), st.sampled_from(DEVICES), st.sampled_from((-1, 0, 1))),
            st.tuples(st.just("dead"), st.sampled_from(DEVICES)),
            st.just(("deadline",)),
        )
        out.append(_Pass(senders, expect, tuple(draw(st.lists(step, max_size=12)))))
    return out


@dataclass(frozen=True)
class _Fed:
    """One event fed to the controller and what it answered."""

    event: Event
    commands: list[Command]


def _run(passes: list[_Pass]) -> tuple[PassControl, list[_Fed]]:
    """Each pass in turn (key ``(i, "F", 0)``), its steps fed while it waits, then its
    deadline if it still waits. Each arrival's values are its serial number."""
    control = PassControl(n_data=len(passes), wait_s=1.0)
    log: list[_Fed] = []

    def feed(event: Event) -> list[Command]:
        log.append(_Fed(event, control.on_event(event)))
        return log[-1].commands

    serial = 0.0
    for i, p in enumerate(passes, 1):
        settled = Compute in map(type, feed(PassStarted((i, "F", 0), i, p.senders, p.expect,
                                                        10.0 * i)))  # fmt: skip
        for step in p.steps:
            if settled:
                break
            if step[0] == "arrive":
                serial += 1.0
                at = (i + int(str(step[2])), "F", 0)
                out = feed(PartialArrived(at, int(str(step[1])), np.full((1,), serial)))
            elif step[0] == "dead":
                out = feed(PeerDead(int(str(step[1]))))
            else:
                out = feed(DeadlineReached())
            settled = Compute in map(type, out)
        if not settled:
            feed(DeadlineReached())
    return control, log


def _by_pass(log: list[_Fed]) -> dict[PartialKey, list[Command]]:
    """The commands about each pass, in order."""
    out: dict[PartialKey, list[Command]] = {}
    for fed in log:
        for c in fed.commands:
            if isinstance(c, NullFill | Compute):
                out.setdefault(c.key, []).append(c)
    return out


@settings(max_examples=150, deadline=None)
@given(_passes())
def test_every_sender_of_a_pass_is_used_or_null_filled_exactly_once(passes: list[_Pass]) -> None:
    _, log = _run(passes)
    by_pass = _by_pass(log)
    for i, p in enumerate(passes, 1):
        out = by_pass[(i, "F", 0)]
        computes = [c for c in out if isinstance(c, Compute)]
        assert len(computes) == 1 and out[-1] is computes[0]  # the pass runs once, last
        fills = [c.src for c in out if isinstance(c, NullFill)]
        assert len(fills) == len(set(fills))  # a lost partial is null-filled once per pass
        used = set(computes[0].partials)
        assert not used & set(fills)  # never both used and null-filled
        assert used | set(fills) == set(p.senders)  # every partial is one or the other
    # nothing else ran: the passes of other keys (partials sent early or late) never did
    assert set(by_pass) == {(i, "F", 0) for i in range(1, len(passes) + 1)}


@settings(max_examples=150, deadline=None)
@given(_passes())
def test_late_partials_of_a_finished_pass_are_dropped(passes: list[_Pass]) -> None:
    control, log = _run(passes)
    finished: set[PartialKey] = set()
    seen: set[tuple[PartialKey, int]] = set()
    filed_serial: dict[tuple[PartialKey, int], float] = {}
    for fed in log:
        event = fed.event
        if isinstance(event, PartialArrived):
            first = fed.commands[0]
            if (event.key, event.src) in seen:
                assert first == DropDuplicate(event.key, event.src)
            elif event.key in finished:
                assert fed.commands == [DropLate(event.key, event.src)]
            else:
                assert first == Filed(event.key, event.src)
                filed_serial[(event.key, event.src)] = float(event.values[0])
            seen.add((event.key, event.src))
        for c in fed.commands:
            if isinstance(c, Compute):
                # what a pass uses is the first copy of each partial, filed in time
                for src, values in c.partials.items():
                    assert float(values[0]) == filed_serial[(c.key, src)]
                finished.add(c.key)
    assert not finished & control.partials.keys() and finished <= control.consumed


@settings(max_examples=100, deadline=None)
@given(_passes())
def test_a_dead_sender_is_recorded_from_the_first_pass_that_ran_after_its_death(
    passes: list[_Pass],
) -> None:
    control, log = _run(passes)
    by_pass = _by_pass(log)
    for device, since in control.dead.items():
        died = next(n for n, fed in enumerate(log) if fed.event == PeerDead(device))
        after = [
            c.key[0]
            for fed in log[died:]
            for c in fed.commands
            if isinstance(c, Compute) and device in passes[c.key[0] - 1].senders
        ]
        assert since == (after[0] if after else None)
        # every pass that null-filled it for its death ran from then on
        assert all(
            since is not None and i >= since
            for i in range(1, len(passes) + 1)
            if NullFill((i, "F", 0), device, "dead") in by_pass[(i, "F", 0)]
        )
