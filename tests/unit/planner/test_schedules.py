"""Training schedules: warm-ups, action strings, per-stage schedules and the simulator."""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zpipe._errors import ConfigError
from zpipe.planner import schedules as sched
from zpipe.planner.schedules import (
    ACTION_KINDS,
    Action,
    SimResult,
    asteroid_warmup,
    ecofl_warmup,
    gpipe_warmup,
    parse_action,
    peak_live_activations,
    pipeline_actions,
    simulate,
    stage_actions,
    validate_stage_actions,
)

# Durations are multiples of 1/4 s so that sums are exact in floating point and the
# closed-form round times below can be compared with ==.
durations = st.integers(min_value=0, max_value=16).map(lambda q: q / 4)
positive_durations = st.integers(min_value=1, max_value=16).map(lambda q: q / 4)


@st.composite
def pipelines(draw: st.DrawFn) -> tuple[int, int, list[int]]:
    """P stages, M micro-batches and non-increasing warm-ups in 1..M (the valid ones)."""
    num_stages = draw(st.integers(1, 6))
    num_microbatches = draw(st.integers(1, 12))
    warmups = sorted(
        draw(st.lists(st.integers(1, num_microbatches), min_size=num_stages, max_size=num_stages)),
        reverse=True,
    )
    return num_stages, num_microbatches, warmups


@st.composite
def stage_times(draw: st.DrawFn, num_stages: int) -> tuple[list[float], ...]:
    """Per-stage forward/backward and per-link forward/backward transfer times."""
    per_stage = st.lists(positive_durations, min_size=num_stages, max_size=num_stages)
    per_link = st.lists(durations, min_size=num_stages - 1, max_size=num_stages - 1)
    return draw(per_stage), draw(per_stage), draw(per_link), draw(per_link)


def compute_only(actions: Sequence[Action]) -> list[Action]:
    return [a for a in actions if a.kind in ("F", "B")]


def index_of(actions: Sequence[Action], text: str) -> int:
    return list(actions).index(parse_action(text))


def static_bound(
    num_microbatches: int,
    tf: Sequence[float],
    tb: Sequence[float],
    cf: Sequence[float],
    cb: Sequence[float],
) -> float:
    """A lower bound on any schedule's round: for every stage p, micro-batch 0 must reach
    p through stages 0..p-1, p computes M forwards and backwards, and the last gradient
    must go back through p-1..0."""
    return max(
        sum(tf[q] + cf[q] + tb[q] + cb[q] for q in range(p)) + num_microbatches * (tf[p] + tb[p])
        for p in range(len(tf))
    )


# --------------------------------------------------------------------------- warm-ups


def test_asteroid_warmup_matches_the_paper_example() -> None:
    # Asteroid Fig. 4(b): K_0 = 5, K_1 = 3, K_2 = 1 for three stages.
    assert [asteroid_warmup(3, p, 8) for p in range(3)] == [5, 3, 1]
    assert [asteroid_warmup(3, p, 2) for p in range(3)] == [2, 2, 1]


