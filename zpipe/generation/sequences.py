"""The sequences in flight on a generation pipeline: a sans-IO scheduler.

Events in, commands out, like h11's `Connection`: the run kind's shell calls

    submit(sequence, prompt, params)    a request arrives (with generated=...:
                                        one taken over from a scheduler that died)
    step_done(step, tokens)             a micro-batch came out of the last stage
                                        (tokens: one per sampling row, in order)
    cancel(sequence)                    its client went away
    stage_failed() / pipeline_restored() a stage died; the pipeline was re-planned

and carries out, in order, the commands each returns: `StreamToken` (send the
event to the sequence's client), `FreeCache` (every stage drops the sequence's
KV cache) and `RunStep` (feed these rows to the first stage). It never waits;
time-outs are the shell's.

How the pipeline stays full. Up to ``steps_in_flight`` micro-batches (S) travel
the ring of stages at once; a sequence is in at most one of them, because its next
input is the token its previous step picked. When a step comes back its rows are
ready again, and while fewer than S steps are out, the oldest ready sequences make
a new one (at most ``ceil(admitted / S)`` rows, so the admitted sequences spread
over S steps: S groups rotating around the ring; with S >= the number of stages,
no stage waits). New sequences join between steps: admitted in arrival order while
fewer than ``max_sequences`` are in flight and their KV-cache reservation
(prompt + max_tokens tokens) fits the budget, they become ready and ride in the
next step formed.

Chunked prefill. Each sequence feeds ``tokens[fed:]``, where tokens = prompt +
generated and `fed` is what the caches hold. A step carries at most
``chunk_tokens`` prefill tokens in all (a decode row is one token and always
fits); a prompt longer than that goes in chunks, one step each. Only the row that
feeds a sequence's last pending token samples (`Row.sample_index`).

Recovery. After `stage_failed`, the steps in flight are forgotten (their late
results are ignored) and every cache counts as lost; `pipeline_restored` frees
the old caches and prefills prompt + generated tokens again, whose last row
samples the token at index ``len(generated)``: the same token an uninterrupted run
picks (greedy, and seeded sampling by the sampler's (seed, index) rule). The
stop state and the text streamed so far are kept, so nothing streams twice.
Every stage rebuilds, not only those that took over the dead one's blocks: the
stages before them must compute the activations the moved blocks prefill from
anyway, and rewriting their own cache from position 0 on the way costs nothing
more (it also drops whatever a step lost halfway had written).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from zpipe._errors import ConfigError, ProtocolError
from zpipe.generation.params import SamplingParams, TokenEvent
from zpipe.generation.refusals import CAPACITY, CONTEXT_LENGTH, RequestRefused
from zpipe.generation.stopping import Detokenizer, StopChecker

# The KV cache's capacity, in tokens of all sequences in flight at once: one
# number (the same at every stage, since every stage keeps every sequence's cache
# for its own blocks), one per stage (the smallest binds), or a predicate over the
# reservations of the sequences that would be in flight (the planner's bytes math).
KvBudget = int | Sequence[int] | Callable[[Sequence[int]], bool]


@dataclass(frozen=True)
class Row:
    """One sequence's part of a step: feed `tokens` at cache positions
    ``position ..``. ``position == 0`` starts the sequence's cache: a stage opens
    it for `reserved_tokens` (prompt + max_tokens, the most it will hold; every
    cache of the sequence was freed before). A row with a `sample_index` needs the
    logits of its last position: the sampler picks the sequence's generated token
    number `sample_index` from them."""

    sequence: int
    tokens: tuple[int, ...]
    position: int
    sample_index: int | None
    reserved_tokens: int


@dataclass(frozen=True)
class RunStep:
    """Run one micro-batch through the pipeline."""

    step: int
    rows: tuple[Row, ...]

    @property
    def sampling_row_indices(self) -> tuple[int, ...]:
        """Where the sampling rows are among `rows`: a last stage that returns one
        logits row per step row keeps ``logits[list(run.sampling_row_indices)]``."""
        return tuple(i for i, r in enumerate(self.rows) if r.sample_index is not None)

    @property
    def sampling_rows(self) -> tuple[Row, ...]:
        """The rows whose logits the last stage samples, in the order `step_done`
        takes the tokens."""
        return tuple(r for r in self.rows if r.sample_index is not None)


@dataclass(frozen=True)
class StreamToken:
    """Send this event to the client of `event.sequence`."""

    event: TokenEvent


@dataclass(frozen=True)
class FreeCache:
    """Every stage drops the KV cache of `sequence`; no step in flight holds it."""

    sequence: int


SchedulerCommand = RunStep | StreamToken | FreeCache


@dataclass(frozen=True)
class SchedulerLimits:
    """How much the scheduler keeps in flight."""

    steps_in_flight: int = 1  # S: micro-batches on the ring at once (>= stages keeps it full)
    max_sequences: int = 8  # sequences admitted at once
    chunk_tokens: int = 256  # prefill tokens per step, all rows together
    kv_budget: KvBudget | None = None  # None: no limit
    max_context: int | None = None  # the model's positions: prompt + max_tokens must fit

    def __post_init__(self) -> None:
        for name in ("steps_in_flight", "max_sequences", "chunk_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_context is not None and self.max_context < 1:
            raise ConfigError(f"max_context must be >= 1, got {self.max_context}")
        budget = self.kv_budget
        if budget is None or callable(budget):
            return
        sizes = list(budget) if isinstance(budget, Sequence) else [budget]
        if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
            raise ConfigError(
                "kv_budget must be a number of tokens >= 1, one per stage, or a "
                f"predicate over the reservations, got {budget!r}"
            )


@dataclass
class _Sequence:
    id: int
    prompt_len: int
    params: SamplingParams
    checker: StopChecker
    reserved: int
    tokens: list[int]  # prompt + generated
    fed: int = 0  # tokens the stages' caches hold
    in_step: int | None = None
    cancelled: bool = False
    ready_since: int = 0

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass
class _Waiting:
    id: int
    prompt: tuple[int, ...]
    params: SamplingParams
    reserved: int
    checker: StopChecker
    generated: tuple[int, ...]


class SequenceScheduler:
    """The sequences of one generation run and the steps that carry them."""

    def __init__(
        self,
        limits: SchedulerLimits | None = None,
        *,
        eos_ids: Iterable[int] = (),
        detokenizer: Detokenizer | None = None,
    ) -> None:
        self.limits = limits or SchedulerLimits()
        self._eos = frozenset(eos_ids)
        self._detokenizer = detokenizer
        self._waiting: list[_Waiting] = []
        self._admitted: dict[int, _Sequence] = {}
        self._steps: dict[int, RunStep] = {}
        self._next_step = 0
        self._clock = 0  # orders ready sequences: the longest-ready rides first
        self._paused = False
        self._stale_caches: set[int] = set()  # caches to free once the pipeline is back

    # -- what the shell and tests may look at ---------------------------------

    @property
    def admitted(self) -> tuple[int, ...]:
        return tuple(self._admitted)

    @property
    def waiting(self) -> tuple[int, ...]:
        return tuple(w.id for w in self._waiting)

    @property
    def steps_in_flight(self) -> tuple[RunStep, ...]:
        return tuple(self._steps.values())

    @property
    def idle(self) -> bool:
        """Nothing admitted, waiting or in flight: the run may end."""
        return not (self._admitted or self._waiting or self._steps)

    def generated(self, sequence: int) -> tuple[int, ...]:
        """The tokens an admitted sequence has generated so far."""
        seq = self._admitted[sequence]
        return tuple(seq.tokens[seq.prompt_len :])

    def expects(self, step: int) -> bool:
        """Whether `step` is in flight (False for a step lost to a failure: drop
        its logits instead of sampling them)."""
        return step in self._steps

    def sampling(self, step: int) -> tuple[list[SamplingParams], list[int]]:
        """For the sampler (`sample_tokens(logits, *scheduler.sampling(step))`): the
        settings and token indices of the step's sampling rows, in order."""
        rows = self._steps[step].sampling_rows
        params = [self._admitted[r.sequence].params for r in rows]
        return params, [r.sample_index for r in rows if r.sample_index is not None]

    # -- events -----------------------------------------------------------------

    def submit(
        self,
        sequence: int,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        generated: Sequence[int] = (),
    ) -> list[SchedulerCommand]:
        """A new request; it waits for admission. Refused (ConfigError) when its
        id is in use, its prompt is empty, or it cannot fit even alone.

        `generated`: tokens this sequence already streamed under a scheduler that
        is gone (its host died); the client knows them. They are replayed into the
        stop state without streaming again, the first step prefills prompt +
        generated, and the stream goes on at index ``len(generated)``.
        """
        if sequence in self._admitted or any(w.id == sequence for w in self._waiting):
            raise ConfigError(f"sequence {sequence} is already in this run")
        if not prompt:
            raise ConfigError(f"sequence {sequence}: the prompt is empty")
        if any(
            isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in (*prompt, *generated)
        ):
            raise ConfigError(f"sequence {sequence}: token ids must be integers >= 0")
        reserved = len(prompt) + params.max_tokens
        context = self.limits.max_context
        if context is not None and reserved > context:
            raise RequestRefused(
                f"sequence {sequence}: prompt of {len(prompt)} tokens + max_tokens "
                f"{params.max_tokens} exceed the model's context of {context} tokens",
                CONTEXT_LENGTH,
            )
        if not self._fits([reserved]):
            raise RequestRefused(
                f"sequence {sequence}: prompt of {len(prompt)} tokens + max_tokens "
                f"{params.max_tokens} = {reserved} tokens do not fit the KV cache "
                f"({self._budget_words()}); shorten the prompt or lower max_tokens",
                CAPACITY,
            )
        # built now, so a request it refuses (stop strings, no tokenizer) is refused here
        checker = StopChecker(params, self._eos, self._detokenizer)
        for token in generated:
            if checker.finish_reason is not None:
                break
            checker.push(token)
        if checker.finish_reason is not None:
            raise ConfigError(
                f"sequence {sequence} already finished ({checker.finish_reason}) "
                "within the generated tokens given"
            )
        self._waiting.append(
            _Waiting(sequence, tuple(prompt), params, reserved, checker, tuple(generated))
        )
        return self._fill()

    def step_done(self, step: int, tokens: Sequence[int]) -> list[SchedulerCommand]:
        """A step came out of the last stage with one token per sampling row.
        A step this scheduler no longer waits for (one lost to a failure) is
        ignored."""
        run = self._steps.get(step)
        if run is None:
            return []
        sampling = run.sampling_rows
        if len(tokens) != len(sampling):
            raise ProtocolError(
                f"step {step} has {len(sampling)} sampling rows, got {len(tokens)} tokens"
            )
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in tokens):
            raise ProtocolError(f"step {step}: token ids must be integers >= 0, got {tokens!r}")
        del self._steps[step]
        out: list[SchedulerCommand] = []
        picked = dict(zip((r.sequence for r in sampling), tokens, strict=True))
        for row in run.rows:
            seq = self._admitted[row.sequence]
            seq.fed += len(row.tokens)
            seq.in_step = None
            seq.ready_since = self._tick()
            if seq.cancelled:
                out.extend(self._drop(seq))
                continue
            if row.sample_index is None:
                continue
            token = int(picked[row.sequence])
            seq.tokens.append(token)
            decision = seq.checker.push(token)
            event = TokenEvent(
                seq.id, row.sample_index, token, decision.text, decision.finish_reason
            )
            out.append(StreamToken(event))
            if decision.finish_reason is not None:
                out.extend(self._drop(seq))
        # stream first, then free (the memory a new sequence's prefill will use), then run
        out.sort(key=lambda c: isinstance(c, FreeCache))
        return out + self._fill()

    def cancel(self, sequence: int) -> list[SchedulerCommand]:
        """Its client went away: forget it. A sequence inside a step in flight
        is freed when that step comes back (a free sent earlier could reach a
        stage before the step does, which would then keep a cache for it)."""
        for i, w in enumerate(self._waiting):
            if w.id == sequence:
                del self._waiting[i]
                return self._fill()
        seq = self._admitted.get(sequence)
        if seq is None or seq.cancelled:
            return []
        if self._paused:
            # its cache (if any) is among the stale ones freed on restore
            self._release(seq)
            return self._fill()  # admits who now fits; starts nothing while paused
        if seq.in_step is not None:
            seq.cancelled = True
            return []
        return [*self._drop(seq), *self._fill()]

    def stage_failed(self) -> list[SchedulerCommand]:
        """A stage died: the steps in flight are lost and so is every cache. No
        step starts until `pipeline_restored`."""
        self._paused = True
        self._steps.clear()
        for seq in list(self._admitted.values()):
            self._stale_caches.add(seq.id)
            seq.in_step = None
            seq.fed = 0
            if seq.cancelled:
                self._release(seq)
        return []

    def pipeline_restored(self) -> list[SchedulerCommand]:
        """The re-planned pipeline is up: free the old caches, then rebuild each
        sequence's by prefilling its prompt and generated tokens."""
        if not self._paused:
            return []
        self._paused = False
        out: list[SchedulerCommand] = [FreeCache(s) for s in sorted(self._stale_caches)]
        self._stale_caches.clear()
        return out + self._fill()

    # -- internals --------------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _drop(self, seq: _Sequence) -> list[SchedulerCommand]:
        self._release(seq)
        return [FreeCache(seq.id)]

    def _release(self, seq: _Sequence) -> None:
        del self._admitted[seq.id]

    def _fits(self, reservations: Sequence[int]) -> bool:
        budget = self.limits.kv_budget
        if budget is None:
            return True
        if callable(budget):
            return bool(budget(reservations))
        if isinstance(budget, int):
            return sum(reservations) <= budget
        return sum(reservations) <= min(budget)

    def _budget_words(self) -> str:
        budget = self.limits.kv_budget
        if isinstance(budget, int):
            return f"{budget} tokens"
        if isinstance(budget, Sequence):
            return f"{min(budget)} tokens on the smallest stage"
        return "the planner's memory budget"

    def _admit(self) -> None:
        # in arrival order: a request that does not fit yet holds the ones behind
        # it, so a long prompt is not starved by a stream of short ones
        while self._waiting and len(self._admitted) < self.limits.max_sequences:
            head = self._waiting[0]
            if not self._fits([*(s.reserved for s in self._admitted.values()), head.reserved]):
                break
            del self._waiting[0]
            self._admitted[head.id] = _Sequence(
                head.id,
                len(head.prompt),
                head.params,
                head.checker,
                head.reserved,
                [*head.prompt, *head.generated],
                ready_since=self._tick(),
            )

    def _fill(self) -> list[SchedulerCommand]:
        self._admit()
        if self._paused:
            return []
        out: list[SchedulerCommand] = []
        while len(self._steps) < self.limits.steps_in_flight:
            run = self._form_step()
            if run is None:
                break
            self._steps[run.step] = run
            out.append(run)
        return out

    def _form_step(self) -> RunStep | None:
        ready = sorted(
            (s for s in self._admitted.values() if s.in_step is None and not s.cancelled),
            key=lambda s: s.ready_since,
        )
        if not ready:
            return None
        cap = math.ceil(len(self._admitted) / self.limits.steps_in_flight)
        budget = self.limits.chunk_tokens
        step = self._next_step
        rows: list[Row] = []
        for seq in ready:
            if len(rows) == cap:
                break
            pending = len(seq.tokens) - seq.fed
            take = 1 if pending == 1 else min(pending, budget)
            if take == 0:
                continue
            if pending > 1:
                budget -= take
            last = take == pending
            rows.append(
                Row(
                    seq.id,
                    tuple(seq.tokens[seq.fed : seq.fed + take]),
                    seq.fed,
                    seq.generated if last else None,
                    seq.reserved,
                )
            )
            seq.in_step = step
        if not rows:
            return None
        self._next_step += 1
        return RunStep(step, tuple(rows))


__all__ = [
    "FreeCache",
    "KvBudget",
    "Row",
    "RunStep",
    "SchedulerCommand",
    "SchedulerLimits",
    "SequenceScheduler",
    "StreamToken",
]
