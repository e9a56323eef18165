"""bench/chaos.py's pure pieces: the seeded fault schedule, the exactly-once and
in-order check of a stream, which fault a failed round is charged to, false deaths and
the summary's counts (the soak itself runs only in the bench)."""

from __future__ import annotations

import itertools

import pytest

from bench._chaos_plan import (
    FAULT_KINDS,
    Fault,
    charge_by_workload,
    charge_failures,
    counts_by,
    exactly_once_in_order,
    false_deaths,
    match_stream,
    refused_at_start,
    schedule,
    schedules,
    score_round,
    summary_figures,
)


def test_the_schedule_is_seeded_spaced_and_bounded() -> None:
    kinds = ["stage_kill", "stage_stop", "cpu_burner"]
    first = schedule(7, 1200, 20, 60, kinds)
    assert first == schedule(7, 1200, 20, 60, kinds)  # same seed, same faults
    assert first != schedule(8, 1200, 20, 60, kinds)
    times = [f.at_s for f in first]
    assert 20 <= times[0] <= 60
    assert all(20 <= b - a <= 60 + 1e-6 for a, b in itertools.pairwise(times))
    assert times[-1] < 1200
    # 1200 s at 20-60 s apart: between 20 and 60 faults, every kind drawn at least once
    assert 19 <= len(first) <= 60
    assert {f.kind for f in first} == set(kinds)
    assert all(1.0 <= f.hold_s <= 10.0 for f in first)


def test_the_schedule_refuses_bad_gaps_and_unknown_kinds() -> None:
    assert schedule(0, 100, 5, 10, []) == []
    with pytest.raises(ValueError, match="min gap"):
        schedule(0, 100, 10, 5, ["stage_kill"])
    with pytest.raises(ValueError, match="unknown fault kinds"):
        schedule(0, 100, 5, 10, ["meteor"])
    assert set(FAULT_KINDS) >= {"stage_kill", "coordinator_restart", "link_cut"}


def test_a_stream_is_checked_for_duplicates_losses_strangers_and_order() -> None:
    def check(received: list[int], count: int = 4) -> dict[str, object]:
        expected = [10, 11, 12, 13][:count]
        found = match_stream(received, expected, lambda a, b: a == b)
        return exactly_once_in_order(found, count)

    assert check([10, 11, 12, 13])["ok"] is True
    twice = check([10, 11, 11, 12, 13])
    assert (twice["ok"], twice["duplicates"]) == (False, 1)
    lost = check([10, 12, 13])
    assert (lost["ok"], lost["missing"]) == (False, 1)
    swapped = check([10, 12, 11, 13])
    assert (swapped["ok"], swapped["out_of_order"], swapped["missing"]) == (False, 1, 0)
    stranger = check([10, 11, 99, 12, 13])
    assert (stranger["ok"], stranger["unknown"]) == (False, 1)
    assert check([], 0)["ok"] is True


def test_a_failed_round_is_charged_to_the_first_fault_while_it_ran() -> None:
    injected = [10.0, 50.0, 90.0]
    assert charge_failures(injected, []) == set()
    assert charge_failures(injected, [(1.0, 5.0)]) == set()  # before any fault: no fault's
    # a round hung from 45 s to its timeout at 400 s: the fault at 50 s broke it
    assert charge_failures(injected, [(45.0, 400.0)]) == {1}
    # a round that started after the last fault and failed: that fault lasted
    assert charge_failures(injected, [(60.0, 70.0), (95.0, 99.0)]) == {1, 2}
    assert charge_failures(injected, [(50.0, 51.0)]) == {1}


def test_a_death_is_false_only_outside_its_stages_own_down_windows() -> None:
    down = [("a", 100.0, 110.0), ("b", 200.0, 205.0)]
    deaths = [(104.0, "a"), (118.0, "a"), (104.0, "b"), (130.0, "a"), (203.0, "b")]
    assert false_deaths(deaths, down, grace_s=10.0) == [(104.0, "b"), (130.0, "a")]


def test_the_summary_counts_faults_by_kind() -> None:
    faults = [{"kind": "stage_kill"}, {"kind": "cpu_burner"}, {"kind": "stage_kill"}]
    figures = summary_figures(faults, {2}, {"link_cut": "no root"})
    assert figures["faults_injected"] == 3
    assert figures["faults_survived"] == 2
    assert figures["per_kind"] == {
        "stage_kill": {"injected": 2, "survived": 1},
        "cpu_burner": {"injected": 1, "survived": 1},
    }
    assert figures["kinds_skipped"] == {"link_cut": "no root"}
    assert Fault(1.0, "stage_kill", 0, 1.0).kind == "stage_kill"


def test_an_attempt_is_refused_only_when_it_took_no_input_and_did_not_hang() -> None:
    refusal = "PipelineError('the coordinator could not start the run: i0 is not connected')"
    assert refused_at_start(refusal, 0, False) is True
    # any definite error before the client took an input: the training run's wording too
    assert refused_at_start("PipelineError('could not start the training run: x')", 0, False)
    assert refused_at_start(refusal, 3, False) is False  # inputs were taken: it had started
    assert refused_at_start("TimeoutError()", 0, True) is False  # a hang is a failure
    assert refused_at_start(None, 0, False) is False


