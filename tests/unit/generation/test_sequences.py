"""The sequence scheduler, fed events the way h11's tests feed bytes."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from zpipe._errors import ConfigError, ProtocolError
from zpipe.generation import SamplingParams, TokenEvent
from zpipe.generation.refusals import refusal_kind
from zpipe.generation.sequences import (
    FreeCache,
    Row,
    RunStep,
    SchedulerCommand,
    SchedulerLimits,
    SequenceScheduler,
    StreamToken,
)

EOS = 2


def _steps(commands: Sequence[SchedulerCommand]) -> list[RunStep]:
    return [c for c in commands if isinstance(c, RunStep)]


def _events(commands: Sequence[SchedulerCommand]) -> list[TokenEvent]:
    return [c.event for c in commands if isinstance(c, StreamToken)]


def _freed(commands: Sequence[SchedulerCommand]) -> list[int]:
    return [c.sequence for c in commands if isinstance(c, FreeCache)]


def _answer(sched: SequenceScheduler, run: RunStep, token: int = 7) -> list[SchedulerCommand]:
    return sched.step_done(run.step, [token] * len(run.sampling_rows))


def test_a_long_prompt_prefills_in_chunks_then_decodes_one_token_per_step() -> None:
    sched = SequenceScheduler(SchedulerLimits(chunk_tokens=4), eos_ids={EOS})
    prompt = list(range(10, 20))
    [run] = _steps(sched.submit(1, prompt, SamplingParams(max_tokens=3)))
    assert run.rows == (Row(1, (10, 11, 12, 13), 0, None, 13),)
    [run] = _steps(_answer(sched, run))
    assert run.rows == (Row(1, (14, 15, 16, 17), 4, None, 13),)
    [run] = _steps(_answer(sched, run))
    assert run.rows == (Row(1, (18, 19), 8, 0, 13),)
    out = sched.step_done(run.step, [30])
    assert _events(out) == [TokenEvent(1, 0, 30)]
    [run] = _steps(out)
    assert run.rows == (Row(1, (30,), 10, 1, 13),)
    [run] = _steps(sched.step_done(run.step, [31]))
    assert run.rows == (Row(1, (31,), 11, 2, 13),)
    out = sched.step_done(run.step, [32])
    assert _events(out) == [TokenEvent(1, 2, 32, "", "length")]
    assert _freed(out) == [1] and not _steps(out) and sched.idle


def test_s_steps_stay_in_flight_and_sequences_spread_over_them() -> None:
    sched = SequenceScheduler(SchedulerLimits(steps_in_flight=3, max_sequences=6))
    first = [_steps(sched.submit(s, [5, 6], SamplingParams(max_tokens=50))) for s in range(3)]
    assert [[r.sequence for r in run.rows] for [run] in first] == [[0], [1], [2]]
    # the pipeline is full: later requests are admitted and wait for a step to come back
    for s in range(3, 6):
        assert not _steps(sched.submit(s, [5, 6], SamplingParams(max_tokens=50)))
    assert sched.admitted == (0, 1, 2, 3, 4, 5)
    in_flight = [run for [run] in first]
    for _ in range(30):  # the ring: the oldest step comes back first
        run = in_flight.pop(0)
        new = _steps(_answer(sched, run))
        in_flight.extend(new)
        assert len(sched.steps_in_flight) == 3
        members = [r.sequence for s in sched.steps_in_flight for r in s.rows]
        assert len(members) == len(set(members))  # never in two steps at once
    # after the joins settle, every sequence rides a step: 6 over 3 steps, 2 rows each
    members = [r.sequence for s in sched.steps_in_flight for r in s.rows]
    assert sorted(members) == list(range(6))
    assert sorted(len(s.rows) for s in sched.steps_in_flight) == [2, 2, 2]


def test_admission_waits_for_room_in_the_kv_budget_and_joins_between_steps() -> None:
    # each reserves 3 + 4 = 7 tokens; 16 tokens of cache hold two
    sched = SequenceScheduler(SchedulerLimits(steps_in_flight=2, kv_budget=16))
    params = SamplingParams(max_tokens=4)
    [a] = _steps(sched.submit(1, [1, 3, 4], params))
    [b] = _steps(sched.submit(2, [1, 3, 4], params))
    assert not sched.submit(3, [1, 3, 4], params) and sched.waiting == (3,)
    for _ in range(3):
        [a] = _steps(_answer(sched, a))
        [b] = _steps(_answer(sched, b))
    out = _answer(sched, a)  # sequence 1's fourth token: it ends, 3 takes its room
    assert _events(out)[-1].finish_reason == "length" and _freed(out) == [1]
    [c] = _steps(out)
    assert c.rows == (Row(3, (1, 3, 4), 0, 0, 7),) and sched.admitted == (2, 3)
    assert isinstance(out[-1], RunStep)  # free first, then the step that uses the room


def test_budgets_per_stage_and_from_the_planner_and_refusals() -> None:
    seen: list[list[int]] = []

    def planner_fits(reservations: Sequence[int]) -> bool:
        seen.append(list(reservations))
        return len(reservations) * max(reservations) <= 40

    sched = SequenceScheduler(SchedulerLimits(kv_budget=planner_fits, steps_in_flight=4))
    assert _steps(sched.submit(1, [1] * 10, SamplingParams(max_tokens=10)))
    assert _steps(sched.submit(2, [1] * 5, SamplingParams(max_tokens=5)))
    assert not _steps(sched.submit(3, [1] * 5, SamplingParams(max_tokens=5)))
    assert seen[-1] == [20, 10, 10]
    with pytest.raises(ConfigError, match=r"= 41 tokens do not fit .*planner"):
        sched.submit(4, [1] * 40, SamplingParams(max_tokens=1))
    per_stage = SequenceScheduler(SchedulerLimits(kv_budget=[100, 30, 60]))
    with pytest.raises(
        ConfigError, match="31 tokens do not fit the KV cache \\(30 tokens on"
    ) as capacity:
        per_stage.submit(1, [1] * 30, SamplingParams(max_tokens=1))
    assert refusal_kind(capacity.value) == "capacity"
    ctx = SequenceScheduler(SchedulerLimits(max_context=16))
    with pytest.raises(ConfigError, match="context of 16") as context:
        ctx.submit(1, [1] * 10, SamplingParams(max_tokens=7))
    assert refusal_kind(context.value) == "context_length"
    ctx.submit(1, [1] * 10, SamplingParams(max_tokens=6))
    with pytest.raises(ConfigError, match="already in this run") as twice:
        ctx.submit(1, [1], SamplingParams(max_tokens=1))
    assert refusal_kind(twice.value) == "bad_request"
    with pytest.raises(ConfigError, match="empty"):
        ctx.submit(2, [], SamplingParams(max_tokens=1))
    with pytest.raises(ConfigError, match="integers >= 0"):
        ctx.submit(2, [3, -1], SamplingParams(max_tokens=1))
    with pytest.raises(ConfigError, match="need a tokenizer"):
        ctx.submit(3, [1], SamplingParams(max_tokens=1, stop=("x",)))
    assert ctx.waiting == () and ctx.admitted == (1,)
    with pytest.raises(ConfigError, match="steps_in_flight"):
        SchedulerLimits(steps_in_flight=0)
    for bad in (0, [], [10, -1], 2.5):
        with pytest.raises(ConfigError, match="kv_budget"):
            SchedulerLimits(kv_budget=bad)  # type: ignore[arg-type]


def test_cancel_waiting_ready_and_in_flight_sequences() -> None:
    sched = SequenceScheduler(SchedulerLimits(max_sequences=2, steps_in_flight=1))
    params = SamplingParams(max_tokens=9)
    [run] = _steps(sched.submit(1, [4], params))
    sched.submit(2, [4], params)
    sched.submit(3, [4], params)
    assert sched.waiting == (3,)
    assert sched.cancel(3) == [] and sched.waiting == ()
    # 2 is ready (admitted, not in the step in flight): freed at once
    assert sched.cancel(2) == [FreeCache(2)]
    # 1 is inside the step in flight: freed when it comes back, its token dropped
    assert sched.cancel(1) == [] and sched.cancel(1) == []
    out = sched.step_done(run.step, [9])
    assert out == [FreeCache(1)] and sched.idle
    assert sched.cancel(42) == []


def test_recovery_reprefills_prompt_and_generated_tokens_and_goes_on() -> None:
    sched = SequenceScheduler(SchedulerLimits(chunk_tokens=4, steps_in_flight=2))
    params = SamplingParams(max_tokens=6)
    [a] = _steps(sched.submit(1, [10, 11, 12], params))
    [b] = _steps(sched.submit(2, [20], params))
    [a] = _steps(sched.step_done(a.step, [13]))
    [b] = _steps(sched.step_done(b.step, [21]))
    [a] = _steps(sched.step_done(a.step, [14]))
    # a stage dies with both steps in flight; b's result arrives late and is ignored
    assert sched.stage_failed() == []
    assert sched.step_done(b.step, [99]) == [] and sched.step_done(a.step, [99]) == []
    assert not _steps(sched.submit(3, [30, 31], params))  # admitted, not started while down
    out = sched.pipeline_restored()
    assert _freed(out) == [1, 2] and out[:2] == [FreeCache(1), FreeCache(2)]
    # prompt + generated from position 0, in chunks (4 prefill tokens a step; the
    # longest-ready first); the last chunk samples the next index
    first, second = _steps(out)
    assert first.rows == (Row(2, (20, 21), 0, 1, 7), Row(1, (10, 11), 0, None, 9))
    assert second.rows == (Row(3, (30, 31), 0, 0, 8),)
    assert sched.generated(1) == (13, 14) and sched.generated(2) == (21,)
    out = sched.step_done(first.step, [22])
    assert _events(out) == [TokenEvent(2, 1, 22)]  # not 99: the lost step's token is gone
    [nxt] = _steps(out)
    assert nxt.rows == (Row(2, (22,), 2, 2, 7), Row(1, (12, 13, 14), 2, 2, 9))
    assert sched.sampling(nxt.step) == ([params, params], [2, 2])
    out = sched.step_done(nxt.step, [23, 15])
    assert _events(out) == [TokenEvent(2, 2, 23), TokenEvent(1, 2, 15)]
    assert sched.generated(1) == (13, 14, 15)
    assert sched.pipeline_restored() == []  # not paused: nothing to do


def test_stop_strings_and_text_ride_the_stream() -> None:
    class Letters:
        def decode(self, ids: Sequence[int]) -> str:
            return "".join(chr(ord("a") + i) for i in ids)

    sched = SequenceScheduler(eos_ids={EOS}, detokenizer=Letters())
    [run] = _steps(sched.submit(1, [0], SamplingParams(max_tokens=9, stop=("de",))))
    texts = []
    for token in (0, 3, 4):  # "a", "d" (held: could start "de"), "e": stop
        out = sched.step_done(run.step, [token])
        texts.extend((e.text, e.finish_reason) for e in _events(out))
        run = next(iter(_steps(out)), run)
    assert texts == [("a", None), ("", None), ("", "stop")] and sched.idle
    [run] = _steps(sched.submit(2, [0], SamplingParams(max_tokens=9)))
    out = sched.step_done(run.step, [EOS])
    assert _events(out) == [TokenEvent(2, 0, EOS, "", "eos")] and _freed(out) == [2]


def test_bad_step_results_are_refused() -> None:
    sched = SequenceScheduler()
    [run] = _steps(sched.submit(1, [4, 5], SamplingParams()))
    with pytest.raises(ProtocolError, match="1 sampling rows, got 2"):
        sched.step_done(run.step, [1, 2])
    with pytest.raises(ProtocolError, match="integers >= 0"):
        sched.step_done(run.step, [-3])
    assert sched.expects(run.step) and not sched.expects(run.step + 100)
    assert sched.step_done(run.step + 100, [1]) == []
    assert len(_events(sched.step_done(run.step, [1]))) == 1


def test_a_new_scheduler_takes_over_a_sequence_with_the_tokens_it_streamed() -> None:
    class Letters:
        def decode(self, ids: Sequence[int]) -> str:
            return "".join(chr(ord("a") + i) for i in ids)

    sched = SequenceScheduler(SchedulerLimits(chunk_tokens=4), detokenizer=Letters())
    params = SamplingParams(max_tokens=5, stop=("bd",))
    # "c" and "b" streamed before ("b" held back as the start of "bd")
    [run] = _steps(sched.submit(1, [0, 0, 0], params, generated=[2, 1]))
    assert run.rows == (Row(1, (0, 0, 0, 2), 0, None, 8),)
    [run] = _steps(sched.step_done(run.step, []))
    assert run.rows == (Row(1, (1,), 4, 2, 8),)
    out = sched.step_done(run.step, [4])  # "e": the held "b" is final now
    assert _events(out) == [TokenEvent(1, 2, 4, "be")]
    with pytest.raises(ConfigError, match="already finished \\(length\\)"):
        sched.submit(2, [0], SamplingParams(max_tokens=2), generated=[1, 1])
    with pytest.raises(ConfigError, match="already finished \\(stop\\)"):
        sched.submit(3, [0], params, generated=[1, 3, 0])
