"""Restoring from chain and global copies at once, and heavy recovery's moves."""

from __future__ import annotations

import pytest

from zpipe._errors import ConfigError
from zpipe.recovery import (
    COORDINATOR,
    Replica,
    ReplicaPoint,
    StageSpan,
    WeightsLostError,
    heavy_restore,
    plan_redistribution,
    plan_restore,
    replicas_due,
)

# a b c d, two units each
OLD = [
    StageSpan(("a",), 0, 2),
    StageSpan(("b",), 2, 4),
    StageSpan(("c",), 4, 6),
    StageSpan(("d",), 6, 8),
]


def _chain_point(version: int, *, with_global: bool = False) -> ReplicaPoint:
    # each stage backs up to the next, the last to the coordinator
    copies = [
        Replica("b", 0, 2, version),
        Replica("c", 2, 4, version),
        Replica("d", 4, 6, version),
        Replica(COORDINATOR, 6, 8, version),
    ]
    if with_global:
        copies.append(Replica(COORDINATOR, 0, 8, version))
    return ReplicaPoint(version, OLD, tuple(copies), own_snapshots=True)


def _global_point(version: int) -> ReplicaPoint:
    return ReplicaPoint(version, OLD, (Replica(COORDINATOR, 0, 8, version),), own_snapshots=False)


def test_one_failure_restores_from_the_chain_point_own_copies_and_the_neighbours_backup() -> None:
    new = [StageSpan(("a",), 0, 3), StageSpan(("c",), 3, 6), StageSpan(("d",), 6, 8)]
    restore = plan_restore(new, failed={"b"}, points=[_chain_point(6), _global_point(4)])
    assert restore.index == 0 and restore.point.version == 6
    moves = restore.moves
    # b's units come from c's backup of them: a takes unit 2, c keeps unit 3 locally
    assert {(t.dest, t.source, t.start, t.end) for t in moves.transfers} == {("a", "c", 2, 3)}
    assert all(t.source != COORDINATOR for t in moves.transfers)
    kept = {(k.device, k.start, k.end) for k in moves.kept}
    assert kept == {("a", 0, 2), ("c", 3, 6), ("d", 6, 8)}


def test_two_adjacent_failures_fall_back_to_the_global_copy() -> None:
    new = [StageSpan(("a",), 0, 4), StageSpan(("d",), 4, 8)]
    points = [_chain_point(6), _global_point(4)]
    with pytest.raises(WeightsLostError):
        # the chain copies alone: b's units were backed up at c, which died with it
        plan_restore(new, failed={"b", "c"}, points=points[:1])
    restore = plan_restore(new, failed={"b", "c"}, points=points)
    assert restore.index == 1 and restore.point.version == 4
    # the global point leaves nothing at the stages: every unit from the coordinator
    assert restore.moves.kept == ()
    assert {(t.dest, t.source, t.start, t.end, t.version) for t in restore.moves.transfers} == {
        ("a", COORDINATOR, 0, 4, 4),
        ("d", COORDINATOR, 4, 8, 4),
    }


def test_a_global_copy_at_the_chain_step_is_used_only_for_what_no_device_holds() -> None:
    new = [StageSpan(("a",), 0, 4), StageSpan(("d",), 4, 8)]
    restore = plan_restore(new, failed={"b", "c"}, points=[_chain_point(6, with_global=True)])
    assert restore.index == 0
    sources = {(t.dest, t.source, t.start, t.end) for t in restore.moves.transfers}
    # d kept c's backup of units 4-5 and its own 6-7; b's units (c held their backup)
    # only the coordinator has
    assert sources == {("a", COORDINATOR, 2, 4)}
    assert {(k.device, k.start, k.end) for k in restore.moves.kept} == {
        ("a", 0, 2),
        ("d", 4, 8),
    }


def test_no_point_covers_units_whose_every_holder_failed() -> None:
    new = [StageSpan(("a",), 0, 4), StageSpan(("d",), 4, 8)]
    with pytest.raises(WeightsLostError) as caught:
        plan_restore(new, failed={"b", "c"}, points=[_chain_point(6)])
    assert caught.value.units == (2, 3)
    with pytest.raises(ConfigError):
        plan_restore(new, failed={"b"}, points=[])


def test_without_own_copies_the_old_devices_hold_nothing() -> None:
    new = [StageSpan(("a",), 0, 4), StageSpan(("c",), 4, 6), StageSpan(("d",), 6, 8)]
    copies = [Replica(COORDINATOR, 0, 8, 4)]
    with_own = plan_redistribution(OLD, new, failed={"b"}, live_version=4, replicas=copies)
    without = plan_redistribution(
        OLD, new, failed={"b"}, live_version=4, replicas=copies, own_copies=False
    )
    assert with_own.units_moved == 2  # b's units only
    assert without.units_moved == 8 and without.kept == ()


def test_heavy_restore_gathers_every_unit_then_sends_every_device_all_of_its_own() -> None:
    new = [StageSpan(("a",), 0, 3), StageSpan(("c",), 3, 6), StageSpan(("d",), 6, 8)]
    point = _chain_point(6)
    heavy = heavy_restore(new, failed={"b"}, point=point)
    light = plan_restore(new, failed={"b"}, points=[point]).moves
    # the coordinator already holds d's backup (units 6-7): those are not gathered
    assert {(t.source, t.start, t.end) for t in heavy.gather} == {
        ("a", 0, 2),
        ("c", 2, 6),  # b's from c's backup, then c's own
    }
    assert all(t.dest == COORDINATOR for t in heavy.gather)
    assert {(t.dest, t.start, t.end) for t in heavy.scatter} == {
        ("a", 0, 3),
        ("c", 3, 6),
        ("d", 6, 8),
    }
    sizes = [10] * 8
    assert heavy.bytes_moved(sizes) == (6 + 8) * 10
    assert light.bytes_moved(sizes) == 10
    with pytest.raises(WeightsLostError):
        heavy_restore(new, failed={"b", "c"}, point=point)


@pytest.mark.parametrize(
    ("step", "chain_every", "global_every", "due"),
    [
        (0, 2, 4, (True, True)),
        (2, 2, 4, (True, False)),
        (4, 2, 4, (True, True)),
        (3, 2, 4, (False, False)),
        (3, 3, None, (True, False)),
        (6, None, 3, (False, True)),
    ],
)
def test_chain_and_global_replication_are_due_at_their_own_periods(
    step: int, chain_every: int | None, global_every: int | None, due: tuple[bool, bool]
) -> None:
    assert replicas_due(step, chain_every=chain_every, global_every=global_every) == due


def test_replica_periods_are_checked() -> None:
    with pytest.raises(ConfigError):
        replicas_due(1, chain_every=0, global_every=None)
    with pytest.raises(ConfigError):
        replicas_due(-1, chain_every=1, global_every=None)
