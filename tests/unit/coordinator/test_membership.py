"""The membership state machine, driven with plain numbers for time."""

from __future__ import annotations

import math
import random

import pytest

from zpipe._errors import ConfigError
from zpipe.coordinator.membership import Death, Membership, MemberState


def make(interval: float = 1.0, suspect: int = 3, probe: int = 2) -> Membership:
    m = Membership(
        heartbeat_interval_s=interval, suspect_after_intervals=suspect, probe_intervals=probe
    )
    m.register(
        name="a", routing_id=b"a", data_endpoint="tcp://h:1", info={}, public_key=None, now=0.0
    )
    m.register(
        name="b", routing_id=b"b", data_endpoint="tcp://h:2", info={}, public_key=None, now=0.5
    )
    return m


def test_silent_stage_is_suspected_probed_then_declared_dead_within_the_bound() -> None:
    m = make()
    dead_at = None
    probed_at = None
    t = 0.0
    while t < 20 and dead_at is None:
        t += 0.25
        m.heard_from("b", t)  # b keeps talking
        probes, deaths = m.tick(t)
        if any(p.name == "a" for p in probes):
            probed_at = t
        if any(d.name == "a" for d in deaths):
            dead_at = t
    assert probed_at == pytest.approx(3.0)
    assert dead_at == pytest.approx(5.0)  # (suspect_after + probe_intervals) intervals
    assert m.get("a").state is MemberState.DEAD  # type: ignore[union-attr]
    assert m.get("b").state is MemberState.ALIVE  # type: ignore[union-attr]
    assert [x.name for x in m.alive()] == ["b"]


def test_answering_the_probe_clears_suspicion() -> None:
    m = make()
    probes, _ = m.tick(3.2)
    assert {p.name for p in probes} == {"a"}
    assert m.get("a").state is MemberState.SUSPECT  # type: ignore[union-attr]
    assert m.heard_from("a", 3.5)
    _, deaths = m.tick(6.0)
    assert all(d.name != "a" for d in deaths)
    assert m.get("a").state is MemberState.ALIVE  # type: ignore[union-attr]


def test_dead_members_stay_dead_and_can_register_again() -> None:
    m = make()
    assert m.declare_dead("a", "killed", 1.0) is not None
    assert m.declare_dead("a", "again", 1.0) is None
    assert not m.heard_from("a", 2.0)
    m.register(
        name="a", routing_id=b"a2", data_endpoint="tcp://h:9", info={}, public_key=None, now=3.0
    )
    assert m.get("a").state is MemberState.ALIVE  # type: ignore[union-attr]
    assert m.by_routing_id(b"a2") is m.get("a")


def test_a_live_name_cannot_be_taken_by_another_connection() -> None:
    m = make()
    with pytest.raises(ConfigError, match="already registered"):
        m.register(
            name="a",
            routing_id=b"intruder",
            data_endpoint="tcp://h:3",
            info={},
            public_key=None,
            now=1.0,
        )
    # after the holder has gone silent, the name can be taken over (a restarted device)
    m.register(
        name="a",
        routing_id=b"restarted",
        data_endpoint="tcp://h:3",
        info={},
        public_key=None,
        now=10.0,
    )
    assert m.get("a").routing_id == b"restarted"  # type: ignore[union-attr]


def test_alive_is_in_join_order() -> None:
    m = make()
    m.register(name="c", routing_id=b"c", data_endpoint="e", info={}, public_key=None, now=0.1)
    assert [x.name for x in m.alive()] == ["a", "c", "b"]


def test_a_stall_suspect_is_dead_after_the_probe_and_one_silent_interval_more() -> None:
    m = make()  # interval 1, suspect after 3, probe 2
    m.heard_from("a", 10.0)
    m.heard_from("b", 10.0)
    probe = m.suspect("a", 10.2)  # the run stalled 0.2 s after a's last heartbeat
    assert probe is not None and probe.name == "a"
    assert m.suspect("a", 10.3) is None  # already probed
    assert m.get("a").state is MemberState.SUSPECT  # type: ignore[union-attr]
    m.heard_from("b", 12.2)
    assert m.tick(12.2) == ([], [])  # the probe's time is up, but a was heard 2.2 s ago
    m.heard_from("b", 13.0)
    _, deaths = m.tick(13.0)  # silent for probe (2) + one interval (1)
    assert [d.name for d in deaths] == ["a"]


def test_a_stall_suspect_that_answers_is_alive_and_slow_not_dead() -> None:
    m = make()
    m.suspect("b", 1.0)
    m.heard_from("b", 1.4)  # its probe answer
    assert m.get("b").state is MemberState.ALIVE  # type: ignore[union-attr]
    m.heard_from("a", 4.0)
    assert m.tick(4.0) == ([], [])
    assert m.suspect("dead-or-unknown", 1.0) is None


