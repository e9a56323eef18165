"""FTPipeHD's fast-consistency recovery of an asynchronous run, the pure decision
(zpipe.recovery.fast_recovery): plans, ledgers and deaths in, the recovery plan out."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zpipe._errors import ConfigError
from zpipe.planner.ftpipehd import ftpipehd_partition
from zpipe.recovery.errors import RecoveryError
from zpipe.recovery.fast_recovery import (
    FastRecoveryPlan,
    freshest_copy,
    plan_fast_recovery,
)
from zpipe.recovery.live_copies import CopyLedger, CopyRecord, chain_holder
from zpipe.recovery.spans import COORDINATOR, StageSpan

# a | b | c | d, two units each
SPANS = [StageSpan((d,), 2 * i, 2 * i + 2) for i, d in enumerate("abcd")]
ORDER = ["a", "b", "c", "d"]
UNIT_S = [1.0] * 8
# the first stage is the last to apply a mini-batch's update: later stages are ahead
UPDATES = {"a": 160, "b": 161, "c": 162, "d": 163}


def ledger_of(spans: list[StageSpan], *, chain: int | None, glob: int | None) -> CopyLedger:
    """Every stage's completed chain copy (at ``chain``) and global copy (at ``glob``)."""
    order = [s.devices[0] for s in spans]
    ledger = CopyLedger()
    for s in spans:
        owner = s.devices[0]
        if chain is not None:
            holder = chain_holder(order, owner)
            ledger.record(CopyRecord(owner, "chain", holder, 0, chain, s.start, s.end))
        if glob is not None:
            ledger.record(CopyRecord(owner, "global", COORDINATOR, 0, glob, s.start, s.end))
    return ledger


def recover(dead: list[str], ledger: CopyLedger, **kw: object) -> FastRecoveryPlan:
    args: dict[str, object] = {
        "ledger": ledger,
        "updates": {d: n for d, n in UPDATES.items() if d not in dead},
        "acknowledged": 160,
        "reference_unit_s": UNIT_S,
    }
    args.update(kw)
    return plan_fast_recovery(SPANS, dead, **args)  # type: ignore[arg-type]


def test_one_death_restores_its_units_from_the_chain_copy_at_the_next_stage() -> None:
    plan = recover(["b"], ledger_of(SPANS, chain=150, glob=100))
    assert plan.order == ("a", "c", "d") and plan.dead == ("b",)
    assert plan.resume_at == 160  # the first mini-batch the client did not acknowledge
    by_unit = {s.unit: s for s in plan.sources}
    assert sorted(by_unit) == list(range(8))
    for u in (2, 3):
        s = by_unit[u]
        assert (s.kind, s.source, s.version, s.lost, s.reapplied) == ("chain", "c", 150, 10, 0)
    assert plan.copies_used() == {"chain@c": [2, 3]}
    assert plan.max_lost == 10


def test_survivors_keep_their_own_units_untouched_at_their_own_versions() -> None:
    plan = recover(["b"], ledger_of(SPANS, chain=150, glob=100))
    held = {"a": {0, 1}, "c": {4, 5}, "d": {6, 7}}
    for s in plan.sources:
        if s.unit in held.get(s.dest, set()):
            # what a survivor held and still runs is kept, never fetched
            assert (s.kind, s.source, s.version) == ("kept", s.dest, UPDATES[s.dest])
            assert s.lost == 0 and s.reapplied == UPDATES[s.dest] - 160
        elif s.kind == "peer":
            assert s.unit in held[s.source] and s.version == UPDATES[s.source]
    kept = [s for s in plan.sources if s.kind == "kept"]
    assert kept and all(s not in plan.fetches() for s in kept)


def test_the_survivors_cuts_are_eq5s_over_their_capacities_in_their_order() -> None:
    caps = {"a": 1.0, "c": 3.0, "d": 1.0}
    plan = recover(["b"], ledger_of(SPANS, chain=150, glob=100), capacities=caps)
    expected = ftpipehd_partition(UNIT_S, capacities=[1.0, 3.0, 1.0])
    assert plan.bounds == expected.bounds and plan.period_s == expected.period_s
    assert plan.bounds[2] - plan.bounds[1] < 2  # the slow survivor gets fewer units
    # a unit that changes survivor moves peer to peer from the one that holds it
    for s in plan.sources:
        if s.kind == "peer":
            assert s.source in ("a", "c", "d") and s.source != s.dest


