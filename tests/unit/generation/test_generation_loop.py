"""The pure generation loop end to end: scheduler + sampler + stop checks, driven by
a fake model on a simulated ring of stages, give each sequence exactly the tokens
and text of a plain one-sequence-at-a-time loop, through joins, a cancel and a
stage failure."""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch

from zpipe.generation import SamplingParams, TokenEvent
from zpipe.generation.sampling import sample_token, sample_tokens
from zpipe.generation.sequences import (
    FreeCache,
    RunStep,
    SchedulerCommand,
    SchedulerLimits,
    SequenceScheduler,
    StreamToken,
)
from zpipe.generation.stopping import StopChecker

VOCAB = 12
EOS = 0
STAGES = 3


def fake_model(context: Sequence[int]) -> torch.Tensor:
    """Logits of the next token: a deterministic function of the whole context, as a
    causal LM's are (a stable hash seeds them)."""
    h = 1469598103934665603
    for t in context:
        h = ((h ^ (t + 1)) * 1099511628211) % (1 << 61)
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(h)) * 2.0
    logits[EOS] -= 2.5  # EOS is rarer than other tokens, not absent
    return logits


class Letters:
    def decode(self, ids: Sequence[int]) -> str:
        return "".join("_abcdefghijk"[i] for i in ids)


def reference(seq: int, prompt: list[int], params: SamplingParams) -> list[TokenEvent]:
    """One sequence alone, no cache, no pipeline: the loop the scheduler must equal."""
    tokens = list(prompt)
    checker = StopChecker(params, {EOS}, Letters())
    events = []
    for index in range(params.max_tokens):
        token = sample_token(fake_model(tokens), params, index)
        tokens.append(token)
        decision = checker.push(token)
        events.append(TokenEvent(seq, index, token, decision.text, decision.finish_reason))
        if decision.finish_reason is not None:
            break
    return events


@dataclass(order=True)
class _Arrival:
    time: int
    order: int
    run: RunStep = field(compare=False)


class FakeRing:
    """Carries out the scheduler's commands: a step comes out of the last stage
    `STAGES` ticks after it entered the first. Each stage's KV cache of a sequence
    is mirrored as its token list; a row must continue it exactly."""

    def __init__(self, sched: SequenceScheduler) -> None:
        self.sched = sched
        self.now = 0
        self.arrivals: list[_Arrival] = []
        self.cache: dict[int, list[int]] = {}
        self.streams: dict[int, list[TokenEvent]] = {}
        self.freed: list[int] = []
        self.lost: list[RunStep] = []
        self.sent: list[RunStep] = []
        self.due: list[RunStep] = []  # out of the last stage, not yet handed over
        self._order = 0

    def carry_out(self, commands: Sequence[SchedulerCommand]) -> None:
        for command in commands:
            if isinstance(command, RunStep):
                self.sent.append(command)
                self._order += 1
                heapq.heappush(self.arrivals, _Arrival(self.now + STAGES, self._order, command))
            elif isinstance(command, StreamToken):
                self.streams.setdefault(command.event.sequence, []).append(command.event)
            elif isinstance(command, FreeCache):
                steps = [*(a.run for a in self.arrivals), *self.due]
                in_flight = {r.sequence for run in steps for r in run.rows}
                assert command.sequence not in in_flight, "freed a cache a step still uses"
                self.cache.pop(command.sequence, None)
                self.freed.append(command.sequence)

    def tick(self, rng: random.Random | None = None) -> None:
        """Let the steps due come out of the last stage: in the order they went
        in, or (`rng`) in any order, which a ring never does but the scheduler
        must not depend on."""
        self.now += 1
        while self.arrivals and self.arrivals[0].time <= self.now:
            self.due.append(heapq.heappop(self.arrivals).run)
        if rng is not None:
            rng.shuffle(self.due)
        while self.due:
            run = self.due.pop(0)
            if not self.sched.expects(run.step):
                continue  # lost to a failure in the meantime
            logits = []
            for row in run.rows:
                if row.position == 0:
                    # a cache starts only where none is open (like KvCache.open)
                    assert row.sequence not in self.cache, f"{row} reopens a cache"
                    self.cache[row.sequence] = []
                cache = self.cache[row.sequence]
                assert len(cache) == row.position, f"row {row} does not continue its cache"
                cache.extend(row.tokens)
                assert len(cache) <= row.reserved_tokens, f"{row} outgrows its reservation"
                # like a causal LM's last stage: the last position's logits of every row
                logits.append(fake_model(cache))
            params, indices = self.sched.sampling(run.step)
            batch = torch.stack(logits)[list(run.sampling_row_indices)]
            self.carry_out(self.sched.step_done(run.step, sample_tokens(batch, params, indices)))

    def fail_a_stage(self) -> None:
        """A stage dies: the steps on the ring are lost, every cache is suspect."""
        self.lost = [a.run for a in self.arrivals] + self.due
        self.arrivals.clear()
        self.due.clear()
        for cache in self.cache.values():
            cache[:] = [-1] * len(cache)  # a cache not rebuilt gives wrong logits
        self.carry_out(self.sched.stage_failed())


