"""Replication topologies: Asteroid's topology-driven backups, FTPipeHD's chain + global."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zpipe._errors import ConfigError
from zpipe.planner.plan import plan_from_partition
from zpipe.recovery.errors import WeightsLostError
from zpipe.recovery.redistribution import Replica, Transfer, plan_redistribution
from zpipe.recovery.replanning import lightweight_replan
from zpipe.recovery.replication import (
    ReplicaSend,
    ReplicationSchedule,
    asteroid_replication,
    ftpipehd_replication,
    plan_replication,
)
from zpipe.recovery.spans import COORDINATOR, StageSpan

# Asteroid Fig. 9: single-device stages A and D, multi-device stages B and C.
FIG9 = [
    StageSpan(("A",), 0, 3),
    StageSpan(("B1", "B2"), 3, 6),
    StageSpan(("C1", "C2"), 6, 9),
    StageSpan(("D",), 9, 12),
]


def test_asteroid_single_device_stages_back_up_to_the_next_stage_and_the_last_to_the_first():
    schedule = asteroid_replication(FIG9, every=20)
    assert [(s.source, s.dest, s.start, s.end) for s in schedule.sends] == [
        ("A", "B1", 0, 3),
        ("D", "A", 9, 12),
    ]
    assert all(s.kind == "backup" and s.every == 20 for s in schedule.sends)
    assert schedule.duties_of("A") == [schedule.sends[0]]
    assert schedule.received_by("A") == [schedule.sends[1]]


def test_asteroid_lone_device_backs_up_to_the_coordinator():
    schedule = asteroid_replication([StageSpan(("solo",), 0, 4)])
    assert [(s.source, s.dest) for s in schedule.sends] == [("solo", COORDINATOR)]


def test_asteroid_fig9_d_fails_and_its_units_come_back_from_a():
    plan = plan_from_partition(12, ["A", "B", "C", "D"], [[0, 3], [3, 6], [6, 9], [9, 12]])
    schedule = asteroid_replication(plan, every=50)
    replicas = schedule.replicas_after(120)
    assert Replica("A", 9, 12, 100) in replicas
    new = lightweight_replan(plan, failed={"D"}, unit_work=[1.0] * 12)
    r = plan_redistribution(plan, new, failed={"D"}, live_version=120, replicas=replicas)
    lost_units = {u for t in r.transfers if t.version == 100 for u in range(t.start, t.end)}
    assert lost_units >= {9, 10, 11}
    assert {t.source for t in r.transfers if t.version == 100} == {"A"}


def test_ftpipehd_chain_goes_to_the_next_stage_and_the_last_to_the_coordinator():
    plan = plan_from_partition(6, ["w0", "w1", "w2"], [[0, 2], [2, 4], [4, 6]])
    schedule = ftpipehd_replication(plan)
    chain = [(s.source, s.dest) for s in schedule.sends if s.kind == "chain"]
    glob = [(s.source, s.dest) for s in schedule.sends if s.kind == "global"]
    assert chain == [("w0", "w1"), ("w1", "w2"), ("w2", COORDINATOR)]
    assert glob == [("w0", COORDINATOR), ("w1", COORDINATOR), ("w2", COORDINATOR)]
    assert {s.kind for s in schedule.sends_at(50)} == {"chain"}
    assert {s.kind for s in schedule.sends_at(100)} == {"chain", "global"}
    assert schedule.sends_at(0) == [] and schedule.sends_at(149) == []
    assert len(schedule.sends_at(150)) == 3


def test_group_stages_send_from_one_member():
    schedule = ftpipehd_replication(FIG9, chain_every=5, global_every=10)
    assert [s.source for s in schedule.sends if s.kind == "chain"] == ["A", "B1", "C1", "D"]
    assert [s.dest for s in schedule.sends if s.kind == "chain"] == ["B1", "C1", "D", COORDINATOR]


def test_replicas_after_keep_the_newest_copy_of_each_send():
    plan = plan_from_partition(4, ["a", "b"], [[0, 2], [2, 4]])
    schedule = ftpipehd_replication(plan, chain_every=50, global_every=100)
    assert schedule.replicas_after(49) == []
    after = schedule.replicas_after(170)
    assert Replica("b", 0, 2, 150) in after and Replica(COORDINATOR, 0, 2, 100) in after
    with_copies = schedule.replicas_after(170, senders_keep_copy=True)
    assert Replica("a", 0, 2, 150) in with_copies and len(with_copies) == 2 * len(after)


def test_last_replicated_is_the_newest_version_every_unit_has():
    plan = plan_from_partition(6, ["w0", "w1", "w2"], [[0, 2], [2, 4], [4, 6]])
    schedule = ftpipehd_replication(plan)
    assert schedule.last_replicated(40) is None
    assert schedule.last_replicated(130) == 100
    assert schedule.last_replicated(170) == 150
    # At the coordinator alone: the last stage's chain copy is at 150, the rest only at 100.
    assert schedule.last_replicated(170, to=COORDINATOR) == 100
    # A 3-period and a 2-period send covering different units share only multiples of 6.
    odd = ReplicationSchedule(
        "ftpipehd",
        (
            ReplicaSend("chain", "a", "b", 0, 1, 3),
            ReplicaSend("chain", "b", COORDINATOR, 1, 2, 2),
        ),
    )
    assert odd.last_replicated(7) == 6
    assert odd.last_replicated(8) is None  # unit 0 is at 6, unit 1 only at 8: no common version
    assert odd.last_replicated(13) == 12


def test_bad_periods_and_topologies_are_config_errors():
    plan = plan_from_partition(4, ["a", "b"], [[0, 2], [2, 4]])
    with pytest.raises(ConfigError, match="chain_every"):
        ftpipehd_replication(plan, chain_every=0)
    with pytest.raises(ConfigError, match="every"):
        asteroid_replication(plan, every=True)
    with pytest.raises(ConfigError, match="topology"):
        plan_replication(plan, "raid")
    with pytest.raises(ConfigError, match="global_every"):
        plan_replication(plan, "ftpipehd", global_every=None)
    with pytest.raises(ConfigError, match="topology"):
        ReplicationSchedule.from_dict({"topology": "raid", "sends": []})


def test_round_trip_through_dict():
    schedule = plan_replication(FIG9, "ftpipehd", every=7, global_every=21)
    assert ReplicationSchedule.from_dict(schedule.to_dict()) == schedule
    with pytest.raises(ConfigError, match="malformed"):
        ReplicationSchedule.from_dict({"topology": "asteroid", "sends": [{"kind": "backup"}]})


# -- what each topology survives ---------------------------------------------------------


@st.composite
def straight_plans(draw):
    n = draw(st.integers(2, 10))
    k = draw(st.integers(2, min(5, n)))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), min_size=k - 1, max_size=k - 1)))
    bounds = [0, *cuts, n]
    return plan_from_partition(n, [f"w{i}" for i in range(k)], list(itertools.pairwise(bounds)))


def _recover(plan, failed, replicas):
    new = lightweight_replan(plan, failed=failed, unit_work=[1.0] * plan.num_units)
    return plan_redistribution(plan, new, failed=failed, live_version=75, replicas=replicas)


@settings(max_examples=40, deadline=None)
@given(straight_plans(), st.data())
def test_any_single_failure_is_recoverable_under_either_topology(plan, data):
    victim = data.draw(st.sampled_from(plan.devices))
    for schedule in (asteroid_replication(plan, every=50), ftpipehd_replication(plan)):
        r = _recover(plan, {victim}, schedule.replicas_after(75))
        assert victim not in {t.source for t in r.transfers}


@settings(max_examples=40, deadline=None)
@given(straight_plans(), st.data())
def test_the_global_replica_covers_any_number_of_failures(plan, data):
    failed = set(data.draw(st.lists(st.sampled_from(plan.devices), min_size=1, unique=True)))
    if failed == set(plan.devices):
        failed.discard(plan.devices[0])
    schedule = ftpipehd_replication(plan)
    _recover(plan, failed, schedule.replicas_after(100))  # does not raise


def test_two_neighbours_failing_before_the_first_global_replica_lose_weights():
    plan = plan_from_partition(6, ["w0", "w1", "w2"], [[0, 2], [2, 4], [4, 6]])
    schedule = ftpipehd_replication(plan)
    with pytest.raises(WeightsLostError, match="units 2-3"):
        _recover(plan, {"w1", "w2"}, schedule.replicas_after(75))


def test_a_group_lost_whole_needs_asteroids_complementary_global_replica():
    old = FIG9
    new = [StageSpan(("A",), 0, 6), StageSpan(("C1", "C2"), 6, 9), StageSpan(("D",), 9, 12)]
    failed = {"B1", "B2"}
    plain = asteroid_replication(old, every=10).replicas_after(25)
    with pytest.raises(WeightsLostError, match="units 3-5"):
        plan_redistribution(old, new, failed=failed, live_version=25, replicas=plain)
    covered = asteroid_replication(old, every=10, global_every=20).replicas_after(25)
    r = plan_redistribution(old, new, failed=failed, live_version=25, replicas=covered)
    assert r.fetches_of("A") == [Transfer("A", COORDINATOR, 3, 6, 20)]
    # One member lost: the survivor holds the group's units, nobody fetches anything.
    one = [StageSpan(("A",), 0, 3), StageSpan(("B2",), 3, 6), *new[1:]]
    r = plan_redistribution(old, one, failed={"B1"}, live_version=25, replicas=plain)
    assert r.transfers == ()