def test_a_slow_link_between_new_neighbours_moves_the_cut() -> None:
    spans = [StageSpan(("a",), 0, 2), StageSpan(("b",), 2, 3), StageSpan(("c",), 3, 4)]
    ledger = ledger_of(spans, chain=10, glob=10)
    common = {
        "ledger": ledger,
        "updates": {"a": 10, "c": 10},
        "acknowledged": 10,
        "reference_unit_s": [1.0] * 4,
    }
    free = plan_fast_recovery(spans, ["b"], **common)  # type: ignore[arg-type]
    assert free.bounds == (0, 2, 4)
    # unit 1's output crosses the a-c link if the cut stays after it: 2 * 10 B / 1 B/s
    slow = plan_fast_recovery(
        spans,
        ["b"],
        output_bytes=[0.0, 10.0, 0.0, 0.0],
        bandwidths_bps={("c", "a"): 1.0},  # either direction's entry serves the pair
        **common,  # type: ignore[arg-type]
    )
    assert slow.bounds != (0, 2, 4) and slow.period_s == 3.0
    fast = plan_fast_recovery(
        spans,
        ["b"],
        output_bytes=[0.0, 10.0, 0.0, 0.0],
        bandwidths_bps={("a", "c"): 1e6},
        **common,  # type: ignore[arg-type]
    )
    assert fast.bounds == (0, 2, 4)
    with pytest.raises(ConfigError, match="no bandwidth between 'a' and 'c'"):
        plan_fast_recovery(spans, ["b"], bandwidths_bps={("a", "b"): 1.0}, **common)  # type: ignore[arg-type]


def test_a_survivors_own_cost_per_batch_counts_in_eq5() -> None:
    plan = recover(["b"], ledger_of(SPANS, chain=150, glob=100), fixed_s={"c": 2.0})
    expected = ftpipehd_partition(UNIT_S, capacities=[1.0] * 3, fixed_s=[0.0, 2.0, 0.0])
    assert plan.bounds == expected.bounds != (0, 2, 5, 8)


def test_a_dead_stages_unit_may_come_from_its_previous_owners_copy() -> None:
    # b held unit 2 and c units 3-5 when they copied at 100 (chain copies at c and
    # d); a committed move then gave unit 3 to b, which died before its next copy:
    # unit 3's newest completed copy is c's, held at d
    ledger = CopyLedger()
    ledger.record(CopyRecord("b", "chain", "c", 0, 100, 2, 3))
    ledger.record(CopyRecord("c", "chain", "d", 0, 100, 3, 6))
    plan = recover(["b"], ledger, acknowledged=120, updates={"a": 120, "c": 121, "d": 122})
    by_unit = {s.unit: (s.kind, s.source, s.version, s.lost) for s in plan.sources}
    assert by_unit[2] == ("chain", "c", 100, 20)
    assert by_unit[3] == ("chain", "d", 100, 20)
    assert plan.copies_used() == {"chain@c": [2], "chain@d": [3]}


def test_two_adjacent_deaths_restore_the_first_from_the_global_copy() -> None:
    plan = recover(["b", "c"], ledger_of(SPANS, chain=150, glob=100))
    by_unit = {s.unit: s for s in plan.sources}
    # b's chain copy died with c: the coordinator's global copy; c's chain copy is at d
    for u in (2, 3):
        assert (by_unit[u].kind, by_unit[u].source, by_unit[u].version) == (
            "global",
            COORDINATOR,
            100,
        )
        assert by_unit[u].lost == 60
    for u in (4, 5):
        assert (by_unit[u].kind, by_unit[u].source, by_unit[u].version) == ("chain", "d", 150)
    assert plan.copies_used() == {"global": [2, 3], "chain@d": [4, 5]}
    assert plan.max_lost == 60 and plan.order == ("a", "d")
    report = json.loads(json.dumps(plan.summary()))
    assert report["resume_at"] == 160 and report["max_lost"] == 60
    assert report["lost"] == {"2": 60, "3": 60, "4": 10, "5": 10}
    assert report["copies_used"] == {"global": [2, 3], "chain@d": [4, 5]}
    assert report["units_moved"] == len(plan.fetches())