REQUESTS = {
    # sequence: (tick it arrives, prompt, params)
    1: (0, [3, 4, 5, 6, 7, 8, 9, 10, 11, 3], SamplingParams(max_tokens=14)),
    2: (0, [5], SamplingParams(max_tokens=12, temperature=0.9, seed=7)),
    3: (1, [2, 2, 4], SamplingParams(max_tokens=15, temperature=1.2, top_k=5, seed=3)),
    4: (2, [9, 8], SamplingParams(max_tokens=10, temperature=0.7, top_p=0.8, seed=11)),
    5: (4, [1] * 17, SamplingParams(max_tokens=12, stop=("cb", "zz"), temperature=1.0, seed=1)),
    6: (9, [4, 4], SamplingParams(max_tokens=20, temperature=1.0, seed=2, stop_at_eos=False)),
    7: (13, [6, 7, 8], SamplingParams(max_tokens=12, temperature=0.8, seed=9)),
    8: (21, [10, 1, 10], SamplingParams(max_tokens=16)),
}


def _restart_without_the_scheduler(
    ring: FakeRing, limits: SchedulerLimits, tick: int, cancelled: set[int]
) -> SequenceScheduler:
    """The scheduler's host died: a new scheduler on a new pipeline (every cache
    gone) gets each unfinished sequence again, with the tokens its client saw."""
    sched = SequenceScheduler(limits, eos_ids={EOS}, detokenizer=Letters())
    ring.sched = sched
    ring.arrivals.clear()
    ring.cache.clear()
    for seq, (at, prompt, params) in REQUESTS.items():
        seen = ring.streams.get(seq, [])
        if at <= tick and seq not in cancelled and not (seen and seen[-1].finish_reason):
            generated = [e.token for e in seen]
            ring.carry_out(sched.submit(seq, prompt, params, generated=generated))
    return sched


@pytest.mark.parametrize(
    ("steps_in_flight", "chunk_tokens", "fail_at", "lost"),
    [
        (STAGES, 6, 17, "stage"),
        (1, 4, 10, "stage"),
        (2, 100, 25, "stage"),
        (4, 3, 30, "stage"),
        (STAGES, 5, 40, "stage"),
        (STAGES, 6, 17, "scheduler"),
        (2, 4, 30, "scheduler"),
    ],
)
def test_the_pipelined_loop_equals_one_sequence_at_a_time(
    steps_in_flight: int, chunk_tokens: int, fail_at: int, lost: str
) -> None:
    limits = SchedulerLimits(
        steps_in_flight=steps_in_flight, max_sequences=5, chunk_tokens=chunk_tokens, kv_budget=90
    )
    sched = SequenceScheduler(limits, eos_ids={EOS}, detokenizer=Letters())
    ring = FakeRing(sched)
    cancelled, cancel_after = 6, 3  # its client goes away after 3 tokens
    cancels: set[int] = set()
    for tick in range(400):
        for seq, (at, prompt, params) in REQUESTS.items():
            if at == tick:
                ring.carry_out(sched.submit(seq, prompt, params))
        if len(ring.streams.get(cancelled, [])) == cancel_after and not cancels:
            cancels.add(cancelled)
            ring.carry_out(sched.cancel(cancelled))
        if tick == fail_at and lost == "scheduler":
            assert ring.arrivals and any(ring.streams.get(s) for s in sched.admitted)
            sched = _restart_without_the_scheduler(ring, limits, tick, cancels)
        if tick == fail_at and lost == "stage":
            ring.fail_a_stage()
            assert ring.lost, "the failure should catch steps on the ring"
            # some sequence mid-decode must rebuild its cache from prompt + generated
            assert any(ring.streams.get(s) for s in sched.admitted)
        if tick == fail_at + 1 and lost == "stage":
            # a lost step's result arrives late: ignored
            late_step = ring.lost[0]
            late = [1] * len(late_step.sampling_rows)
            assert sched.step_done(late_step.step, late) == []
        if tick == fail_at + 2 and lost == "stage":
            ring.carry_out(sched.pipeline_restored())
        ring.tick()
        if tick > max(at for at, _, _ in REQUESTS.values()) and sched.idle:
            break
    assert sched.idle and not ring.arrivals

    reasons = set()
    for seq, (_, prompt, params) in REQUESTS.items():
        expected = reference(seq, prompt, params)
        got = ring.streams.get(seq, [])
        if seq == cancelled:
            assert len(got) == cancel_after < len(expected) and got == expected[:cancel_after]
            continue
        assert got == expected, f"sequence {seq}"
        reasons.add(got[-1].finish_reason)
    # the run exercised every way to end, chunked prefill and shared micro-batches,
    # and every cache was freed
    rows = [r for run in ring.sent for r in run.rows]
    assert any(r.sample_index is None for r in rows) == (chunk_tokens < 17)
    if steps_in_flight <= STAGES:  # more steps than the budget's ~4 sequences: one row each
        assert any(len(run.rows) > 1 for run in ring.sent)
    assert reasons == {"eos", "length", "stop"}
    assert sorted(set(ring.freed)) == sorted(REQUESTS) and not ring.cache