# ---------------------------------------------------------------- adaptive deadlines


def _heartbeats(gaps: list[float], start: float = 0.0) -> list[float]:
    """The arrival times of heartbeats ``gaps`` apart."""
    times, t = [], start
    for gap in gaps:
        t += gap
        times.append(t)
    return times


def _drive(
    m: Membership, arrivals: list[float], *, until: float, step: float = 0.1
) -> tuple[list[float], float | None]:
    """Feed ``a``'s heartbeats at ``arrivals`` and tick every ``step`` up to ``until``.

    ``a`` behaves as a live process whose event loop wakes only at its heartbeats: a
    probe sent while it is stalled is answered at its next heartbeat. ``b`` speaks on
    every tick. Returns (the times ``a`` was probed, the time it was declared dead).
    """
    probed: list[float] = []
    pending = list(reversed(arrivals))
    t = 0.0
    while t < until:
        t = round(t + step, 9)
        while pending and pending[-1] <= t:
            heard = pending.pop()
            if m.get("a").state is MemberState.SUSPECT:  # type: ignore[union-attr]
                m.heard_from("a", heard, probe_answer=True)
            m.heard_from("a", heard, heartbeat=True)
        m.heard_from("b", t, heartbeat=True)
        probes, deaths = m.tick(t)
        probed += [t for p in probes if p.name == "a"]
        if any(d.name == "a" for d in deaths):
            return probed, t
    return probed, None


def test_a_jittery_live_member_is_never_declared_dead_over_a_long_heavy_tailed_run() -> None:
    # 5,000 log-normal gaps (median 1.2 intervals, sigma 0.5): a CPU-starved process
    # whose heartbeats come late, some of them 5 to 9 intervals late
    rng = random.Random(7)
    gaps = [math.exp(rng.gauss(0.2, 0.5)) for _ in range(5_000)]
    fixed_bound = 3 + 2  # suspect after 3 intervals, then 2 for the probe
    # the fixed deadlines would have declared it dead dozens of times
    assert sum(g > fixed_bound for g in gaps) >= 10
    m = make()
    arrivals = _heartbeats(gaps)
    probed, dead_at = _drive(m, arrivals, until=arrivals[-1], step=0.5)
    assert dead_at is None
    assert m.get("a").state is not MemberState.DEAD  # type: ignore[union-attr]
    # suspected (and probed) far less often than it was late
    assert len(probed) < sum(g > 3 for g in gaps) / 10


def test_a_stopped_jittery_member_is_declared_dead_by_its_adaptive_deadlines() -> None:
    rng = random.Random(3)
    gaps = [math.exp(rng.gauss(0.2, 0.5)) for _ in range(400)]
    arrivals = _heartbeats(gaps)
    m = make()
    _, dead_at = _drive(m, arrivals, until=arrivals[-1])
    assert dead_at is None
    suspect_s, probe_s = m.deadlines("a")
    assert suspect_s > 3.0  # it showed long gaps: it is given longer than the floor
    _, dead_at = _drive_on(m, until=arrivals[-1] + 100.0, start=arrivals[-1])
    assert dead_at is not None
    silent = dead_at - arrivals[-1]
    # dead once silent for its suspect deadline and the probe's, within a tick
    assert suspect_s + probe_s <= silent <= suspect_s + probe_s + 0.2
    # and the adaptive deadlines stay a few times its longest gap, not unbounded
    assert suspect_s + probe_s <= 4 * max(gaps)


def _drive_on(m: Membership, *, until: float, start: float) -> tuple[list[float], float | None]:
    """Tick from ``start`` with ``a`` silent (stopped) and ``b`` speaking."""
    probed: list[float] = []
    t = start
    while t < until:
        t = round(t + 0.1, 9)
        m.heard_from("b", t, heartbeat=True)
        probes, deaths = m.tick(t)
        probed += [t for p in probes if p.name == "a"]
        if any(d.name == "a" for d in deaths):
            return probed, t
    return probed, None


def test_a_punctual_member_that_stops_is_found_at_the_configured_times() -> None:
    m = make()
    arrivals = _heartbeats([1.0] * 200)
    _drive(m, arrivals, until=arrivals[-1])
    assert m.deadlines("a") == pytest.approx((3.0, 2.0))
    probed, dead_at = _drive_on(m, until=arrivals[-1] + 20, start=arrivals[-1])
    assert probed == [pytest.approx(arrivals[-1] + 3.0)]
    assert dead_at == pytest.approx(arrivals[-1] + 5.0)


