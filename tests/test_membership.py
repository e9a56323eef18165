"""The membership state machine, driven with plain numbers for time."""

from __future__ import annotations

import pytest

from zpipe._errors import ConfigError
from zpipe.coordinator.membership import Membership, MemberState


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
