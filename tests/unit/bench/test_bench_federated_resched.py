"""bench/_federated_resched.py's pure parts: task phases, throughputs, the summary keys."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

import bench._federated_resched as resched


def test_tasks_are_before_during_or_after_the_slowdown() -> None:
    # tasks of 2 s back to back; the slowdown at 5 s after the first compute
    starts = [100.0, 102.0, 104.0, 106.0, 108.0]
    rows = resched.task_rows(starts, [2.0] * 5, [1.0, 1.0, 1.0, 2.0, 4.0], 64, 5.0)
    assert [r["phase"] for r in rows] == ["before", "before", "change", "change", "after"]
    assert [r["samples_per_s"] for r in rows] == [64.0, 64.0, 64.0, 32.0, 16.0]
    # the first task is left out of "before" (it warms the stages up)
    assert resched.phase_throughput(rows, "before", 64) == 64.0
    assert resched.phase_throughput(rows, "after", 64) == 16.0
    assert resched.phase_throughput(rows, "after", 64, seconds="wall_s") == 32.0
    only_first = resched.task_rows([0.0, 10.0], [2.0, 2.0], [1.0, 1.0], 64, 3.0)
    assert resched.phase_throughput(only_first, "before", 64) is None


def test_repeats_pool_their_tasks_and_leave_out_each_warm_up() -> None:
    def run(trains: list[float], rescheduled: list[int]) -> dict[str, Any]:
        rows = resched.task_rows([0.0, 2.0, 4.0, 20.0], [2.0] * 4, trains, 64, 5.0)
        return {"tasks": rows, "rescheduled_after_tasks": rescheduled, "reordered": False}

    # each repeat: its warm-up, one task before, one during the change, one after
    got = resched.pooled([run([9.0, 1.0, 5.0, 2.0], [3]), run([9.0, 3.0, 5.0, 2.0], [])], 64)
    assert got["before"] == pytest.approx(2 * 64 / 4.0)  # 1 + 3 s; the warm-ups left out
    assert got["after"] == pytest.approx(2 * 64 / 4.0)
    assert got["rescheduled_after_tasks"] == [[3], []] and len(got["tasks"]) == 8


def _arm(before: float, after: float, rescheduled: list[int]) -> dict[str, Any]:
    return {
        "tasks": [{"start_s": 0.0, "samples_per_s": before, "phase": "before", "plan": {}}],
        "before": before,
        "after": after,
        "wall_before": before / 2,
        "wall_after": after / 2,
        "rescheduled_after_tasks": rescheduled,
        "reordered": bool(rescheduled),
    }


def _run(before: float, after: float, rescheduled: list[int]) -> dict[str, Any]:
    """run_arm's answer: a first task, one before the slowdown, one after."""
    rows = resched.task_rows([0.0, 1.0, 30.0], [1.0] * 3, [1.0, 64 / before, 64 / after], 64, 5)
    for row in rows:
        row["plan"] = {}
    return {"tasks": rows, "rescheduled_after_tasks": rescheduled, "reordered": bool(rescheduled)}


def test_the_summary_compares_the_arms_after_the_slowdown() -> None:
    out = resched.figures({"resched": _arm(100, 90, [4]), "static": _arm(100, 45, [])})
    assert out["resched_over_static_throughput_after_slowdown"] == 2.0
    assert out["resched_over_static_task_wall_after_slowdown"] == 2.0
    assert out["resched_after_over_before"] == 0.9 and out["static_after_over_before"] == 0.45
    assert out["resched_after_tasks"] == [4] and out["resched_reordered"] is True
    assert out["series"]["static"] == [[0.0, 100, "before"]]
    three = resched.figures(
        {"resched": _arm(100, 90, [4]), "static": _arm(100, 45, []), "rebalance": _arm(100, 60, [])}
    )
    assert three["rebalance_over_static_throughput_after_slowdown"] == pytest.approx(1.333)
    assert three["resched_over_rebalance_throughput_after_slowdown"] == 1.5
    # one arm alone: no ratio
    assert "resched_over_static_throughput_after_slowdown" not in resched.figures(
        {"static": _arm(100, 45, [])}
    )


def test_the_load_schedule_starts_at_full_speed() -> None:
    assert resched.load_schedule(15.0, 4.0) == "0:1,15:4"


@pytest.mark.parametrize(
    "bad",
    [["--arms", "gpipe"], ["--tasks", "2"], ["--factor", "0.5"], ["--threshold", "0"]],
)
def test_bad_flags_are_refused(bad: list[str]) -> None:
    with pytest.raises(SystemExit):
        resched.main(bad)


def test_main_emits_one_summary(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    order: list[str] = []

    async def run_arm(arm: str, args: Any, scale: float) -> dict[str, Any]:
        assert scale >= resched.MIN_SCALE and args.steps == 2
        order.append(arm)
        return _run(100, 90 if arm == "resched" else 30, [3] if arm == "resched" else [])

    monkeypatch.setattr(resched, "run_arm", run_arm)
    assert resched.main(["--tasks", "4", "--steps", "2", "--repeats", "3"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    (out,) = [line for line in lines if line.get("summary")]
    assert order == ["resched", "static", "static", "resched", "resched", "static"]
    assert out["resched_over_static_throughput_after_slowdown"] == pytest.approx(3.0)
    assert out["resched_over_static_after_per_repeat"] == [3.0, 3.0, 3.0]
    assert out["resched_after_tasks"] == [[3], [3], [3]]
    assert out["tasks"] == 4 and out["slowed"] == "tx20" and "loadavg" in out


def _section_args(*argv: str) -> Any:
    import bench.federated as fed

    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    resched.add_flags(p)
    args = p.parse_args(list(argv))
    resched.check_flags(p, args)
    assert fed.pipeline_resched_section is resched.pipeline_resched_section
    return args


def test_the_federated_section_takes_its_flags_and_quick_runs_a_smaller_home_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[Any] = []

    async def run_arm(arm: str, args: Any, scale: float) -> dict[str, Any]:
        seen.append(args)
        return _run(100, 90 if arm == "resched" else 30, [3] if arm == "resched" else [])

    monkeypatch.setattr(resched, "run_arm", run_arm)
    out = resched.pipeline_resched_section(_section_args("--pipeline-resched-steps", "2"))
    assert {(a.tasks, a.repeats, a.steps, a.factor) for a in seen} == {(10, 2, 2, 4.0)}
    assert len(seen) == 4 and out["resched_over_static_throughput_after_slowdown"] == 3.0
    # the set-up under resched_* names, the bulky series left to the task lines
    assert out["resched_tasks"] == 10 and out["resched_slowed"] == "tx20"
    assert "series" not in out and "plans" not in out and "tasks" not in out
    assert out["resched_wall_s"] >= 0 and "resched_loadavg_start" in out
    seen.clear()
    quick = resched.pipeline_resched_section(_section_args("--quick"))
    assert {(a.tasks, a.repeats) for a in seen} == {(6, 1)} and len(seen) == 2
    assert quick["resched_tasks"] == 6
    seen.clear()
    resched.pipeline_resched_section(_section_args("--quick", "--pipeline-resched-tasks", "8"))
    assert {(a.tasks, a.repeats) for a in seen} == {(8, 1)}


def test_the_federated_section_refuses_bad_flags_by_their_names() -> None:
    with pytest.raises(SystemExit):
        _section_args("--pipeline-resched-tasks", "2")
