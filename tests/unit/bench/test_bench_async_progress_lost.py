"""bench/async_recovery.py's count of the mini-batches acknowledged before a recovery
sent some again (what an exact rollback loses is that count minus its replica's)."""

from __future__ import annotations

import torch

from bench._progress_lost import copy_transfer_mb, lost_if_instant, model_lost, unit_params
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


def test_lost_if_instant_counts_from_the_last_chain_copy_a_stage_had_made() -> None:
    # the A-th loss back: the stage's update count is A - 1, its newest copy the last
    # multiple of the chain period at or below that
    assert lost_if_instant(21, 10) == 1  # copy of 20 just made
    assert lost_if_instant(22, 10) == 2
    assert lost_if_instant(30, 10) == 10  # count 29: the copy of 30 is not made yet
    assert lost_if_instant(31, 10) == 1
    assert lost_if_instant(5, 10) == 5  # no copy yet: from the start
    assert lost_if_instant(0, 10) == 0


def test_model_lost_weights_each_unit_by_its_parameters() -> None:
    state = {
        "units.0.weight": torch.zeros(3, 2),  # 6
        "units.0.bias": torch.zeros(2),  # 2: unit 0 has 8
        "units.1.weight": torch.zeros(24),  # unit 1 has 24
        "other": torch.zeros(100),  # not a unit's
    }
    params = unit_params(state)
    assert params == {0: 8, 1: 24}
    assert model_lost({1: 4}, params) == 3.0  # 24 * 4 / 32; unit 0 lost none
    assert model_lost({0: 4, 1: 4}, params) == 4.0
    assert model_lost({0: 1}, {}) == 0.0


def _trace(spans: list[tuple[str, str, float, float]]) -> list[dict[str, object]]:
    stages = sorted({s for s, _, _, _ in spans})
    pid = {s: i + 1 for i, s in enumerate(stages)}
    events: list[dict[str, object]] = [
        {"name": "process_name", "ph": "M", "pid": pid[s], "tid": 0, "args": {"name": s}}
        for s in stages
    ]
    events += [
        {"name": name, "ph": "X", "pid": pid[s], "tid": 1, "ts": ts, "dur": dur}
        for s, name, ts, dur in spans
    ]
    return events


def test_a_chain_copy_is_timed_from_its_snapshot_to_its_first_copy_span() -> None:
    # the last stage forwards every 10 us; b's copy of 20: snapshot at 100, the chain
    # copy ends at 125 (2.5 forwards), the global copy after it is not the chain's
    forwards = [("c", f"forward mb{i}", 10.0 * i, 1.0) for i in range(20)]
    spans = [
        ("b", "snapshot mb20", 100.0, 2.0),
        ("b", "copy mb20", 110.0, 15.0),
        ("b", "copy mb20", 125.0, 50.0),
        ("b", "snapshot mb30", 200.0, 1.0),  # never sent: not counted
    ]
    assert copy_transfer_mb(_trace(forwards + spans), "c") == {"b": [2.5]}
    assert copy_transfer_mb(_trace(spans), "c") == {}  # no forwards: no period