def test_a_member_whose_stalls_are_long_past_is_found_fast_again() -> None:
    m = make()
    # early on it stalled for 4.5 intervals (probed, answered at its next heartbeat);
    # then 200 punctual heartbeats, more than its window holds
    arrivals = _heartbeats([1.0] * 10 + [4.5] + [1.0] * 200)
    probed, _ = _drive(m, arrivals[:20], until=arrivals[19])
    assert len(probed) == 1
    assert m.deadlines("a") == pytest.approx((9.0, 7.0))  # twice the stall and its lateness
    _drive(m, arrivals[20:], until=arrivals[-1])
    assert m.deadlines("a") == pytest.approx((3.0, 2.0))
    _, dead_at = _drive_on(m, until=arrivals[-1] + 20, start=arrivals[-1])
    assert dead_at == pytest.approx(arrivals[-1] + 5.0)


def test_cold_start_uses_the_configured_times_and_covers_an_early_stall_at_once() -> None:
    m = make()
    # registered at 0 and never heard again: the floors, as before
    probed, dead_at = _drive_on(m, until=20.0, start=0.0)
    assert probed == [pytest.approx(3.0)]
    assert dead_at == pytest.approx(5.0)
    # a new member whose second heartbeat came 4 intervals after its first: one gap
    # is enough for twice that, though four are needed to leave the cold start
    m = make()
    _drive(m, [1.0, 5.0], until=5.0)
    assert m.deadlines("a")[0] == pytest.approx(8.0)
    probed, _ = _drive(m, [1.0, 5.0, 11.0], until=11.0)
    assert probed == []  # silent 6 s, under its deadline of 8 s


def _tick_through(
    m: Membership, start: float, end: float, step: float = 0.1
) -> tuple[list[float], list[tuple[float, Death]]]:
    """Tick every ``step`` from ``start`` to ``end`` with ``b`` speaking: when ``a``
    was probed, and its death (with the time) if it was declared dead."""
    probed: list[float] = []
    dead: list[tuple[float, Death]] = []
    t = start
    while t < end - 1e-9:
        t = round(t + step, 9)
        m.heard_from("b", t, heartbeat=True)
        probes, deaths = m.tick(t)
        probed += [t for p in probes if p.name == "a"]
        dead += [(t, d) for d in deaths if d.name == "a"]
    return probed, dead


def test_a_member_that_answers_probes_late_is_given_longer_to_answer() -> None:
    m = make()  # probe floor: 2 intervals
    m.heard_from("a", 0.0, heartbeat=True)
    probed, _ = _tick_through(m, 0.0, 4.9)
    assert probed == [pytest.approx(3.0)]
    m.heard_from("a", 4.9, probe_answer=True)  # just in time: 1.9 s for the round trip
    assert m.deadlines("a")[1] == pytest.approx(3.8)
    probed, dead = _tick_through(m, 4.9, 10.8)
    assert probed == [pytest.approx(7.9)] and dead == []  # 2.9 s into the probe: kept
    m.heard_from("a", 10.8, probe_answer=True)  # 2.9 s: late, and kept
    assert m.get("a").state is MemberState.ALIVE  # type: ignore[union-attr]
    assert m.deadlines("a")[1] == pytest.approx(5.8)
    probed, dead = _tick_through(m, 10.8, 30.0)
    # silent from 10.8: suspected 3 s later, dead when its probe deadline of 5.8 s passed
    assert probed == [pytest.approx(13.8)]
    assert [t for t, _ in dead] == [pytest.approx(19.6)]
    death = dead[0][1]
    assert death.suspect_deadline_s == pytest.approx(3.0)
    assert death.probe_deadline_s == pytest.approx(5.8)
    assert "its deadline 3.0 s" in death.reason


def test_a_pause_of_the_coordinator_itself_is_not_held_against_the_members() -> None:
    m = make()  # interval 1: a tick more than 1 s after the last one is a local pause
    for t in range(1, 11):
        m.heard_from("a", float(t), heartbeat=True)
        m.heard_from("b", float(t), heartbeat=True)
        assert m.tick(float(t)) == ([], [])
    # this process was starved of CPU from 10 to 14: its next tick is 4 s late, and
    # both members, silent those 4 s, are not suspected for it
    assert m.tick(14.0) == ([], [])
    # the heartbeats queued meanwhile arrive; b then stops: found 5 s after its last
    m.heard_from("a", 14.05, heartbeat=True)
    m.heard_from("b", 14.05, heartbeat=True)
    dead_at = None
    t = 14.0
    while dead_at is None and t < 30:
        t = round(t + 0.25, 9)
        m.heard_from("a", t, heartbeat=True)
        _, deaths = m.tick(t)
        dead_at = t if any(d.name == "b" for d in deaths) else None
    assert dead_at == pytest.approx(19.25)  # its last word at 14.05, then 3 + 2 s


