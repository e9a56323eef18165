"""Deaths at awkward moments for FTPipeHD's fast recovery (zpipe.recovery.fast_recovery):
during a live copy's transfer (its sender or its holder dies mid-copy) and during a
live re-partition's move (before or during its commit). The plan still picks a
valid source for every unit (the older complete copy, or the global one, or with
none left the initial weights). Pure: ledgers and holdings in, plans out."""

from __future__ import annotations

import pytest

from zpipe._errors import ConfigError
from zpipe.recovery.fast_recovery import FastRecoveryPlan, plan_fast_recovery
from zpipe.recovery.live_copies import CopyLedger, CopyRecord, chain_holder
from zpipe.recovery.spans import COORDINATOR, StageSpan

ORDER = ["a", "b", "c", "d"]
# committed: a | b | c | d, three units each
SPANS = [StageSpan((d,), 3 * i, 3 * i + 3) for i, d in enumerate(ORDER)]


class Copies:
    """The coordinator's ledger as the copies' messages build it: a copy is recorded
    when its transfer completed (the sender's notice after the holder acknowledged
    the last chunk, or the last chunk at the coordinator), never when it starts."""

    def __init__(self) -> None:
        self.ledger = CopyLedger()

    def completed(self, owner: str, kind: str, step: int) -> None:
        span = SPANS[ORDER.index(owner)]
        holder = chain_holder(ORDER, owner) if kind == "chain" else COORDINATOR
        self.ledger.record(CopyRecord(owner, kind, holder, 0, step, span.start, span.end))

    def every_stage(self, *, chain: int, glob: int) -> Copies:
        for owner in ORDER:
            self.completed(owner, "global", glob)
            self.completed(owner, "chain", chain)
        return self


def recover(dead: list[str], copies: Copies, **kw: object) -> FastRecoveryPlan:
    survivors = [d for d in ORDER if d not in dead]
    args: dict[str, object] = {
        "ledger": copies.ledger,
        "updates": dict.fromkeys(survivors, 44),
        "acknowledged": 44,
        "reference_unit_s": [1.0] * 12,
    }
    args.update(kw)
    return plan_fast_recovery(SPANS, dead, **args)  # type: ignore[arg-type]


def by_unit(plan: FastRecoveryPlan) -> dict[int, tuple[str, str, int]]:
    return {s.unit: (s.kind, s.source, s.version) for s in plan.sources}


# ------------------------------------------------------------ during a copy's transfer


def test_a_sender_dying_mid_chain_copy_restores_from_its_older_complete_copy() -> None:
    copies = Copies().every_stage(chain=20, glob=20)
    copies.completed("b", "chain", 40)  # b's copy of 40 reached c
    # b's copy of 60 was on its way to c when b died (c has some chunks): the ledger
    # still says 40, and c still holds 40 (a holder keeps an owner's last two)
    plan = recover(["b"], copies, updates={"a": 61, "c": 62, "d": 63}, acknowledged=61)
    restored = {u: by_unit(plan)[u] for u in (3, 4, 5)}
    assert set(restored.values()) == {("chain", "c", 40)}
    assert {plan.lost_per_unit[u] for u in (3, 4, 5)} == {21}


def test_a_sender_dying_mid_global_copy_restores_from_its_chain_copy() -> None:
    copies = Copies().every_stage(chain=40, glob=20)
    # b's global copy of 40 was streaming to the coordinator: only 20 is complete;
    # the chain copy of 40 at c completed first (chain copies go first)
    plan = recover(["b"], copies)
    assert {by_unit(plan)[u] for u in (3, 4, 5)} == {("chain", "c", 40)}


def test_a_holder_dying_mid_chain_copy_loses_nothing_its_owner_still_has() -> None:
    copies = Copies().every_stage(chain=40, glob=20)
    # c died receiving b's copy of 60: b is alive and keeps its own units; c's come
    # from its chain copy at d
    plan = recover(["c"], copies)
    units = by_unit(plan)
    assert all(units[u][0] in ("kept", "peer") for u in range(12) if u not in (6, 7, 8))
    assert {units[u] for u in (6, 7, 8)} == {("chain", "d", 40)}
    assert "b" in plan.order and not plan.copies_used().get("global")


def test_owner_and_holder_dying_mid_transfer_fall_back_to_the_global_copy() -> None:
    copies = Copies().every_stage(chain=40, glob=20)
    # b's chain copy of 60 was on its way to c when both died: b's copies at c are
    # gone with c (the complete one of 40 too); the coordinator's global copy of 20
    plan = recover(["b", "c"], copies)
    units = by_unit(plan)
    assert {units[u] for u in (3, 4, 5)} == {("global", COORDINATOR, 20)}
    assert {units[u] for u in (6, 7, 8)} == {("chain", "d", 40)}
    assert plan.copies_used() == {"global": [3, 4, 5], "chain@d": [6, 7, 8]}


