"""bench/ftpipehd.py's pure parts: reading a part's summary line, the goals, and the
one summary assembled from parts that ran, failed or were not run."""

from __future__ import annotations

import json
import sys

import pytest

from bench.ftpipehd import (
    GOALS,
    KEYS,
    PARTS,
    PartResult,
    assemble,
    goal_met,
    summary_of,
)


def _result(name: str, summary: dict[str, object] | None, rc: int = 0) -> PartResult:
    return PartResult(name, [sys.executable, "-m", f"bench.{name}"], rc=rc, wall_s=12.34,
                      load_before=[1.0, 1.0, 1.0], load_after=[2.0, 2.0, 2.0],
                      summary=summary, tail=["Traceback ...", "ValueError: boom"])  # fmt: skip


def _good(part_name: str, **figures: object) -> PartResult:
    part = next(p for p in PARTS if p.name == part_name)
    return _result(part_name, {"bench": part.module, "summary": True, **figures})


def test_every_issue_key_has_a_goal_and_a_part() -> None:
    assert set(GOALS) == {
        "async_replication_throughput_cost",
        "ftpipehd_over_pipedream_time_to_loss",
        "async_fast_over_exact_progress_lost",
        "async_light_over_respipe_epoch_time_after_failure",
        "async_heavy_over_light_recovery_time",
    }
    produced = [ours for part in PARTS for ours in part.keys]
    assert sorted(produced) == sorted(KEYS)  # each key from exactly one part


@pytest.mark.parametrize(
    ("key", "value", "met"),
    [
        ("async_replication_throughput_cost", 0.10, True),  # at most
        ("async_replication_throughput_cost", 0.101, False),
        ("async_fast_over_exact_progress_lost", 0.5, False),  # strictly under
        ("async_fast_over_exact_progress_lost", 0.49, True),
        ("ftpipehd_over_pipedream_time_to_loss", 3, True),
        ("ftpipehd_over_pipedream_time_to_loss", 2.99, False),
        ("async_heavy_over_light_recovery_time", None, False),  # no figure
        ("async_heavy_over_light_recovery_time", True, False),  # not a number
        ("async_light_over_respipe_epoch_time_after_failure", "1.6", False),
    ],
)
def test_a_goal_is_met_only_by_a_number_on_its_side(key: str, value: object, met: bool) -> None:
    assert goal_met(key, value) is met


def test_the_summary_line_is_the_last_of_its_own_bench() -> None:
    lines = [
        "not json",
        json.dumps({"bench": "async_recovery", "section": "fast_vs_exact", "progress_lost": 3}),
        json.dumps({"bench": "other", "summary": True, "x": 1}),
        json.dumps({"bench": "async_recovery", "summary": True, "x": 2}),
        json.dumps([1, 2]),
    ]
    assert summary_of(lines, "async_recovery") == {"bench": "async_recovery", "summary": True,
                                                   "x": 2}  # fmt: skip
    assert summary_of(lines[:3], "async_recovery") is None


def test_every_part_ran_every_key_is_there_with_its_goal() -> None:
    results = {
        "replication": _good("replication", async_replication_throughput_cost=0.08,
                             copies_kept=17.0),
        "time_to_loss": _good("time_to_loss", ftpipehd_over_pipedream_time_to_loss=2.5,
                              ftpipehd_headline_measured_over_bound=0.66,
                              ftpipehd_headline_setup="r24_middle"),
        "progress_lost": _good("progress_lost", async_fast_over_exact_progress_lost=0.4),
        "after_failure": _good("after_failure",
                               async_light_over_respipe_epoch_time_after_failure=1.6,
                               async_heavy_over_light_recovery_time=4.2),
    }  # fmt: skip
    out = assemble(PARTS, results, load=[3.0, 2.0, 1.0], wall_s=100.04)
    assert out["async_replication_throughput_cost"] == 0.08
    assert out["measured_over_bound"] == 0.66
    assert out["met"] == {
        "async_replication_throughput_cost": True,
        "ftpipehd_over_pipedream_time_to_loss": False,
        "async_fast_over_exact_progress_lost": True,
        "async_light_over_respipe_epoch_time_after_failure": True,
        "async_heavy_over_light_recovery_time": False,
    }
    assert out["all_met"] is False
    assert out["goals"]["async_replication_throughput_cost"] == "<= 0.1"
    assert out["failed_parts"] == []
    assert out["parts"]["time_to_loss"]["ftpipehd_headline_setup"] == "r24_middle"
    assert out["parts"]["replication"]["copies_kept"] == 17.0
    assert out["parts"]["replication"]["error"] is None
    assert out["load"] == [3.0, 2.0, 1.0] and out["wall_s"] == 100.0


def test_a_failed_part_leaves_its_keys_empty_and_the_others_reported() -> None:
    results = {
        "replication": _good("replication", async_replication_throughput_cost=0.05),
        "time_to_loss": _result("time_to_loss", None, rc=1),  # crashed before its summary
        "progress_lost": _good("progress_lost"),  # a summary without the key
        "after_failure": _result("after_failure", None, rc=None),
    }
    results["after_failure"].error = "ran past 1260 s and was stopped"
    out = assemble(PARTS, results, load=None, wall_s=1.0)
    assert out["async_replication_throughput_cost"] == 0.05
    assert out["met"]["async_replication_throughput_cost"] is True
    for key in KEYS[1:]:
        assert out[key] is None
    assert out["met"]["ftpipehd_over_pipedream_time_to_loss"] is False
    assert out["failed_parts"] == ["time_to_loss", "progress_lost", "after_failure"]
    assert "exit status 1, no summary line" in out["parts"]["time_to_loss"]["error"]
    assert "ValueError: boom" in out["parts"]["time_to_loss"]["error"]
    assert "async_fast_over_exact_progress_lost" in out["parts"]["progress_lost"]["error"]
    assert out["parts"]["after_failure"]["error"] == "ran past 1260 s and was stopped"


def test_a_part_that_exits_1_with_its_summary_keeps_its_figures() -> None:
    # async_after_failure exits 1 when one trial failed, its medians from the others
    result = _good("after_failure", async_light_over_respipe_epoch_time_after_failure=1.2,
                   async_heavy_over_light_recovery_time=6.0, failed_trials=["light"])  # fmt: skip
    result.rc = 1
    only = [p for p in PARTS if p.name == "after_failure"]
    out = assemble(only, {"after_failure": result}, load=None, wall_s=1.0)
    assert out["async_heavy_over_light_recovery_time"] == 6.0
    assert out["met"]["async_heavy_over_light_recovery_time"] is True
    assert out["parts"]["after_failure"]["rc"] == 1
    assert out["parts"]["after_failure"]["error"] is None
    assert out["parts"]["after_failure"]["failed_trials"] == ["light"]
    assert set(out["parts"]) == {"after_failure"}  # parts not run are not listed
    assert out["async_replication_throughput_cost"] is None  # but their keys are


def test_quick_and_default_commands_differ_and_pass_each_timeout() -> None:
    for part in PARTS:
        default, quick = part.argv(False), part.argv(True)
        assert default[1:3] == ["-m", f"bench.{part.module}"]
        assert default[-2:] == ["--timeout", str(part.timeout_s)] == quick[-2:]
        assert default != quick
