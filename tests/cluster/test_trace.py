"""Per-micro-batch timelines: the stage's ring, the clock offset, the Chrome trace file,
and a real multi-process run whose trace is well ordered per stage."""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from zpipe._errors import ConfigError
from zpipe.client import InferOptions
from zpipe.client.trace import TRACKS, chrome_trace, recovery_marks, write_trace
from zpipe.cluster import LocalCluster
from zpipe.models import ModelSpec, load_layer_sequence
from zpipe.stage.metrics import StageCounters
from zpipe.stage.timeline import ClockOffset, Timeline

# -- the ring --------------------------------------------------------------------------


def test_the_ring_keeps_the_newest_spans_and_counts_the_dropped() -> None:
    timeline = Timeline(capacity=3)
    for mb in range(5):
        timeline.record(mb, "compute", float(mb), mb + 0.5)
    assert [s.mb for s in timeline.spans()] == [2, 3, 4]
    assert timeline.dropped == 2
    wire = timeline.to_wire()
    assert wire["spans"] == [
        [2, "compute", 2.0, 2.5],
        [3, "compute", 3.0, 3.5],
        [4, "compute", 4.0, 4.5],
    ]
    assert wire["dropped"] == 2 and "offset_s" not in wire  # no round trip yet
    timeline.clear()
    assert timeline.spans() == [] and timeline.dropped == 0


def test_counters_reset_clears_the_timeline_but_heartbeats_never_carry_it() -> None:
    counters = StageCounters()
    counters.timeline.record(0, "recv", 1.0, 2.0)
    assert "timeline" not in counters.to_dict()
    counters.busy_s = 3.0
    counters.reset(keep_timeline=True)  # a re-plan of the same run
    assert counters.busy_s == 0.0 and len(counters.timeline.spans()) == 1
    counters.reset()  # the next run
    assert counters.timeline.spans() == []


def test_the_offset_comes_from_the_shortest_round_trip() -> None:
    offset = ClockOffset()
    assert offset.offset_s is None
    # the remote clock is 100 s ahead; a slow round trip is asymmetric (its stamp late)
    offset.observe(sent=10.0, remote=110.9, received=11.0)
    assert offset.offset_s == pytest.approx(100.4) and offset.rtt_s == pytest.approx(1.0)
    offset.observe(sent=20.0, remote=120.01, received=20.02)
    assert offset.offset_s == pytest.approx(100.0) and offset.rtt_s == pytest.approx(0.02)
    offset.observe(sent=30.0, remote=135.0, received=30.5)  # longer: ignored
    assert offset.offset_s == pytest.approx(100.0)
    offset.observe(sent=40.0, remote=float("nan"), received=40.001)  # mangled: ignored
    offset.observe(sent=50.0, remote=150.0, received=49.0)  # not a round trip: ignored
    assert offset.offset_s == pytest.approx(100.0) and offset.rtt_s == pytest.approx(0.02)
    timeline = Timeline()
    wire = timeline.to_wire(offset)
    assert wire["offset_s"] == pytest.approx(100.0) and wire["rtt_s"] == pytest.approx(0.02)


# -- the trace file --------------------------------------------------------------------