def test_the_last_stages_chain_copy_is_the_coordinators() -> None:
    plan = recover(["d"], ledger_of(SPANS, chain=150, glob=100))
    for s in plan.sources:
        if s.unit in (6, 7):
            assert (s.kind, s.source, s.version) == ("chain", COORDINATOR, 150)


def test_a_survivor_loads_a_chain_copy_it_holds_without_a_transfer() -> None:
    plan = recover(["b"], ledger_of(SPANS, chain=150, glob=100))
    assert plan.bounds == (0, 2, 5, 8)  # eq. 5 over equal survivors: a | c | d
    by_unit = {s.unit: (s.dest, s.kind, s.source) for s in plan.sources}
    # c holds b's chain copy and runs b's units: it loads them, nothing travels
    assert by_unit[2] == by_unit[3] == ("c", "chain", "c")
    assert by_unit[5] == ("d", "peer", "c")
    assert [(s.unit, s.source, s.dest) for s in plan.fetches()] == [(5, "c", "d")]


def test_a_restored_unit_another_survivor_runs_is_fetched_from_the_copys_holder() -> None:
    plan = recover(
        ["b"], ledger_of(SPANS, chain=150, glob=100), capacities={"a": 1.0, "c": 3.0, "d": 1.0}
    )
    assert plan.bounds == (0, 3, 4, 8)
    assert [(s.unit, s.kind, s.source, s.dest) for s in plan.fetches()] == [
        (2, "chain", "c", "a"),
        (4, "peer", "c", "d"),
        (5, "peer", "c", "d"),
    ]


def test_a_copy_interrupted_by_a_death_is_never_chosen() -> None:
    # b's chain copy of mini-batch 200 was on its way to c when b died: the ledger
    # records a copy only when its transfer completed, so it holds the one of 150
    ledger = ledger_of(SPANS, chain=150, glob=100)
    plan = recover(["b"], ledger, acknowledged=205, updates={"a": 205, "c": 207, "d": 208})
    assert {s.version for s in plan.sources if s.unit in (2, 3)} == {150}
    # the global copy of 200 completed before the interrupted chain copy: it is newer
    ledger.record(CopyRecord("b", "global", COORDINATOR, 0, 200, 2, 4))
    plan = recover(["b"], ledger, acknowledged=205, updates={"a": 205, "c": 207, "d": 208})
    assert {(s.kind, s.version, s.lost) for s in plan.sources if s.unit in (2, 3)} == {
        ("global", 200, 5)
    }
    # a chain copy and a global one of the same mini-batch: the chain copy (off the
    # coordinator's link)
    ledger.record(CopyRecord("b", "chain", "c", 0, 200, 2, 4))
    assert freshest_copy(ledger, 2, ["a", "c", "d"]).kind == "chain"  # type: ignore[union-attr]


def test_a_copy_whose_holder_died_during_its_transfer_is_not_used() -> None:
    ledger = ledger_of(SPANS, chain=150, glob=100)
    ledger.holder_lost("c")  # c died receiving b's next copy: what it held is gone
    assert freshest_copy(ledger, 2, ["a", "d"]).kind == "global"  # type: ignore[union-attr]


def test_a_death_during_a_move_abandons_the_move_and_plans_from_the_committed_cuts() -> None:
    # a live re-partition was moving units 0-1 from a to b when c died: the move is
    # not committed, so a still holds and serves its units; the decision reads the
    # committed partition only and says the move is abandoned
    ledger = ledger_of(SPANS, chain=150, glob=100)
    during = recover(["c"], ledger, move_pending=True)
    after_nothing = recover(["c"], ledger)
    assert during.abandoned_move and not after_nothing.abandoned_move
    assert during.sources == after_nothing.sources and during.bounds == after_nothing.bounds
    assert all(s.source != "c" for s in during.sources)


