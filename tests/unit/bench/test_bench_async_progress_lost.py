"""bench/async_recovery.py's count of the mini-batches acknowledged before a recovery
sent some again (what an exact rollback loses is that count minus its replica's)."""

from __future__ import annotations

from bench.async_recovery import acknowledged_at_death, rate_after


def test_the_count_ends_where_the_steps_go_back() -> None:
    assert acknowledged_at_death([0, 1, 2, 3, 4, 2, 3, 4, 5]) == 5
    assert acknowledged_at_death([0, 1, 2, 3]) == 4  # nothing sent again
    assert acknowledged_at_death([]) == 0
    assert acknowledged_at_death([0, 1, 1]) == 2


def test_the_rate_after_a_recovery_counts_each_step_once_at_its_last_loss() -> None:
    # steps 0-4 at 1 s each, a recovery sends 3 and 4 again (at 10 and 11 s), then
    # 5-7 one a second: from step 3 on, 3..7 came back at 10, 11, 12, 13, 14
    stamps = [(s, float(s)) for s in range(5)] + [(3, 10.0), (4, 11.0)]
    stamps += [(5, 12.0), (6, 13.0), (7, 14.0)]
    assert rate_after(stamps, 3) == 1.0
    assert rate_after(stamps, 7) is None  # one step: no interval
    assert rate_after([], 0) is None
