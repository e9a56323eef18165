"""bench/chaos.py's pure pieces: the seeded fault schedule, the exactly-once and
in-order check of a stream, which fault a failed round is charged to, false deaths and
the summary's counts (the soak itself runs only in the bench)."""

from __future__ import annotations

import itertools

import pytest

from bench._chaos_plan import (
    FAULT_KINDS,
    Fault,
    charge_failures,
    exactly_once_in_order,
    false_deaths,
    match_stream,
    refused_at_start,
    schedule,
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


def test_a_round_is_refused_only_when_it_never_started() -> None:
    refusal = "PipelineError('the coordinator could not start the run: i0 is not connected')"
    assert refused_at_start(refusal, 0) is True
    assert refused_at_start(refusal, 3) is False  # outputs came: it had started
    assert refused_at_start("TimeoutError()", 0) is False
    assert refused_at_start(None, 0) is False