def test_units_without_any_copy_left_restart_from_their_initial_weights() -> None:
    ledger = ledger_of(SPANS, chain=150, glob=None)
    plan = recover(["b", "c"], ledger)  # b's chain copy died with c, no global copy
    units = {s.unit: s for s in plan.sources}
    # b's units: no copy anywhere, so their initial weights (version 0), built where
    # they will run (nothing travels), every acknowledged mini-batch lost
    for u in (2, 3):
        s = units[u]
        assert (s.kind, s.source, s.version, s.owner, s.run) == ("initial", s.dest, 0, "b", None)
        assert (s.lost, s.reapplied) == (160, 0)
    # c's units still come from c's chain copy at d
    assert {units[u].kind for u in (4, 5)} == {"chain"}
    assert plan.copies_used() == {"initial": [2, 3], "chain@d": [4, 5]}
    assert plan.initial_units == [2, 3] and plan.max_lost == 160
    assert not any(s.unit in (2, 3) for s in plan.fetches())
    summary = plan.summary()
    assert summary["lost"]["2"] == 160 and summary["copies_used"]["initial"] == [2, 3]
    assert FastRecoveryPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_a_death_before_the_first_copy_restarts_the_dead_units_from_their_initial_weights() -> None:
    # b dies before its first chain copy (after chain_every mini-batches) reached c:
    # the ledger holds nobody's copy yet; a survivor's units stay its own
    plan = recover(["b"], CopyLedger(), acknowledged=23,
                   updates={"a": 23, "c": 24, "d": 25})  # fmt: skip
    units = {s.unit: s for s in plan.sources}
    assert {(units[u].kind, units[u].version, units[u].lost) for u in (2, 3)} == {
        ("initial", 0, 23)
    }
    assert all(units[u].kind in ("kept", "peer") for u in (0, 1, 4, 5, 6, 7))
    assert plan.copies_used() == {"initial": [2, 3]} and plan.max_lost == 23


def test_malformed_input_is_refused_with_a_clear_error() -> None:
    ledger = ledger_of(SPANS, chain=150, glob=100)
    with pytest.raises(RecoveryError, match="every stage died"):
        recover(ORDER, ledger, updates={})
    with pytest.raises(ConfigError, match="not stages"):
        recover(["z"], ledger)
    with pytest.raises(ConfigError, match="at least one dead stage"):
        recover([], ledger)
    with pytest.raises(ConfigError, match="no update count"):
        recover(["b"], ledger, updates={"a": 1, "c": 1})
    with pytest.raises(ConfigError, match="no measured capacity"):
        recover(["b"], ledger, capacities={"a": 1.0})
    with pytest.raises(ConfigError, match="acknowledged"):
        recover(["b"], ledger, acknowledged=-1)
    with pytest.raises(ConfigError, match="one device per stage"):
        plan_fast_recovery(
            [StageSpan(("a", "x"), 0, 4), StageSpan(("b",), 4, 8)],
            ["b"],
            ledger=ledger,
            updates={"a": 1, "x": 1},
            acknowledged=0,
            reference_unit_s=UNIT_S,
        )


def test_each_stage_gets_its_units_as_ranges_with_one_source_each() -> None:
    plan = recover(
        ["b", "c"],
        ledger_of(SPANS, chain=150, glob=100),
        capacities={"a": 1.0, "d": 1.0},
    )
    assert plan.bounds == (0, 4, 8)
    a = [(r.kind, r.source, r.owner, r.run, r.version, r.start, r.end) for r in plan.ranges_of("a")]
    assert a == [
        ("kept", "a", "a", None, 160, 0, 2),
        ("global", COORDINATOR, "b", 0, 100, 2, 4),  # b's copy; its chain copy died with c
    ]
    d = [
        (r.kind, r.source, r.owner, r.version, r.start, r.end, r.local) for r in plan.ranges_of("d")
    ]
    assert d == [
        ("chain", "d", "c", 150, 4, 6, True),  # d holds c's chain copy: loads it
        ("kept", "d", "d", 163, 6, 8, True),
    ]
    assert not plan.ranges_of("b")