def test_owner_and_holder_dying_before_any_global_copy_restart_the_units_initial() -> None:
    copies = Copies()
    for owner in ORDER:
        copies.completed(owner, "chain", 40)
    # b's global copy of 40 never completed (b died streaming it), its chain copy
    # died with c: b's units from their initial weights, c's from its chain copy
    plan = recover(["b", "c"], copies)
    units = by_unit(plan)
    assert {(units[u][0], units[u][2]) for u in (3, 4, 5)} == {("initial", 0)}
    assert plan.copies_used() == {"initial": [3, 4, 5], "chain@d": [6, 7, 8]}
    assert plan.max_lost == 44


def test_a_holder_dying_after_the_copy_reached_it_but_before_the_notice() -> None:
    copies = Copies().every_stage(chain=20, glob=20)
    # b's chain copy of 40 reached c, but b died before its notice reached the
    # coordinator: the ledger says 20, which c still holds beside 40 (the last two)
    plan = recover(["b"], copies)
    assert {by_unit(plan)[u] for u in (3, 4, 5)} == {("chain", "c", 20)}


# ------------------------------------------------------------ during a move

# the move under way: a takes unit 3 from b (cuts 0, 4, 6, 9, 12)
MOVED = {"a": (0, 4), "b": (4, 6), "c": (6, 9), "d": (9, 12)}


def test_a_death_before_the_commit_plans_from_the_committed_cuts() -> None:
    copies = Copies().every_stage(chain=40, glob=20)
    # nobody switched: every survivor says it holds its committed units
    held = {d: (s.start, s.end) for d, s in zip(ORDER, SPANS, strict=True) if d != "b"}
    plan = recover(["b"], copies, holding=held, move_pending=True)
    assert plan.abandoned_move and plan.switched == ()
    assert plan == recover(["b"], copies, move_pending=True)


def test_a_death_mid_commit_keeps_what_a_switched_survivor_holds() -> None:
    copies = Copies().every_stage(chain=40, glob=20)
    # a got the commit and runs units 0-3 (unit 3 fetched from b's snapshot); b died
    # before answering it, so the coordinator still has the old cuts
    plan = recover(["b"], copies, holding={"a": MOVED["a"], "c": (6, 9), "d": (9, 12)})
    assert plan.switched == ("a",)
    units = by_unit(plan)
    # unit 3 is alive at a, at a's version: never restored from an older copy
    assert units[3][0] in ("kept", "peer") and units[3][1] == "a" and units[3][2] == 44
    assert {units[u] for u in (4, 5)} == {("chain", "c", 40)}
    assert plan.copies_used() == {"chain@c": [4, 5]}
    assert plan.summary()["switched"] == ["a"]
    assert FastRecoveryPlan.from_dict(plan.to_dict()) == plan


def test_a_unit_a_switched_survivor_gave_to_the_dead_comes_from_its_own_copies() -> None:
    copies = Copies().every_stage(chain=40, glob=20)
    # the move gives a's unit 2 to b (cuts 0, 2, 6, 9, 12); a switched, b died: no
    # survivor holds unit 2; a's chain copy is at b (dead), so a's global copy
    plan = recover(["b"], copies, holding={"a": (0, 2), "c": (6, 9), "d": (9, 12)})
    units = by_unit(plan)
    assert units[2] == ("global", COORDINATOR, 20)
    assert {units[u] for u in (3, 4, 5)} == {("chain", "c", 40)}
    assert all(units[u][0] in ("kept", "peer") for u in (0, 1, *range(6, 12)))
    # without a global copy of a, unit 2 restarts from its initial weights (a's
    # committed unit: a switched away from it)
    bare = Copies()
    for owner in ORDER:
        bare.completed(owner, "chain", 40)
    plan = recover(["b"], bare, holding={"a": (0, 2), "c": (6, 9), "d": (9, 12)})
    (initial,) = [s for s in plan.sources if s.kind == "initial"]
    assert (initial.unit, initial.owner, initial.version) == (2, "a", 0)


def test_a_unit_two_survivors_hold_stays_with_its_committed_holder() -> None:
    copies = Copies().every_stage(chain=40, glob=20)
    # a switched to 0-3 while b did not (it still holds 3-5 as committed); c died
    plan = recover(["c"], copies, holding={"a": (0, 4), "b": (3, 6), "d": (9, 12)})
    assert plan.switched == ("a",)
    units = by_unit(plan)
    holder_of_3 = units[3][1]
    assert holder_of_3 == "b"  # the committed holder, not a copy and not a
    assert {units[u] for u in (6, 7, 8)} == {("chain", "d", 40)}


def test_a_holding_that_is_not_units_of_the_model_is_refused() -> None:
    copies = Copies().every_stage(chain=40, glob=20)
    for bad in ((0, 13), (4, 4), (-1, 3), ("x", 3)):
        with pytest.raises(ConfigError, match="holds"):
            recover(["b"], copies, holding={"a": bad})
