"""Weight redistribution (FTPipeHD Algorithm 1): the fewest transfers, from live holders."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from zpipe._errors import ConfigError
from zpipe.planner.plan import plan_from_partition
from zpipe.recovery.errors import WeightsLostError, format_units
from zpipe.recovery.redistribution import (
    Redistribution,
    Replica,
    Transfer,
    own_replicas,
    plan_redistribution,
)
from zpipe.recovery.spans import COORDINATOR, StageSpan

POOL = [f"d{i}" for i in range(7)]


def spans(*stages: tuple[tuple[str, ...], int, int]) -> list[StageSpan]:
    return [StageSpan(devs, a, b) for devs, a, b in stages]


# -- examples from the paper -----------------------------------------------------------------


def test_middle_worker_fails_and_its_units_come_from_the_chain_replica_on_the_next():
    # FTPipeHD Fig. 3(a): w1 fails; its chain replica (after batch 200) sits on w2.
    old = plan_from_partition(9, ["w0", "w1", "w2"], [[0, 3], [3, 6], [6, 9]])
    new = plan_from_partition(9, ["w0", "w2"], [[0, 5], [5, 9]])
    chain = [Replica("w1", 0, 3, 200), Replica("w2", 3, 6, 200), Replica(COORDINATOR, 6, 9, 200)]
    r = plan_redistribution(old, new, failed={"w1"}, live_version=205, replicas=chain)
    assert r.transfers == (Transfer("w0", "w2", 3, 5, 200),)
    # w2 keeps its own units at 205 and its chain copy of unit 5 at 200: nothing to fetch.
    assert r.fetches_of("w2") == []
    assert [(k.start, k.end, k.version) for k in r.kept_of("w2")] == [(5, 6, 200), (6, 9, 205)]
    assert [(k.start, k.end, k.version) for k in r.kept_of("w0")] == [(0, 3, 205)]
    assert r.serves_of("w2") == [Transfer("w0", "w2", 3, 5, 200)]
    assert r.units_moved == 2


def test_last_worker_fails_and_its_units_come_from_the_coordinator():
    old = plan_from_partition(6, ["w0", "w1", "w2"], [[0, 2], [2, 4], [4, 6]])
    new = plan_from_partition(6, ["w0", "w1"], [[0, 3], [3, 6]])
    chain = [Replica("w1", 0, 2, 50), Replica("w2", 2, 4, 50), Replica(COORDINATOR, 4, 6, 50)]
    r = plan_redistribution(old, new, failed={"w2"}, live_version=60, replicas=chain)
    assert r.fetches_of("w0") == [Transfer("w0", "w1", 2, 3, 60)]
    assert r.fetches_of("w1") == [Transfer("w1", COORDINATOR, 4, 6, 50)]


def test_a_neighbour_is_preferred_to_the_coordinator_at_the_same_version():
    old = spans((("a",), 0, 2), (("b",), 2, 4), (("c",), 4, 6))
    new = spans((("a",), 0, 3), (("c",), 3, 6))
    replicas = [Replica("c", 2, 4, 100), Replica(COORDINATOR, 0, 6, 100)]
    r = plan_redistribution(old, new, failed={"b"}, live_version=100, replicas=replicas)
    assert {t.source for t in r.transfers} == {"c"}


def test_a_newer_version_at_the_coordinator_beats_an_older_neighbour_copy():
    old = spans((("a",), 0, 2), (("b",), 2, 4), (("c",), 4, 6))
    new = spans((("a",), 0, 3), (("c",), 3, 6))
    replicas = [Replica("c", 2, 4, 50), Replica(COORDINATOR, 2, 4, 100)]
    r = plan_redistribution(old, new, failed={"b"}, live_version=120, replicas=replicas)
    assert r.fetches_of("a") == [Transfer("a", COORDINATOR, 2, 3, 100)]
    # c holds unit 3 at 50 only: it fetches the newer copy although it has an old one.
    assert r.fetches_of("c") == [Transfer("c", COORDINATOR, 3, 4, 100)]


def test_group_members_restore_from_a_surviving_member():
    old = spans((("a", "b"), 0, 3), (("c",), 3, 5))
    new = spans((("b", "x"), 0, 3), (("c",), 3, 5))  # a died; x joins b's group
    r = plan_redistribution(old, new, failed={"a"}, live_version=7)
    assert r.transfers == (Transfer("x", "b", 0, 3, 7),)


def test_exact_consistency_fetches_the_replicated_version_even_over_newer_own_weights():
    old = spans((("a",), 0, 2), (("b",), 2, 4))
    new = spans((("a",), 0, 4))
    replicas = [Replica(COORDINATOR, 0, 4, 100), Replica("a", 0, 2, 100)]  # a kept a snapshot
    r = plan_redistribution(
        old, new, failed={"b"}, live_version=130, replicas=replicas, version=100
    )
    assert [(k.start, k.end, k.version) for k in r.kept_of("a")] == [(0, 2, 100)]
    assert r.fetches_of("a") == [Transfer("a", COORDINATOR, 2, 4, 100)]


def test_units_nobody_holds_are_named():
    old = spans((("a",), 0, 2), (("b",), 2, 4), (("c",), 4, 7))
    new = spans((("a",), 0, 7))
    with pytest.raises(WeightsLostError, match=r"units 2-3, 6 ") as info:
        plan_redistribution(
            old, new, failed={"b", "c"}, live_version=1, replicas=[Replica("a", 4, 6, 0)]
        )
    assert info.value.units == (2, 3, 6)


def test_exact_version_missing_is_lost_even_when_newer_weights_exist():
    old = spans((("a",), 0, 2), (("b",), 2, 4))
    with pytest.raises(WeightsLostError, match="version 100"):
        plan_redistribution(old, old, failed=(), live_version=130, version=100)


def test_a_failed_device_in_the_new_plan_is_a_config_error():
    old = spans((("a",), 0, 2), (("b",), 2, 4))
    with pytest.raises(ConfigError, match="'b', which failed"):
        plan_redistribution(old, old, failed={"b"}, live_version=1)


def test_round_trip_through_dict():
    old = spans((("a",), 0, 2), (("b",), 2, 4))
    new = spans((("b",), 0, 1), (("a",), 1, 4))
    r = plan_redistribution(old, new, failed=(), live_version=3)
    assert Redistribution.from_dict(r.to_dict()) == r
    assert r.bytes_moved([10, 20, 30, 40]) == 10 + 30 + 40
    with pytest.raises(ConfigError, match="malformed"):
        Redistribution.from_dict({"transfers": [{"dest": "a"}], "kept": []})


def test_format_units_collapses_runs():
    assert format_units([7, 0, 1, 2, 5, 8]) == "0-2, 5, 7-8"


# -- properties over random partitions ---------------------------------------------------


@st.composite
def partitions(draw, num_units: int, devices: list[str], max_group: int):
    """A random contiguous partition of ``num_units`` over some of ``devices`` in groups."""
    pool = draw(st.permutations(devices))
    k = draw(st.integers(1, min(num_units, len(pool))))
    cuts: list[int] = []
    if k > 1:
        cuts = sorted(draw(st.sets(st.integers(1, num_units - 1), min_size=k - 1, max_size=k - 1)))
    bounds = [0, *cuts, num_units]
    out, i = [], 0
    for j in range(k):
        left = len(pool) - i - (k - j - 1)
        size = draw(st.integers(1, max(1, min(max_group, left))))
        out.append(StageSpan(tuple(pool[i : i + size]), bounds[j], bounds[j + 1]))
        i += size
    return out


@st.composite
def scenarios(draw):
    n = draw(st.integers(1, 10))
    old = draw(partitions(n, POOL, 2))
    old_devices = [d for s in old for d in s.devices]
    failed = draw(st.sets(st.sampled_from(old_devices)))
    alive = [d for d in POOL if d not in failed]
    if not alive:
        alive = [old_devices[0]]
        failed = failed - {old_devices[0]}
    new = draw(partitions(n, alive, 2))
    live = draw(st.integers(10, 20))
    holders = [*POOL, COORDINATOR]
    replicas = []
    for _ in range(draw(st.integers(0, 6))):
        a = draw(st.integers(0, n - 1))
        b = draw(st.integers(a + 1, n))
        replicas.append(Replica(draw(st.sampled_from(holders)), a, b, draw(st.integers(0, live))))
    if draw(st.booleans()):
        replicas.append(Replica(COORDINATOR, 0, n, draw(st.integers(0, live))))
    return old, new, failed, live, replicas


def _inventory(old, failed, live, replicas) -> dict[int, dict[int, set[str]]]:
    """Unit -> version -> live holders, computed independently of the module."""
    inv: dict[int, dict[int, set[str]]] = {}
    everything = own_replicas(old, live) + list(replicas)
    for r in everything:
        if r.holder in failed:
            continue
        for u in range(r.start, r.end):
            inv.setdefault(u, {}).setdefault(r.version, set()).add(r.holder)
    return inv


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.booleans())
def test_every_needed_unit_is_fetched_once_from_a_live_holder_and_the_count_is_minimal(
    scenario, exact
):
    old, new, failed, live, replicas = scenario
    inv = _inventory(old, failed, live, replicas)
    n = old[-1].end
    version = None
    if exact:
        version = max((v for r in replicas for v in [r.version]), default=live)
    if version is None:
        wanted = {u: max(inv[u]) for u in range(n) if u in inv}
    else:
        wanted = {u: version for u in range(n) if version in inv.get(u, {})}
    lost = sorted(set(range(n)) - set(wanted))
    event("units lost" if lost else "redistributed")
    if lost:
        with pytest.raises(WeightsLostError) as info:
            plan_redistribution(
                old, new, failed=failed, live_version=live, replicas=replicas, version=version
            )
        assert info.value.units == tuple(lost)
        return
    r = plan_redistribution(
        old, new, failed=failed, live_version=live, replicas=replicas, version=version
    )
    needed = {(d, u) for s in new for d in s.devices for u in range(s.start, s.end)}
    fetched: dict[tuple[str, int], int] = {}
    for t in r.transfers:
        assert t.source not in failed and t.source != t.dest
        for u in range(t.start, t.end):
            assert t.version == wanted[u]
            assert t.source in inv[u][t.version], "fetched from a device that lacks the unit"
            assert t.dest not in inv[u][t.version], "moved a unit the device already held"
            fetched[t.dest, u] = fetched.get((t.dest, u), 0) + 1
    kept = {(k.device, u) for k in r.kept for u in range(k.start, k.end)}
    for k in r.kept:
        for u in range(k.start, k.end):
            assert k.version == wanted[u] and k.device in inv[u][k.version]
    assert all(count == 1 for count in fetched.values()), "a unit fetched twice"
    assert set(fetched) | kept == needed and not set(fetched) & kept
    minimum = sum(1 for d, u in needed if d not in inv[u][wanted[u]])
    assert r.units_moved == minimum
    # A holder other than the coordinator is used whenever one has the wanted version.
    for t in r.transfers:
        if t.source == COORDINATOR:
            for u in range(t.start, t.end):
                assert inv[u][t.version] <= {COORDINATOR, t.dest}