def test_each_workload_has_its_own_seeded_stream_and_together_they_reach_forty() -> None:
    kinds = list(FAULT_KINDS)
    streams = schedules(0, 1200, 20, 60, kinds, ["train", "stream"])
    assert streams == schedules(0, 1200, 20, 60, kinds, ["train", "stream"])
    assert streams != schedules(1, 1200, 20, 60, kinds, ["train", "stream"])
    train, stream = streams["train"], streams["stream"]
    assert {f.workload for f in train} == {"train"}
    assert {f.workload for f in stream} == {"stream"}
    assert [f.at_s for f in train] != [f.at_s for f in stream]  # independent draws
    for faults in (train, stream):
        times = [f.at_s for f in faults]
        assert all(20 <= b - a <= 60 + 1e-6 for a, b in itertools.pairwise(times))
    # a stream's draws do not depend on which other workloads there are
    assert schedules(0, 1200, 20, 60, kinds, ["stream"])["stream"] == stream
    # about 30 each at a 40 s mean gap: the 40 faults in 20 minutes
    assert len(train) + len(stream) >= 40
    # a burner hits the machine (either workload's rounds); the rest hit their cluster
    assert {f.scope for f in train} == {"train", "machine"}
    assert all((f.scope == "machine") == (f.kind == "cpu_burner") for f in train + stream)


def test_the_schedule_draws_a_stop_that_never_resumes() -> None:
    # the kill-and-restart path of a stopped stage is a kind of its own, drawn like others
    assert "stage_hang" in FAULT_KINDS
    streams = schedules(0, 1200, 20, 60, list(FAULT_KINDS), ["train", "stream"])
    assert any(f.kind == "stage_hang" for faults in streams.values() for f in faults)


def test_a_refused_round_is_retried_and_its_outputs_counted_once_across_attempts() -> None:
    refused = ("PipelineError('could not start the run')", 0, False, [])
    # two refusals, then the same inputs answered once each: ok
    fine = score_round([refused, refused, (None, 3, False, [0, 1, 2])], 3)
    assert (fine["ok"], fine["attempts"], fine["refusals"], fine["failed"]) == (True, 3, 2, False)
    # an output in a "refused" attempt and again in the retry: a duplicate, not ok
    leaked = ("PipelineError('x')", 0, False, [0])
    twice = score_round([leaked, (None, 3, False, [0, 1, 2])], 3)
    assert (twice["ok"], twice["duplicates"], twice["failed"]) == (False, 1, True)
    # the retry lost an input: failed
    short = score_round([refused, (None, 3, False, [0, 2])], 3)
    assert (short["ok"], short["missing"], short["failed"]) == (False, 1, True)
    # an attempt that took inputs and failed is not retried: the round failed
    broken = score_round([("PipelineError('stage died')", 2, False, [0])], 3)
    assert (broken["ok"], broken["refusals"], broken["failed"]) == (False, 0, True)
    assert broken["exactly_once"] is False  # inputs 1 and 2 never answered
    # every output arrived once, then the run's end failed: a failed round whose
    # outputs were still exactly once
    late = score_round([("TransportTimeout('run report')", 3, False, [0, 1, 2])], 3)
    assert (late["ok"], late["failed"], late["exactly_once"]) == (False, True, True)
    assert twice["exactly_once"] is False and fine["exactly_once"] is True
    # still refused when the soak ended: nothing accepted, neither ok nor failed
    cut = score_round([refused, refused], 3, finished=False)
    assert (cut["ok"], cut["abandoned"], cut["failed"]) == (False, True, False)
    # refused to the end of its retries while the soak went on: a failure
    given_up = score_round([refused, refused], 3)
    assert (given_up["ok"], given_up["abandoned"], given_up["failed"]) == (False, False, True)
    with pytest.raises(ValueError, match="last attempt"):
        score_round([(None, 3, False, [0, 1, 2]), (None, 3, False, [0, 1, 2])], 3)


def test_a_failure_is_charged_only_to_faults_that_could_reach_its_workload() -> None:
    injected = [(10.0, "train"), (20.0, "stream"), (30.0, "machine"), (40.0, "stream")]
    # a stream round failing 15-25 s: the stream's fault at 20 s, not train's at 10
    assert charge_by_workload(injected, [(15.0, 25.0, "stream")]) == ({1}, 0)
    # a train round failing 35-45 s: the stream's fault at 40 cannot reach it; the
    # burner at 30 s (before it started) lasted
    assert charge_by_workload(injected, [(35.0, 45.0, "train")]) == ({2}, 0)
    # a train round failing 12-50 s: the first that could reach it while it ran
    assert charge_by_workload(injected, [(12.0, 50.0, "train")]) == ({2}, 0)
    # a stream round failing before any fault that reaches it: charged to none, counted
    assert charge_by_workload(injected, [(11.0, 12.0, "stream")]) == (set(), 1)


def test_faults_are_counted_by_workload() -> None:
    faults = [{"workload": "train"}, {"workload": "stream"}, {"workload": "train"}]
    assert counts_by(faults, {0}, "workload") == {
        "train": {"injected": 2, "survived": 1},
        "stream": {"injected": 1, "survived": 1},
    }