def test_the_plan_is_plain_data_that_round_trips() -> None:
    plan = recover(["b", "c"], ledger_of(SPANS, chain=150, glob=100), move_pending=True)
    data = json.loads(json.dumps(plan.to_dict()))
    assert FastRecoveryPlan.from_dict(data) == plan
    assert [s.devices for s in plan.spans] == [("a",), ("d",)]
    with pytest.raises(ConfigError, match="malformed fast recovery plan"):
        FastRecoveryPlan.from_dict({"order": ["a"]})


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[StageSpan], list[str], CopyLedger, dict[str, int]]:
    n = draw(st.integers(2, 6))
    sizes = draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
    order = [f"s{i}" for i in range(n)]
    spans, start = [], 0
    for d, size in zip(order, sizes, strict=True):
        spans.append(StageSpan((d,), start, start + size))
        start += size
    dead = draw(st.lists(st.sampled_from(order), min_size=1, max_size=n - 1, unique=True))
    ledger = CopyLedger()
    for s in spans:
        owner = s.devices[0]
        if draw(st.booleans()):
            step = draw(st.integers(1, 100))
            holder = chain_holder(order, owner)
            ledger.record(CopyRecord(owner, "chain", holder, 0, step, s.start, s.end))
        if draw(st.booleans()):
            step = draw(st.integers(1, 100))
            ledger.record(CopyRecord(owner, "global", COORDINATOR, 0, step, s.start, s.end))
    updates = {d: draw(st.integers(50, 120)) for d in order if d not in dead}
    return spans, dead, ledger, updates


@settings(max_examples=200, deadline=None)
@given(scenarios(), st.data())
def test_every_unit_has_one_source_never_a_dead_stage(
    scenario: tuple[list[StageSpan], list[str], CopyLedger, dict[str, int]], data: st.DataObject
) -> None:
    spans, dead, ledger, updates = scenario
    num_units = spans[-1].end
    survivors = [s.devices[0] for s in spans if s.devices[0] not in dead]
    unit_s = data.draw(st.lists(st.floats(0.1, 5.0), min_size=num_units, max_size=num_units))
    caps = {d: data.draw(st.floats(0.2, 5.0)) for d in survivors}
    plan = plan_fast_recovery(
        spans,
        dead,
        ledger=ledger,
        updates=updates,
        acknowledged=50,
        reference_unit_s=unit_s,
        capacities=caps,
    )
    held = {s.devices[0]: set(range(s.start, s.end)) for s in spans}
    assert plan.bounds == ftpipehd_partition(unit_s, capacities=list(caps.values())).bounds
    assert [s.unit for s in plan.sources] == list(range(num_units))  # exactly one each
    assert list(plan.order) == survivors
    for s in plan.sources:
        assert s.source not in dead and s.dest not in dead
        if s.kind == "kept":
            assert s.source == s.dest and s.unit in held[s.dest]
            assert s.version == updates[s.dest]
        elif s.kind == "peer":
            assert s.unit in held[s.source] and s.source != s.dest
        elif s.kind == "initial":  # no copy of it at a live holder: built at dest
            assert any(s.unit in held[d] for d in dead)
            assert freshest_copy(ledger, s.unit, survivors) is None
            assert s.source == s.dest and s.version == 0 and s not in plan.fetches()
        else:  # restored: the unit was a dead stage's
            assert any(s.unit in held[d] for d in dead)
            assert s.source == COORDINATOR or s.source in survivors
        assert s.lost == max(0, 50 - s.version) and s.reapplied == max(0, s.version - 50)
    # each stage's ranges cover exactly its units
    for span in plan.spans:
        (d,), a, b = span.devices, span.start, span.end
        ranges = plan.ranges_of(d)
        assert [u for r in ranges for u in range(r.start, r.end)] == list(range(a, b))
    # a survivor's units it still runs are all kept: nothing it held is fetched
    for d in survivors:
        mine = {s.unit for s in plan.sources_of(d)}
        kept = {s.unit for s in plan.sources_of(d) if s.kind == "kept"}
        assert kept == mine & held[d]