def test_silence_shared_by_several_members_is_waited_out_once_more() -> None:
    m = make()
    m.register(name="c", routing_id=b"c", data_endpoint="e", info={}, public_key=None, now=0.5)
    m.heard_from("a", 1.0)
    m.heard_from("b", 1.0)
    dead: dict[str, float] = {}
    t = 1.0
    while t < 20 and len(dead) < 2:
        t = round(t + 0.25, 9)
        m.heard_from("c", t)  # c keeps talking; a and b fall silent together at 1.0
        _, deaths = m.tick(t)
        dead.update({d.name: t for d in deaths})
    # alone, each would be dead after 3 + 2 s; silent together, after 3 + 2 + 3 s
    assert dead == {"a": pytest.approx(9.0), "b": pytest.approx(9.0)}
    assert m.get("c").state is MemberState.ALIVE  # type: ignore[union-attr]


def test_routing_ids_follow_registrations_and_deaths() -> None:
    m = make()
    assert m.by_routing_id(b"a") is m.get("a")
    m.register(
        name="a", routing_id=b"a2", data_endpoint="tcp://h:3", info={}, public_key=None, now=9.0
    )
    assert m.by_routing_id(b"a") is None  # the old connection speaks for nobody now
    assert m.by_routing_id(b"a2") is m.get("a")
    m.declare_dead("b", "test", 10.0)
    assert m.by_routing_id(b"b") is None
    assert [x.name for x in m.live()] == ["a"]


def test_hundreds_of_members_one_silent_only_it_is_suspected_and_declared_dead() -> None:
    m = Membership(heartbeat_interval_s=1.0, suspect_after_intervals=3, probe_intervals=2)
    for i in range(300):
        m.register(
            name=f"p{i}", routing_id=f"p{i}".encode(), data_endpoint="tcp://h:1", info={},
            public_key=None, now=0.0,
        )  # fmt: skip
    probed: list[str] = []
    dead: list[str] = []
    t = 0.0
    while t < 12:
        t += 0.25
        if t == int(t):  # a heartbeat a second from everyone but p7
            for i in range(300):
                if i != 7:
                    m.heard_from(f"p{i}", t, heartbeat=True)
        probes, deaths = m.tick(t)
        probed += [p.name for p in probes]
        dead += [d.name for d in deaths]
    assert probed == ["p7"]
    assert dead == ["p7"]


def test_a_member_whose_connection_is_gone_is_suspect_at_once_and_probed() -> None:
    m = make()
    due = m.connection_lost("a", 0.2, routing_id=b"a")
    assert due is not None and due.name == "a"
    member = m.get("a")
    assert member is not None and member.state is MemberState.SUSPECT and member.unreachable
    assert m.connection_lost("a", 0.3) is None  # its probe is out already
    # not dead before it was silent for its suspect deadline, however the probe went
    m.heard_from("b", 2.5)
    _, deaths = m.tick(2.5)
    assert deaths == []
    m.heard_from("b", 3.1)
    _, deaths = m.tick(3.1)
    assert [d.name for d in deaths] == ["a"] and "connection gone" in deaths[0].reason


def test_a_member_that_reconnects_after_its_connection_dropped_is_alive_again() -> None:
    m = make()
    m.connection_lost("a", 0.2)
    assert m.heard_from("a", 0.8, heartbeat=True)
    member = m.get("a")
    assert member is not None and member.state is MemberState.ALIVE and not member.unreachable
    _, deaths = m.tick(3.5)
    assert deaths == []


def test_a_send_that_failed_on_an_older_connection_leaves_the_new_one_alone() -> None:
    m = make()
    m.register(
        name="a", routing_id=b"a#2", data_endpoint="tcp://h:9", info={}, public_key=None, now=3.5
    )
    assert m.connection_lost("a", 3.6, routing_id=b"a") is None
    member = m.get("a")
    assert member is not None and member.state is MemberState.ALIVE and not member.unreachable


def test_a_pause_of_the_coordinator_itself_does_not_run_out_a_probe() -> None:
    m = make()  # interval 1, suspect after 3, probe for 2
    for t in range(1, 6):
        m.heard_from("a", float(t), heartbeat=True)
        m.heard_from("b", float(t), heartbeat=True)
        assert m.tick(float(t)) == ([], [])
    probes: list[object] = []
    t = 5.0
    while not probes:  # b stops after 5: suspected and probed 3 s later
        t = round(t + 0.25, 9)
        m.heard_from("a", t, heartbeat=True)
        probes, _ = m.tick(t)
    # right after the probe went out this process paused for 5 s (the run kinds' first
    # import, on its loop): b's answer is queued, unread; the pause runs out no probe
    _, deaths = m.tick(t + 5.0)
    assert deaths == []
    # and a b that never answers is still found dead, its probe's time after the pause
    dead_at = None
    t += 5.0
    while dead_at is None and t < 40:
        t = round(t + 0.25, 9)
        m.heard_from("a", t, heartbeat=True)
        _, deaths = m.tick(t)
        dead_at = t if any(d.name == "b" for d in deaths) else None
    assert dead_at is not None and dead_at < t + 1