def test_the_trace_puts_each_stage_on_its_own_process_and_shifts_its_clock() -> None:
    timelines = {
        "a": {"spans": [[0, "compute", 5.0, 6.0], [0, "recv", 4.5, 5.0]], "offset_s": 10.0},
        # b's clock runs 2 s behind the coordinator's, a's 10 s ahead of it: on the
        # coordinator's clock b's compute follows a's
        "b": {"spans": [[0, "compute", 14.5, 15.0], [-1, "step", 15.0, 15.25]], "offset_s": 2.0},
        "c": {"spans": [[0, "bogus", 1.0, 2.0], [0, "send", 3.0, 2.0], "junk", [1, "send"]]},
    }
    trace = chrome_trace(timelines, run=7)
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {1: "a", 2: "b", 3: "c"}
    threads = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert threads == {(pid, track) for pid in (1, 2, 3) for track in TRACKS}
    spans = [e for e in events if e["ph"] == "X"]
    by_name = {(e["pid"], e["name"]): e for e in spans}
    assert len(spans) == 4  # c's malformed spans are left out
    # the run starts at the first span (a's recv at 14.5 on the coordinator's clock)
    assert by_name[(1, "recv mb0")]["ts"] == 0.0
    assert by_name[(1, "compute mb0")]["ts"] == pytest.approx(0.5e6)
    assert by_name[(1, "compute mb0")]["dur"] == pytest.approx(1e6)
    assert by_name[(2, "compute mb0")]["ts"] == pytest.approx(2.0e6)
    assert by_name[(2, "step")]["args"]["mb"] == -1
    tid = {track: i + 1 for i, track in enumerate(TRACKS)}
    assert by_name[(1, "recv mb0")]["tid"] == tid["recv"]
    assert by_name[(2, "step")]["tid"] == tid["compute"]
    assert trace["otherData"]["run"] == 7 and trace["displayTimeUnit"] == "ms"


def test_a_recovery_is_marked_where_it_happened_on_the_coordinators_clock() -> None:
    class Report:
        recoveries = [
            {"dead": "b", "recovered_s": 1.5, "replayed": 3, "clock": 20.0},
            {"dead": "c", "recovered_s": 1.0, "replayed": 1, "clock": None},  # an older one
        ]

    marks = recovery_marks(Report())
    assert marks == [("stage b failed", 18.5), ("re-planned without b (3 replayed)", 20.0)]
    trace = chrome_trace({"a": {"spans": [[0, "compute", 18.0, 19.0]]}}, marks=marks)
    instants = {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "i"}
    assert instants["stage b failed"]["ts"] == pytest.approx(0.5e6)
    assert instants["re-planned without b (3 replayed)"]["ts"] == pytest.approx(2e6)
    assert all(e["s"] == "g" for e in instants.values())


def test_dropped_spans_are_marked_and_an_empty_trace_is_still_a_trace(tmp_path: Path) -> None:
    trace = chrome_trace({"a": {"spans": [[3, "send", 1.0, 2.0]], "dropped": 9}})
    marks = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    assert len(marks) == 1 and "9 older spans dropped" in marks[0]["name"]
    path = write_trace(tmp_path / "empty.json", {})
    assert json.loads(path.read_text())["traceEvents"] == []


