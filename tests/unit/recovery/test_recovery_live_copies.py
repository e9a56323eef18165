"""FTPipeHD's replication without draining: when copies are due, and the ledger of
where each one is held (zpipe.recovery.live_copies). Pure."""

from __future__ import annotations

import pytest
import torch

from zpipe._errors import ConfigError
from zpipe.recovery.live_copies import (
    CopyLedger,
    CopyRecord,
    chain_holder,
    check_copy_periods,
    copies_due,
    state_digest,
)
from zpipe.recovery.spans import COORDINATOR


def test_copies_are_due_at_every_positive_multiple_of_their_periods() -> None:
    due = {s: copies_due(s, chain_every=50, global_every=100) for s in (0, 49, 50, 100, 150)}
    assert due == {0: (), 49: (), 50: ("chain",), 100: ("chain", "global"), 150: ("chain",)}
    assert copies_due(4, chain_every=None, global_every=2) == ("global",)
    assert copies_due(4, chain_every=None, global_every=None) == ()


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "50"])
def test_a_period_that_is_not_a_whole_number_of_minibatches_is_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="chain_every must be a whole number"):
        check_copy_periods(bad, 100)
    with pytest.raises(ConfigError, match="global_every must be a whole number"):
        copies_due(10, chain_every=5, global_every=bad)  # type: ignore[arg-type]


def test_the_chain_goes_to_the_next_stage_and_the_last_to_the_coordinator() -> None:
    devices = ["a", "b", "c"]
    assert [chain_holder(devices, d) for d in devices] == ["b", "c", COORDINATOR]
    with pytest.raises(ConfigError, match="not a stage"):
        chain_holder(devices, "z")


def _copy(owner: str, kind: str, holder: str, step: int, start: int, end: int) -> CopyRecord:
    return CopyRecord(owner=owner, kind=kind, holder=holder, run=3, step=step, start=start, end=end)


def test_a_record_refuses_what_cannot_be_a_copy() -> None:
    with pytest.raises(ConfigError, match="copy kind"):
        _copy("a", "backup", "b", 50, 0, 2)
    with pytest.raises(ConfigError, match="mini-batch 1 or later"):
        _copy("a", "chain", "b", 0, 0, 2)
    with pytest.raises(ConfigError, match="non-empty"):
        _copy("a", "chain", "b", 50, 2, 2)
    with pytest.raises(ConfigError, match="held by the coordinator"):
        _copy("a", "global", "b", 100, 0, 2)
    with pytest.raises(ConfigError, match="malformed copy record"):
        CopyRecord.from_dict({"owner": "a", "kind": "chain"})


def test_the_ledger_keeps_the_newest_copy_of_each_stage_and_kind() -> None:
    ledger = CopyLedger()
    assert ledger.record(_copy("a", "chain", "b", 100, 0, 2))
    # copies may arrive out of order: an older one does not replace the newer
    assert not ledger.record(_copy("a", "chain", "b", 50, 0, 2))
    newest = ledger.newest("a", "chain")
    assert newest is not None and newest.step == 100
    assert ledger.record(_copy("a", "global", COORDINATOR, 100, 0, 2))
    assert [c.kind for c in ledger.held_by(COORDINATOR)] == ["global"]
    # plain data: saved with the coordinator's state and read back
    assert CopyLedger.from_dict(ledger.to_dict()) == ledger
    with pytest.raises(ConfigError, match="lists its copies"):
        CopyLedger.from_dict({"copies": 3})


def test_a_recovery_restores_from_the_chain_copy_else_from_the_global_one() -> None:
    ledger = CopyLedger()
    for copy in (
        _copy("a", "chain", "b", 150, 0, 2),
        _copy("b", "chain", "c", 150, 2, 4),
        _copy("c", "chain", COORDINATOR, 150, 4, 6),
        _copy("a", "global", COORDINATOR, 100, 0, 2),
        _copy("b", "global", COORDINATOR, 100, 2, 4),
        _copy("c", "global", COORDINATOR, 100, 4, 6),
    ):
        ledger.record(copy)
    # b died: its units are at c, a chain copy of mini-batch 150
    nearest = ledger.nearest(2, alive=["a", "c"])
    assert nearest is not None and (nearest.holder, nearest.step) == ("c", 150)
    # b and c died (adjacent): c held b's chain copy, so b's units come from the global
    nearest = ledger.nearest(3, alive=["a"])
    assert nearest is not None and (nearest.kind, nearest.step) == ("global", 100)
    # the last stage's chain copy is at the coordinator, alive whoever died
    nearest = ledger.nearest(5, alive=[])
    assert nearest is not None and (nearest.kind, nearest.holder) == ("chain", COORDINATOR)
    assert ledger.nearest(6, alive=["a", "b", "c"]) is None
    assert ledger.newest_global_step(6) == 100
    # c's death drops what it held
    lost = ledger.holder_lost("c")
    assert [(c.owner, c.kind) for c in lost] == [("b", "chain")]
    assert ledger.newest("b", "chain") is None


def test_a_digest_tells_equal_bits_from_different_ones() -> None:
    state = {"units.0.weight": torch.arange(6.0).reshape(2, 3), "units.0.bias": torch.zeros(2)}
    same = {k: v.clone() for k, v in reversed(list(state.items()))}
    assert state_digest(state) == state_digest(same)
    nudged = dict(state, **{"units.0.bias": torch.tensor([0.0, 1e-30])})
    assert state_digest(nudged) != state_digest(state)
    # the name and the dtype count too, not only the bytes
    assert state_digest({"units.1.bias": torch.zeros(2)}) != state_digest(
        {"units.0.bias": torch.zeros(2)}
    )
    bf16 = {"units.0.bias": torch.zeros(2, dtype=torch.bfloat16)}
    assert state_digest(bf16) != state_digest({"units.0.bias": torch.zeros(1)})
