"""bench/async_after_failure.py's arithmetic: the recovery time from a notice, the time
per epoch after a failure, and the issue's two ratios over the trials' medians."""

from __future__ import annotations

import pytest

from bench.async_after_failure import (
    after_failure_summary,
    epoch_time,
    epoch_time_before,
    first_step_after,
    order_of,
    partition_of,
    rate_between,
    recovery_options,
    stage_ms,
)


def test_the_recovery_time_runs_to_the_first_loss_after_the_notice() -> None:
    stamps = [(0, 1.0), (1, 2.0), (2, 6.5), (3, 7.0)]
    assert first_step_after(stamps, 2.5) == 4.0
    assert first_step_after(stamps, 2.0) == 4.5  # a loss at the notice itself came before it
    assert first_step_after(stamps, 8.0) is None


def test_an_epoch_is_its_steps_at_the_rate_after_the_resume() -> None:
    # steps 0-9 a second apart, then 10-19 half a second apart: from 10 on, 2 a second
    stamps = [(s, float(s)) for s in range(10)] + [(10 + i, 10.0 + i / 2) for i in range(10)]
    assert epoch_time(stamps, 10, 100) == pytest.approx(50.0)
    assert epoch_time(stamps, 19, 100) is None  # one step: no rate


def _line(system: str, epoch: float, recovery: float, kill: float) -> dict[str, object]:
    return {"system": system, "epoch_s": epoch, "recovery_s": recovery,
            "kill_to_first_step_s": kill, "restart_s": recovery / 2}  # fmt: skip


def test_the_ratios_are_respipe_over_light_epochs_and_heavy_over_light_recoveries() -> None:
    trials = [
        _line("light", 10.0, 0.5, 2.5),
        _line("light", 12.0, 0.7, 2.7),  # medians: epoch 11, recovery 0.6, kill 2.6
        _line("respipe", 44.0, 1.0, 3.0),
        _line("heavy", 9.0, 6.0, 7.8),
        _line("heavy", 11.0, 6.0, 7.8),
    ]
    out = after_failure_summary(trials)
    assert out["async_light_over_respipe_epoch_time_after_failure"] == 4.0
    assert out["async_heavy_over_light_recovery_time"] == 10.0
    assert out["async_heavy_over_light_recovery_time_with_detection"] == 3.0
    assert out["by_system"]["light"]["epoch_s"] == 11.0
    assert "heavy_cached" not in out["by_system"]


def test_a_side_without_figures_gives_no_ratio() -> None:
    trials = [_line("light", 10.0, 0.5, 2.5), {"system": "respipe", "epoch_s": None}]
    out = after_failure_summary(trials)
    assert out["async_light_over_respipe_epoch_time_after_failure"] is None
    assert out["async_heavy_over_light_recovery_time"] is None


def test_respipe_and_heavy_keep_no_replica_in_the_measured_window() -> None:
    class Args:
        chain_every, global_every, kill_after, look_every = 10, 20, 30, 10

    assert recovery_options("respipe", Args())["replicate_every"] == 28
    assert recovery_options("heavy_cached", Args())["recovery"] == "heavy"
    assert recovery_options("light", Args())["consistency"] == "fast"
    assert partition_of(13) == [[0, 4], [4, 8], [8, 9], [9, 13]]


def test_the_key_is_the_median_of_each_repeats_own_ratio() -> None:
    # repeat 0 at a high load (both slow), repeat 1 low, repeat 2 in between: the ratio of
    # the medians mixes repeats (36 / 12 = 3.0), each repeat's own does not (2, 2.5, 3)
    trials = [
        {**_line("light", 30.0, 0.5, 2.5), "repeat": 0},
        {**_line("respipe", 60.0, 1.0, 3.0), "repeat": 0},
        {**_line("respipe", 25.0, 1.0, 3.0), "repeat": 1},
        {**_line("light", 10.0, 0.5, 2.5), "repeat": 1},
        {**_line("light", 12.0, 0.5, 2.5), "repeat": 2},
        {**_line("respipe", 36.0, 1.0, 3.0), "repeat": 2},
        {**_line("heavy", 9.0, 6.0, 7.8), "repeat": 0},
    ]
    out = after_failure_summary(trials)
    assert out["light_over_respipe_per_repeat"] == [2.0, 2.5, 3.0]
    assert out["async_light_over_respipe_epoch_time_after_failure"] == 2.5
    assert out["light_over_respipe_of_medians"] == 3.0  # 36 / 12
    assert out["async_heavy_over_light_recovery_time"] == 12.0


def test_the_load_normalised_ratio_reads_each_side_after_over_its_own_before() -> None:
    trials = [
        {"system": "light", "repeat": 0, "epoch_s": 20.0, "epoch_s_before": 10.0,
         "after_over_before": 2.0},
        {"system": "respipe", "repeat": 0, "epoch_s": 20.0, "epoch_s_before": 4.0,
         "after_over_before": 5.0},
    ]  # fmt: skip
    out = after_failure_summary(trials)
    assert out["async_light_over_respipe_epoch_time_after_failure"] == 1.0
    assert out["light_over_respipe_after_over_before"] == 2.5


def test_the_time_before_leaves_out_the_replica_flush_and_the_kill() -> None:
    # steps 0-18 a second apart; the flush before 20 and the kill after 22 far slower
    stamps = [(s, float(s)) for s in range(20)] + [(20, 40.0), (21, 41.0), (22, 42.0)]
    assert epoch_time_before(stamps, 22, 100) == pytest.approx(100.0)  # steps 5..19
    assert rate_between(stamps, 5, 9) == pytest.approx(1.0)


def test_systems_alternate_their_order_and_stage_times_are_per_mini_batch() -> None:
    assert order_of(["light", "respipe", "heavy"], 0) == ["light", "respipe", "heavy"]
    assert order_of(["light", "respipe", "heavy"], 1) == ["heavy", "respipe", "light"]
    stages = {"a": {"busy_s": 2.0, "microbatches": 20}, "c": {"busy_s": 1.0, "microbatches": 0}}
    assert stage_ms(stages) == {"a": 100.0}