def test_a_trace_path_in_a_missing_directory_is_refused_before_the_run(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        InferOptions(trace=tmp_path / "missing" / "t.json")
    with pytest.raises(ConfigError, match="file path"):
        InferOptions(trace="")


# -- real processes --------------------------------------------------------------------


def _load(path: Path) -> tuple[dict[int, str], dict[tuple[int, int], list[dict[str, Any]]]]:
    document = json.loads(path.read_text())
    events = document["traceEvents"]
    assert all({"ph", "pid", "name"} <= set(e) for e in events)
    stages = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0
            tracks[(e["pid"], e["tid"])].append(e)
    return stages, tracks


def _assert_ordered_without_overlap(tracks: dict[tuple[int, int], list[dict[str, Any]]]) -> None:
    # each track is one sequential loop of one process: its spans follow each other
    # (the JSON rounds to nanoseconds, hence the slack)
    for key, spans in tracks.items():
        spans.sort(key=lambda e: e["ts"])
        for before, after in itertools.pairwise(spans):
            assert before["ts"] + before["dur"] <= after["ts"] + 0.002, (key, before, after)


def test_an_inference_trace_has_every_microbatch_in_order_on_every_stage(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    spec = ModelSpec("mlp", {"dims": [12, 16, 16, 16, 4]}, seed=2)
    sequence = load_layer_sequence(spec)
    batches = [sequence.example_input(4, seed=i) for i in range(3)]
    path = tmp_path / "infer.json"
    _, report = cluster.infer(spec, batches, microbatch_size=2, planner="even", trace=path)
    stages, tracks = _load(path)
    assert list(stages.values()) == report.plan.devices  # one process per stage, plan order
    compute = TRACKS.index("compute") + 1
    starts: dict[tuple[str, int], dict[str, float]] = {}
    for pid, stage in stages.items():
        for track, spans in tracks.items():
            if track[0] != pid:
                continue
            for e in spans:
                starts.setdefault((stage, e["args"]["mb"]), {})[e["cat"]] = e["ts"]
                starts[(stage, e["args"]["mb"])][e["cat"] + "_end"] = e["ts"] + e["dur"]
        # every micro-batch was received, computed and sent by every stage, once
        for phase in TRACKS:
            mbs = sorted(
                e["args"]["mb"] for e in tracks[(pid, TRACKS.index(phase) + 1)] if e["cat"] == phase
            )
            assert mbs == list(range(6)), (stage, phase)
        assert all(e["cat"] == "compute" for e in tracks[(pid, compute)])
    _assert_ordered_without_overlap(tracks)
    # within a stage a micro-batch is received, then computed, then sent
    for (stage, mb), at in starts.items():
        assert at["recv"] <= at["compute"] <= at["compute_end"] <= at["send"], (stage, mb)
    # across stages (clocks aligned within half of each best round trip): the next
    # stage computes a micro-batch after the one before it has computed it
    # (a stage whose first heartbeat is not answered yet keeps its own clock, which on
    # one machine is the same clock)
    rtts = json.loads(path.read_text())["otherData"]["offset_rtt_s"]
    for before, after in itertools.pairwise(report.plan.devices):
        slack = ((rtts[before] or 0.0) + (rtts[after] or 0.0)) / 2 * 1e6 + 0.002
        for mb in range(6):
            assert starts[(before, mb)]["compute_end"] <= starts[(after, mb)]["compute"] + slack


@pytest.mark.skipif(sys.platform != "linux", reason="perf_counter and monotonic share a clock")
def test_stage_clocks_measure_as_the_same_clock_on_one_machine(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    # On Linux every process's perf_counter and monotonic read CLOCK_MONOTONIC, so the
    # true offset is 0, and the estimate is off by at most half the round trip.
    spec = ModelSpec("mlp", {"dims": [6, 6, 6, 2]}, seed=1)
    path = tmp_path / "clock.json"
    deadline = time.monotonic() + 60.0
    while True:  # until every stage's first heartbeat was answered (at once, unless loaded)
        cluster.infer(spec, [(torch.zeros(2, 6),)], microbatch_size=2, planner="even", trace=path)
        other = json.loads(path.read_text())["otherData"]
        if None not in other["offset_s"].values() or time.monotonic() > deadline:
            break
    assert len(other["offset_s"]) == 3
    for stage, offset in other["offset_s"].items():
        assert offset is not None, stage
        assert abs(offset) <= other["offset_rtt_s"][stage] / 2 + 1e-4, stage


def test_a_training_trace_has_forward_backward_and_step_spans(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    spec = ModelSpec("mlp", {"dims": [12, 16, 16, 4]}, seed=3)
    generator = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(6, 12, generator=generator), torch.randint(0, 4, (6,), generator=generator))
        for _ in range(2)
    ]
    path = tmp_path / "train.json"
    report = cluster.fit(
        spec,
        batches,
        optimizer={"name": "sgd", "lr": 0.1},
        num_microbatches=3,
        partition=[[0, 1], [1, 2], [2, 3]],
        progress=False,
        trace=path,
    )
    stages, tracks = _load(path)
    assert list(stages.values()) == report.plan.devices
    _assert_ordered_without_overlap(tracks)
    for pid, stage in stages.items():
        compute = tracks[(pid, TRACKS.index("compute") + 1)]
        forwards = sorted(e["args"]["mb"] for e in compute if e["cat"] == "forward")
        backwards = sorted(e["args"]["mb"] for e in compute if e["cat"] == "backward")
        assert forwards == backwards == list(range(6)), stage
        assert sum(e["cat"] == "step" for e in compute) == 2, stage
        # 1F1B: each micro-batch's backward comes after its forward on the same stage
        at = {(e["cat"], e["args"]["mb"]): e["ts"] for e in compute}
        assert all(at[("forward", mb)] < at[("backward", mb)] for mb in range(6)), stage
