"""bench/transport.py's ``raw_asyncio`` path and bench/stage_relay.py's ``raw-asyncio``
relay (issue 34): the like-for-like baselines run, in both processes, and their
summary keys come from the right paths (real processes on loopback, smoke sizes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import stage_relay, transport

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())


def _lines(out: str) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """(the path lines by path, the summary) of a bench's JSON lines."""
    paths: dict[str, dict[str, Any]] = {}
    summary: dict[str, Any] = {}
    for text in out.splitlines():
        if not text.startswith("{"):
            continue
        line = json.loads(text)
        if line.get("summary"):
            summary = line
        elif "path" in line:
            paths[line["path"]] = line
    return paths, summary


def test_transport_times_raw_pyzmq_under_asyncio_and_compares_zpipe_with_it() -> None:
    assert "raw_asyncio" in transport.parse_args([]).paths  # on by default
    argv = ["--quick", "--sizes", "64K", "--paths", "raw,raw_asyncio,zpipe", "--timeout", "60"]
    # a process of its own: the bench arms faulthandler on a real stderr
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "transport.py"), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    paths, summary = _lines(run.stdout)
    line = paths["raw_asyncio"]
    assert line["gbps"] > 0 and line["rtt_ms"] > 0 and line["round_trips"] >= 20
    assert line["uvloop"] == paths["zpipe"]["uvloop"]  # the zpipe path's loop runner
    # one round: each paired ratio is that round's, so the three must agree
    like_for_like = summary["ratio_64kb_vs_asyncio_raw"]
    asyncio_cost = summary["asyncio_raw_over_raw_64kb"]
    assert like_for_like > 0 and asyncio_cost > 0
    assert like_for_like * asyncio_cost == pytest.approx(summary["ratio_64kb"], rel=2e-3)
    assert summary["ratio_rounds_64kb_vs_asyncio_raw"] == [like_for_like]
    rtt = summary["rtt_ratio_64kb_vs_asyncio_raw"] * summary["rtt_asyncio_raw_over_raw_64kb"]
    assert rtt == pytest.approx(summary["rtt_ratio_64kb"], rel=2e-3)
    assert summary["cpu_ratio_64kb_vs_asyncio_raw"] > 0
    assert summary["rtt_cpu_ratio_64kb_vs_asyncio_raw"] > 0
    assert summary["ratio_1mb_vs_asyncio_raw"] is None  # a size not run


def test_stage_relay_relays_under_asyncio_and_compares_the_stage_with_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert "raw-asyncio" in stage_relay.parse_args([]).paths  # on by default
    argv = ["--quick", "--sizes", "64K", "--paths", "raw,raw-asyncio,stage", "--timeout", "60"]
    assert stage_relay.main(argv) == 0
    paths, summary = _lines(capsys.readouterr().out)
    line = paths["raw-asyncio"]
    assert line["msgs_per_s"] > 0 and line["rtt_ms"] > 0
    assert line["relay_cpu_us_loop"] > 0  # it relayed on its event loop's thread
    like_for_like = summary["ratio_64kb_vs_asyncio_raw"]
    asyncio_cost = summary["asyncio_raw_over_raw_64kb"]
    assert like_for_like > 0 and asyncio_cost > 0
    # ratios of the paths' medians: stage/raw-asyncio times raw-asyncio/raw is stage/raw
    assert like_for_like * asyncio_cost == pytest.approx(summary["ratio_64kb"], rel=2e-3)
    rtt = summary["rtt_ratio_64kb_vs_asyncio_raw"] * summary["rtt_asyncio_raw_over_raw_64kb"]
    assert rtt == pytest.approx(summary["rtt_ratio_64kb"], rel=2e-3)
    assert summary["cpu_ratio_64kb_vs_asyncio_raw"] > 0


@pytest.mark.parametrize("path", ["stage", "stage-sync"])
def test_stage_relay_splits_the_relay_threads_cpu_by_step(
    path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--steps`` wraps the steps the relay really calls (the codec's decode and the
    registry's typed parse included), and the steps with ``other`` add up to the
    timed thread's CPU."""
    argv = ["--quick", "--sizes", "64K", "--paths", path, "--steps", "--timeout", "60"]
    assert stage_relay.main(argv) == 0
    line = _lines(capsys.readouterr().out)[0][path]
    for step in ("decode", "parse", "verdict", "encode", "timeline"):
        assert line[f"loop_us_{step}"] > 0, step
    timed = "compute" if path == "stage-sync" else "loop"
    steps = sum(v for k, v in line.items() if k.startswith("loop_us_"))
    # each figure is printed rounded to 4 decimals
    assert steps == pytest.approx(line[f"relay_cpu_us_{timed}"], abs=1e-3)
