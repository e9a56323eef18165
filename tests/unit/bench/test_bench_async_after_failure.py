"""bench/async_after_failure.py's arithmetic: the recovery time from a notice, the time
per epoch after a failure, and the issue's two ratios over the trials' medians."""

from __future__ import annotations

import pytest

from bench.async_after_failure import (
    after_failure_summary,
    epoch_time,
    first_step_after,
    partition_of,
    recovery_options,
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
