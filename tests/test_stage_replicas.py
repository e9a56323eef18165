"""The snapshots a stage keeps for chain replication (pure, no processes)."""

from __future__ import annotations

import pytest
import torch

from zpipe._errors import ConfigError
from zpipe.stage.replicas import ReplicaStore, units_of

STATE = {
    "units.0.weight": torch.ones(2),
    "units.0.weight#opt.momentum_buffer": torch.full((2,), 0.5),
    "units.1.bias": torch.zeros(3),
    "units.12.weight": torch.ones(1),
    "loss.scale": torch.ones(1),  # not a unit's
}


def test_units_of_takes_a_units_optimizer_state_and_nothing_outside_the_range() -> None:
    assert sorted(units_of(STATE, 0, 1)) == ["units.0.weight", "units.0.weight#opt.momentum_buffer"]
    assert sorted(units_of(STATE, 1, 12)) == ["units.1.bias"]  # 12 is not 1
    assert units_of(STATE, 2, 5) == {}  # units with no parameters hold nothing


def test_the_store_keeps_the_newest_two_snapshots_of_each_owner() -> None:
    store = ReplicaStore()
    for step in (3, 6, 9):
        store.put("a", 1, step, {"units.0.w": torch.full((1,), float(step))})
    store.put("b", 1, 3, {"units.1.w": torch.zeros(1)})  # another owner's: kept apart
    assert ("a", 1, 3) not in store
    assert ("a", 1, 6) in store and ("a", 1, 9) in store and ("b", 1, 3) in store
    assert store.units("a", 1, 6, 0, 1)["units.0.w"].item() == 6.0
    with pytest.raises(ConfigError, match="no snapshot of 'a' after mini-batch 3 of run 1"):
        store.units("a", 1, 3, 0, 1)
    # taking the same step again replaces it rather than growing the store
    store.put("a", 1, 9, {"units.0.w": torch.full((1,), 99.0)})
    assert store.units("a", 1, 9, 0, 1)["units.0.w"].item() == 99.0
    assert ("a", 1, 6) in store