@given(st.integers(1, 6), st.integers(1, 12))
def test_asteroid_warmup_is_odd_decreasing_and_capped(num_stages: int, m: int) -> None:
    warmups = [asteroid_warmup(num_stages, p, m) for p in range(num_stages)]
    assert warmups[-1] == 1
    assert all(1 <= k <= m for k in warmups)
    for p in range(num_stages - 1):
        # two more forwards per stage upstream, until M stops it
        assert warmups[p] == min(warmups[p + 1] + 2, m)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 0, 4), "num_stages"),
        ((3, 3, 4), "stage must be in 0..2"),
        ((3, -1, 4), "stage must be in 0..2"),
        ((3, 0, 0), "num_microbatches"),
        ((3, True, 4), "stage"),
    ],
)
def test_asteroid_warmup_rejects_bad_input(args: tuple[int, int, int], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        asteroid_warmup(*args)


def test_gpipe_warmup_is_all_microbatches() -> None:
    assert gpipe_warmup(7) == 7
    with pytest.raises(ConfigError, match="num_microbatches"):
        gpipe_warmup(0)


def test_ecofl_warmup_worked_example() -> None:
    # P_2 = 1
    # P_1 = ceil(1 + (1 + 2 + 0.5 + 0.5) / (2 + 4)) = ceil(1.67) = 2
    # P_0 = ceil(2 + (1 + 2 + 1 + 1) / (1 + 2))    = ceil(3.67) = 4
    tf, tb, cf, cb = [1.0, 1.0, 2.0], [2.0, 2.0, 4.0], [1.0, 0.5], [1.0, 0.5]
    assert ecofl_warmup(tf, tb, cf, cb, 12) == [4, 2, 1]
    assert ecofl_warmup(tf, tb, cf, cb, 3) == [3, 2, 1]
    # per-stage transfer lists: the last stage's entry has no link and is ignored
    assert ecofl_warmup(tf, tb, [*cf, 99.0], [*cb, 99.0], 12) == [4, 2, 1]


def test_ecofl_warmup_does_not_round_float_noise_up() -> None:
    # 1 + (0.1 + 0.1 + 1.1 + 1.1) / (0.1 + 0.1) is 13.000000000000002 in floating point
    assert ecofl_warmup([0.1] * 2, [0.1] * 2, [1.1], [1.1], 20) == [13, 1]


@given(st.integers(1, 6), st.integers(1, 12), positive_durations, positive_durations)
def test_ecofl_warmup_special_cases_from_the_paper(
    num_stages: int, m: int, f: float, b: float
) -> None:
    links = num_stages - 1
    no_comm = ecofl_warmup([f] * num_stages, [b] * num_stages, [0.0] * links, [0.0] * links, m)
    assert no_comm == [min(num_stages - s, m) for s in range(num_stages)]
    # communication as long as compute: Asteroid's 2 (S - s) - 1
    slow = ecofl_warmup([f] * num_stages, [b] * num_stages, [f] * links, [b] * links, m)
    assert slow == [asteroid_warmup(num_stages, s, m) for s in range(num_stages)]


@given(st.data(), st.integers(1, 6), st.integers(1, 12))
def test_ecofl_warmup_is_valid_and_grows_with_communication(
    data: st.DataObject, num_stages: int, m: int
) -> None:
    tf, tb, cf, cb = data.draw(stage_times(num_stages))
    warmups = ecofl_warmup(tf, tb, cf, cb, m)
    assert len(warmups) == num_stages and warmups[-1] == 1
    assert all(1 <= k <= m for k in warmups)
    assert all(warmups[s] >= warmups[s + 1] for s in range(num_stages - 1))
    slower = ecofl_warmup(tf, tb, [c + 1.0 for c in cf], cb, m)
    assert all(a >= b for a, b in zip(slower, warmups, strict=True))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([], [], [], [], 4), "one entry per stage"),
        (([1.0, 1.0], [1.0], [0.0], [0.0], 4), r"backward_s needs one entry per stage \(2\)"),
        (
            ([1.0, 1.0], [1.0, 1.0], [0.0, 0.0, 0.0], [0.0], 4),
            r"send_forward_s needs one entry per link \(1\)",
        ),
        (([1.0, 1.0], [1.0, -1.0], [0.0], [0.0], 4), r"backward_s\[1\]"),
        (([1.0, float("nan")], [1.0, 1.0], [0.0], [0.0], 4), r"forward_s\[1\]"),
        (([1.0, 0.0], [1.0, 0.0], [0.0], [0.0], 4), "stage 1 has zero"),
        (([1.0], [1.0], [], [], 0), "num_microbatches"),
    ],
)
def test_ecofl_warmup_rejects_bad_input(args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ecofl_warmup(*args)


# --------------------------------------------------------------------------- actions


@pytest.mark.parametrize(
    ("action", "text"),
    [
        (Action("F", 3), "F3"),
        (Action("B", 3), "B3"),
        (Action("SEND_F", 3), "SEND_F3"),
        (Action("RECV_B", 2), "RECV_B2"),
        (Action("ALLREDUCE"), "ALLREDUCE"),
        (Action("STEP"), "STEP"),
    ],
)
def test_action_string_form(action: Action, text: str) -> None:
    assert str(action) == text
    assert parse_action(text) == action


@given(st.sampled_from(sorted(ACTION_KINDS)), st.integers(0, 10_000))
def test_parse_action_round_trips(kind: str, m: int) -> None:
    action = Action(kind) if kind in ("ALLREDUCE", "STEP") else Action(kind, m)
    assert parse_action(str(action)) == action


@pytest.mark.parametrize(
    "text",
    ["", "F", "f3", "F03", "F-1", " F3", "F3 ", "SEND3", "SEND_X3", "STEP1", "ALLREDUCE0", "B3x"],
)
def test_parse_action_rejects_bad_text(text: str) -> None:
    with pytest.raises(ConfigError, match="cannot parse action"):
        parse_action(text)


def test_parse_action_rejects_non_strings() -> None:
    with pytest.raises(ConfigError, match="cannot parse action"):
        parse_action(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kind", "m", "match"),
    [
        ("X", 1, "unknown action kind"),
        ("F", None, "needs a micro-batch"),
        ("B", -1, "needs a micro-batch"),
        ("F", True, "needs a micro-batch"),
        ("STEP", 0, "takes no micro-batch"),
    ],
)
def test_action_rejects_bad_fields(kind: str, m: int | None, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Action(kind, m)


def test_peak_live_activations_counts_forwards_without_backwards() -> None:
    actions = [parse_action(t) for t in "F0 F1 B0 F2 F3 B1 B2 B3".split()]
    assert peak_live_activations(actions) == 3
    assert peak_live_activations([]) == 0


# --------------------------------------------------------------------------- schedules


@settings(max_examples=200)
@given(pipelines(), st.data(), st.booleans(), st.sampled_from(["gpipe", "1f1b"]))
def test_stage_actions_are_complete_and_causal(
    pipeline: tuple[int, int, list[int]], data: st.DataObject, dp: bool, schedule: str
) -> None:
    num_stages, m, warmups = pipeline
    p = data.draw(st.integers(0, num_stages - 1))
    warmup = warmups[p] if schedule == "1f1b" else None
    actions = stage_actions(
        schedule,
        stage=p,
        num_stages=num_stages,
        num_microbatches=m,
        warmup=warmup,
        data_parallel=dp,
    )
    validate_stage_actions(actions, stage=p, num_stages=num_stages)
    assert len(set(actions)) == len(actions)
    first, last = p == 0, p == num_stages - 1
    for i in range(m):
        at = {kind: index_of(actions, f"{kind}{i}") for kind in ("F", "B")}
        assert at["F"] < at["B"]
        if not first:
            assert index_of(actions, f"RECV_F{i}") < at["F"] < index_of(actions, f"SEND_B{i}")
            assert index_of(actions, f"SEND_B{i}") > at["B"]
        if not last:
            assert at["F"] < index_of(actions, f"SEND_F{i}")
            assert index_of(actions, f"RECV_B{i}") < at["B"] < index_of(actions, f"RECV_B{i}") + 2
    kinds = {a.kind for a in actions}
    assert ("RECV_F" in kinds or "SEND_B" in kinds) == (not first and m > 0)
    assert ("SEND_F" in kinds or "RECV_B" in kinds) == (not last)
    expected_tail = ["ALLREDUCE", "STEP"] if dp else ["STEP"]
    assert [str(a) for a in actions[-len(expected_tail) :]] == expected_tail
    assert sum(a.kind == "ALLREDUCE" for a in actions) == int(dp)
    k = m if schedule == "gpipe" else warmups[p]
    assert peak_live_activations(actions) == k


@given(pipelines(), st.data())
def test_1f1b_runs_k_forwards_then_alternates_then_flushes(
    pipeline: tuple[int, int, list[int]], data: st.DataObject
) -> None:
    num_stages, m, warmups = pipeline
    p = data.draw(st.integers(0, num_stages - 1))
    k = warmups[p]
    actions = stage_actions("1f1b", stage=p, num_stages=num_stages, num_microbatches=m, warmup=k)
    kinds = "".join(a.kind for a in compute_only(actions))
    assert kinds == "F" * k + "BF" * (m - k) + "B" * k
    # forwards and backwards each in micro-batch order
    for kind in "FB":
        order = [a.microbatch for a in compute_only(actions) if a.kind == kind]
        assert order == list(range(m))


@given(pipelines(), st.data())
def test_gpipe_is_1f1b_with_warmup_m(
    pipeline: tuple[int, int, list[int]], data: st.DataObject
) -> None:
    num_stages, m, _ = pipeline
    p = data.draw(st.integers(0, num_stages - 1))

    def make(schedule: str, warmup: int | None = None) -> list[Action]:
        return stage_actions(
            schedule, stage=p, num_stages=num_stages, num_microbatches=m, warmup=warmup
        )

    assert make("gpipe") == make("1f1b", warmup=m)
    assert make("GPipe") == make("gpipe")


def test_1f1b_defaults_to_asteroid_warmups() -> None:
    actions = pipeline_actions("1f1b", num_stages=3, num_microbatches=8)
    assert [peak_live_activations(a) for a in actions] == [5, 3, 1]


def test_stage_actions_exact_middle_stage() -> None:
    actions = stage_actions("1f1b", stage=1, num_stages=3, num_microbatches=3, warmup=2)
    assert " ".join(map(str, actions)) == (
        "RECV_F0 F0 SEND_F0 RECV_F1 F1 SEND_F1 RECV_B0 B0 SEND_B0 RECV_F2 F2 SEND_F2 "
        "RECV_B1 B1 SEND_B1 RECV_B2 B2 SEND_B2 STEP"
    )
    single = stage_actions("1f1b", stage=0, num_stages=1, num_microbatches=2, data_parallel=True)
    assert " ".join(map(str, single)) == "F0 B0 F1 B1 ALLREDUCE STEP"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"schedule": "zb"}, "unknown schedule 'zb'; use one of gpipe, 1f1b"),
        ({"warmup": 0}, r"warmup of stage 1 must be in 1\.\.4"),
        ({"warmup": 5}, r"warmup of stage 1 must be in 1\.\.4"),
        ({"warmup": 2.0}, "warmup must be an integer"),
        ({"schedule": "gpipe", "warmup": 2}, "gpipe always runs all 4 forwards first"),
        ({"stage": 3}, r"stage must be in 0\.\.2"),
        ({"num_stages": 0}, "num_stages"),
        ({"num_microbatches": 0}, "num_microbatches"),
    ],
)
def test_stage_actions_rejects_bad_input(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {
        "schedule": "1f1b",
        "stage": 1,
        "num_stages": 3,
        "num_microbatches": 4,
    }
    args.update(kwargs)
    schedule = args.pop("schedule")
    with pytest.raises(ConfigError, match=match):
        stage_actions(schedule, **args)  # type: ignore[arg-type]


def test_pipeline_actions_rejects_growing_warmups() -> None:
    with pytest.raises(ConfigError, match=r"stage 2 \(3\) exceeds that of stage 1 \(2\)"):
        pipeline_actions("1f1b", num_stages=3, num_microbatches=4, warmups=[3, 2, 3])
    with pytest.raises(ConfigError, match="one warm-up per stage"):
        pipeline_actions("1f1b", num_stages=3, num_microbatches=4, warmups=[3, 2])


# --------------------------------------------------------------------------- simulation


def run(
    schedule: str,
    num_stages: int,
    m: int,
    times: tuple[list[float], ...],
    warmups: list[int] | None = None,
) -> SimResult:
    actions = pipeline_actions(schedule, num_stages=num_stages, num_microbatches=m, warmups=warmups)
    return simulate(actions, *times)


@settings(max_examples=150)
@given(pipelines(), st.data(), st.booleans())
def test_every_valid_warmup_simulates_causally(
    pipeline: tuple[int, int, list[int]], data: st.DataObject, dp: bool
) -> None:
    num_stages, m, warmups = pipeline
    tf, tb, cf, cb = data.draw(stage_times(num_stages))
    allreduce = data.draw(st.lists(durations, min_size=num_stages, max_size=num_stages))
    actions = pipeline_actions(
        "1f1b", num_stages=num_stages, num_microbatches=m, warmups=warmups, data_parallel=dp
    )
    result = simulate(actions, tf, tb, cf, cb, allreduce if dp else None)

    assert result.peak_live_activations == tuple(warmups)
    assert result.round_s >= static_bound(m, tf, tb, cf, cb)
    for p, timings in enumerate(result.timeline):
        assert [t.action for t in timings] == actions[p]
        assert result.busy_s[p] == pytest.approx(m * (tf[p] + tb[p]) + (allreduce[p] if dp else 0))
        end = {str(t.action): t.end_s for t in timings}
        start = {str(t.action): t.start_s for t in timings}
        # a stage computes one thing at a time, in schedule order
        computes = [t for t in timings if t.action.kind not in ("SEND_F", "SEND_B")]
        for before, after in itertools.pairwise(computes):
            assert before.end_s <= after.start_s + 1e-9
        for i in range(m):
            assert start[f"B{i}"] >= end[f"F{i}"] - 1e-9
            if p > 0:
                # the activation arrives (the sender's transfer ends) before F starts
                upstream = {str(t.action): t for t in result.timeline[p - 1]}
                sent = upstream[f"SEND_F{i}"]
                assert sent.start_s >= upstream[f"F{i}"].end_s - 1e-9
                assert start[f"F{i}"] >= sent.end_s - 1e-9
            if p < num_stages - 1:
                sent = {str(t.action): t for t in result.timeline[p + 1]}[f"SEND_B{i}"]
                assert start[f"B{i}"] >= sent.end_s - 1e-9
        # one message at a time per link and direction
        for kind in ("SEND_F", "SEND_B"):
            transfers = sorted((t.start_s, t.end_s) for t in timings if t.action.kind == kind)
            for (_, e1), (s2, _) in itertools.pairwise(transfers):
                assert e1 <= s2 + 1e-9
    assert result.round_s == max(t.end_s for ts in result.timeline for t in ts)


@given(st.integers(1, 6), st.integers(1, 12), positive_durations, positive_durations, st.data())
def test_round_time_formula_for_uniform_stages(
    num_stages: int, m: int, f: float, b: float, data: st.DataObject
) -> None:
    # With equal stages and each transfer no longer than the compute it follows, nothing
    # but the fill and drain is idle: M (f + b) + (P - 1)(f + b + cf + cb). With free
    # transfers this is GPipe's (M + P - 1)(f + b).
    cf = data.draw(st.integers(0, int(f * 4)).map(lambda q: q / 4))
    cb = data.draw(st.integers(0, int(b * 4)).map(lambda q: q / 4))
    links = num_stages - 1
    times = ([f] * num_stages, [b] * num_stages, [cf] * links, [cb] * links)
    expected = m * (f + b) + (num_stages - 1) * (f + b + cf + cb)
    assert run("gpipe", num_stages, m, times).round_s == pytest.approx(expected)
    # Eco-FL's warm-ups remove every data-dependency bubble, and so do Asteroid's
    # (at least as large when transfers are no longer than compute).
    ecofl = ecofl_warmup(*times, m)
    assert run("1f1b", num_stages, m, times, ecofl).round_s == pytest.approx(expected)
    assert run("1f1b", num_stages, m, times).round_s == pytest.approx(expected)
    free = ([f] * num_stages, [b] * num_stages, [0.0] * links, [0.0] * links)
    assert run("gpipe", num_stages, m, free).round_s == pytest.approx(
        (m + num_stages - 1) * (f + b)
    )


@given(st.integers(2, 6), st.integers(2, 12), positive_durations, positive_durations)
def test_too_small_warmups_leave_bubbles(num_stages: int, m: int, f: float, b: float) -> None:
    links = num_stages - 1
    times = ([f] * num_stages, [b] * num_stages, [0.0] * links, [0.0] * links)
    ideal = (m + num_stages - 1) * (f + b)
    starved = ecofl_warmup(*times, m)
    starved[0] -= 1  # one forward fewer on stage 0 than Eco-FL asks for
    if starved[0] >= starved[1]:
        assert run("1f1b", num_stages, m, times, starved).round_s > ideal


@given(st.data(), st.integers(1, 6), st.integers(1, 12))
def test_warmup_one_runs_one_microbatch_at_a_time(
    data: st.DataObject, num_stages: int, m: int
) -> None:
    # K_p = 1 everywhere: a micro-batch goes all the way down and back before the next
    times = data.draw(stage_times(num_stages))
    tf, tb, cf, cb = times
    result = run("1f1b", num_stages, m, times, [1] * num_stages)
    assert result.round_s == pytest.approx(m * (sum(tf) + sum(tb) + sum(cf) + sum(cb)))


@settings(max_examples=60)
@given(pipelines(), st.data())
def test_longer_durations_never_shorten_the_round(
    pipeline: tuple[int, int, list[int]], data: st.DataObject
) -> None:
    num_stages, m, warmups = pipeline
    times = data.draw(stage_times(num_stages))
    which = data.draw(st.integers(0, 3))
    if not times[which]:
        return
    index = data.draw(st.integers(0, len(times[which]) - 1))
    slower = tuple(list(t) for t in times)
    slower[which][index] += data.draw(positive_durations)
    base = run("1f1b", num_stages, m, times, warmups).round_s
    assert run("1f1b", num_stages, m, slower, warmups).round_s >= base


def test_gpipe_bubble_fraction() -> None:
    result = run("gpipe", 4, 8, ([1.0] * 4, [2.0] * 4, [0.0] * 3, [0.0] * 3))
    assert result.round_s == 33.0
    assert result.bubble_fraction == pytest.approx(3 / 11)
    assert result.idle_s == (9.0, 9.0, 9.0, 9.0)


def test_allreduce_and_step_run_after_the_last_backward() -> None:
    times = ([1.0] * 2, [1.0] * 2, [0.0], [0.0])
    actions = pipeline_actions("1f1b", num_stages=2, num_microbatches=4, data_parallel=True)
    plain = simulate(actions, *times)
    slow = simulate(actions, *times, [3.0, 0.5], step_s=[0.25, 0.25])
    assert slow.busy_s == (plain.busy_s[0] + 3.25, plain.busy_s[1] + 0.75)
    for timings in slow.timeline:
        last_b = max(t.end_s for t in timings if t.action.kind == "B")
        tail = {t.action.kind: t for t in timings if t.action.kind in ("ALLREDUCE", "STEP")}
        assert tail["ALLREDUCE"].start_s >= last_b
        assert tail["STEP"].start_s >= tail["ALLREDUCE"].end_s
    assert slow.round_s == pytest.approx(plain.round_s + 3.25)


def test_growing_warmups_deadlock_and_the_error_names_the_stuck_stages() -> None:
    actions = [
        stage_actions("1f1b", stage=p, num_stages=2, num_microbatches=4, warmup=k)
        for p, k in enumerate([1, 2])
    ]
    times = ([1.0] * 2, [1.0] * 2, [0.0], [0.0])
    with pytest.raises(ConfigError, match="deadlocks") as caught:
        simulate(actions, *times)
    message = str(caught.value)
    assert "stage 0 at RECV_B0" in message
    assert "stage 1 at RECV_F1" in message


def _three_stage_round() -> list[list[Action]]:
    return pipeline_actions("1f1b", num_stages=3, num_microbatches=3)


def _replace(actions: list[Action], old: str, new: str) -> list[Action]:
    return [parse_action(new) if str(a) == old else a for a in actions]


def _swap(actions: list[Action], a: str, b: str) -> list[Action]:
    i, j = index_of(actions, a), index_of(actions, b)
    out = list(actions)
    out[i], out[j] = out[j], out[i]
    return out


@pytest.mark.parametrize(
    ("stage", "edit", "match"),
    [
        (1, lambda a: _swap(a, "F0", "SEND_F0"), "F0 .at .*must come before SEND_F0"),
        (1, lambda a: _swap(a, "RECV_F0", "F0"), "RECV_F0 .at .*must come before F0"),
        (2, lambda a: _swap(a, "F1", "B1"), "F1 .at .*must come before B1"),
        (1, lambda a: [x for x in a if str(x) != "B2"], "micro-batch 2 has no B2"),
        (1, lambda a: [*a, parse_action("F0")], "F0 appears twice"),
        (0, lambda a: [parse_action("RECV_F0"), *a], "first stage and has no peer for RECV_F0"),
        (2, lambda a: [*a, parse_action("SEND_F0")], "last stage and has no peer for SEND_F0"),
        (0, lambda a: [parse_action("STEP"), *a[:-1]], "STEP must come after every backward"),
        (0, lambda a: [*a, parse_action("ALLREDUCE")], "STEP must come after ALLREDUCE"),
        (0, lambda a: [*a[:-1], "STEP"], "is 'STEP', not an Action"),
    ],
)
def test_simulate_rejects_malformed_schedules(stage: int, edit: object, match: str) -> None:
    actions = _three_stage_round()
    actions[stage] = edit(actions[stage])  # type: ignore[operator]
    times = ([1.0] * 3, [1.0] * 3, [0.0] * 2, [0.0] * 2)
    with pytest.raises(ConfigError, match=match):
        simulate(actions, *times)


def test_simulate_rejects_stages_with_different_microbatches() -> None:
    actions = [
        stage_actions("gpipe", stage=0, num_stages=2, num_microbatches=3),
        stage_actions("gpipe", stage=1, num_stages=2, num_microbatches=2),
    ]
    with pytest.raises(ConfigError, match=r"stage 1 runs micro-batches \[0, 1\] but stage 0"):
        simulate(actions, [1.0] * 2, [1.0] * 2, [0.0], [0.0])


@pytest.mark.parametrize(
    ("times", "match"),
    [
        (
            ([1.0] * 3, [1.0] * 2, [0.0] * 2, [0.0] * 2),
            r"backward_s needs one entry per stage \(3\)",
        ),
        (
            ([1.0] * 3, [1.0] * 3, [0.0], [0.0] * 2),
            r"send_forward_s needs one entry per link \(2\)",
        ),
        (([1.0] * 3, [1.0] * 3, [0.0] * 2, [0.0, -0.5]), r"send_backward_s\[1\]"),
        (
            ([1.0] * 3, [1.0] * 3, [0.0] * 2, [0.0] * 2, [1.0]),
            r"allreduce_s needs one entry per stage \(3\)",
        ),
    ],
)
def test_simulate_rejects_bad_durations(times: tuple[list[float], ...], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        simulate(_three_stage_round(), *times)


def test_simulate_needs_a_stage() -> None:
    with pytest.raises(ConfigError, match="at least one stage"):
        simulate([], [], [], [], [])


def test_diagram_rejects_bad_ticks() -> None:
    result = run("gpipe", 2, 2, ([1.0] * 2, [1.0] * 2, [0.0], [0.0]))
    with pytest.raises(ConfigError, match="tick_s"):
        result.diagram(0)


def test_module_docstring_diagrams_are_what_the_simulator_draws() -> None:
    doc = sched.__doc__ or ""
    times = ([1.0] * 3, [1.0] * 3, [0.0] * 2, [0.0] * 2)
    cases = {
        "gpipe": run("gpipe", 3, 6, times),
        "1f1b, Asteroid": run("1f1b", 3, 6, times),
        "1f1b, Eco-FL": run("1f1b", 3, 6, times, ecofl_warmup(*times, 6)),
    }
    for title, result in cases.items():
        block = doc[doc.index(title) :].splitlines()[1:4]
        drawn = [re.sub(r"\s+", " ", line.strip()) for line in block]
        expected = [re.sub(r"\s+", " ", line) for line in result.diagram(1.0).splitlines()]
        assert drawn == expected, title
        assert result.round_s == 16.0
