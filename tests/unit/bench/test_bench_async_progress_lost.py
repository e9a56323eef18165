"""bench/async_recovery.py's count of the mini-batches acknowledged before a recovery
sent some again (what an exact rollback loses is that count minus its replica's)."""

from __future__ import annotations

from bench.async_recovery import acknowledged_at_death


def test_the_count_ends_where_the_steps_go_back() -> None:
    assert acknowledged_at_death([0, 1, 2, 3, 4, 2, 3, 4, 5]) == 5
    assert acknowledged_at_death([0, 1, 2, 3]) == 4  # nothing sent again
    assert acknowledged_at_death([]) == 0
    assert acknowledged_at_death([0, 1, 1]) == 2