def _random_requests(rng: random.Random) -> dict[int, tuple[int, list[int], SamplingParams]]:
    requests = {}
    for seq in range(1, 9):
        if rng.random() < 0.3:
            params = SamplingParams(max_tokens=rng.randrange(1, 13))
        else:
            params = SamplingParams(
                max_tokens=rng.randrange(1, 13),
                temperature=rng.choice([0.5, 1.0, 1.5]),
                top_k=rng.choice([0, 0, 3]),
                top_p=rng.choice([1.0, 0.7]),
                seed=rng.randrange(100),
                stop=tuple(rng.sample(["ab", "c", "kk", "ja"], rng.randrange(0, 3))),
                stop_at_eos=rng.random() < 0.8,
            )
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 15))]
        requests[seq] = (rng.randrange(0, 30), prompt, params)
    return requests


@pytest.mark.parametrize("seed", range(12))
def test_random_runs_equal_one_sequence_at_a_time(seed: int) -> None:
    """Random limits, arrivals, cancels and stage failures, steps coming back in any
    order: every stream still equals the plain loop's (a cancelled one, a prefix)."""
    rng = random.Random(seed)
    requests = _random_requests(rng)
    limits = SchedulerLimits(
        steps_in_flight=rng.randrange(1, 5),
        max_sequences=rng.randrange(1, 6),
        chunk_tokens=rng.randrange(1, 9),
        kv_budget=rng.randrange(30, 120),
    )
    sched = SequenceScheduler(limits, eos_ids={EOS}, detokenizer=Letters())
    ring = FakeRing(sched)
    cancels = {rng.randrange(1, 9): rng.randrange(0, 60) for _ in range(2)}
    failures = sorted(rng.sample(range(5, 80), rng.randrange(0, 3)))
    restores = {f + rng.randrange(1, 4) for f in failures}
    cancelled: set[int] = set()
    for tick in range(2000):
        for seq, (at, prompt, params) in requests.items():
            if at == tick:
                ring.carry_out(sched.submit(seq, prompt, params))
        for seq, at in cancels.items():
            if at == tick and (seq in sched.admitted or seq in sched.waiting):
                cancelled.add(seq)
                ring.carry_out(sched.cancel(seq))
        if tick in failures:
            ring.fail_a_stage()
        if tick in restores:
            ring.carry_out(sched.pipeline_restored())
        ring.tick(rng)
        if tick > 90 and sched.idle:
            break
    assert sched.idle and not ring.cache
    for seq, (_, prompt, params) in requests.items():
        expected = reference(seq, prompt, params)
        got = ring.streams.get(seq, [])
        if seq in cancelled:
            assert got == expected[: len(got)]
        else:
            assert got == expected, f"sequence {seq}"
