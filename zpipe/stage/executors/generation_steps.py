"""What a generation stage computes: one step through its units, and sampling at the end.

No sockets and no asyncio: :class:`GenerationStage` runs in the stage's compute
thread (the executor, :mod:`zpipe.stage.executors.generation`, hands it each step)
and is tested alone, chained in one process as the pipeline chains it.

A step's rows open a sequence's cache where they start at position 0 (for the
reservation the scheduler admitted it with), feed their tokens' values through the
stage's units, and at the last stage the rows with a sample index become tokens
(:func:`zpipe.generation.sampling.sample_tokens`: greedy rows are ``argmax``,
sampled rows follow their seed and index).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from zpipe._errors import ConfigError, ProtocolError
from zpipe.generation.params import SamplingParams
from zpipe.generation.sampling import sample_tokens
from zpipe.generation.sequences import RunStep, SchedulerCommand, SequenceScheduler
from zpipe.generation.stopping import Detokenizer, SkipSpecialTokens
from zpipe.generation.wire import (
    DTYPE_BYTES,
    rows_from_wire,
    rows_to_wire,
    sampling_from_wire,
    sampling_to_wire,
    tokens_from_wire,
)
from zpipe.models import ModelSpec
from zpipe.models.causal_lm import CausalLmStage, SequenceChunk
from zpipe.protocol import WireMessage
from zpipe.protocol.generation import GenFree, GenSetup, GenStep, GenSubmit
from zpipe.transport.emulation import emulate_slowdown


@dataclass(frozen=True)
class StepOut:
    """A step's result here: hidden states for the next stage, or (last stage) the
    token of each sampling row, in row order."""

    values: torch.Tensor | None = None
    tokens: tuple[int, ...] = ()


class GenerationStage:
    """A stage's units of a generation run and their KV cache. Not thread-safe: one
    thread (the compute thread) steps, opens and frees."""

    def __init__(self, stage: CausalLmStage) -> None:
        self.stage = stage

    @classmethod
    def build(cls, setup: GenSetup, device: torch.device | str | None = None) -> GenerationStage:
        spec = ModelSpec.from_dict(setup.model)
        dtype = None if setup.dtype is None else getattr(torch, setup.dtype)
        stage = CausalLmStage.build(
            spec,
            setup.start,
            setup.end,
            kv_budget_bytes=setup.kv_budget_bytes,
            max_context=setup.max_context,
            dtype=dtype,
            device=device,
        )
        return cls(stage)

    @property
    def is_last(self) -> bool:
        return self.stage.is_last

    def step(self, message: GenStep) -> StepOut:
        """Run ``message``'s rows; ProtocolError when they do not fit the step (the
        stage's own errors, a sequence that does not continue its cache or a cache that
        is full, pass through)."""
        rows = rows_from_wire(message.rows)
        samples = [sample for _, _, _, sample, _ in rows if sample is not None]
        params = sampling_from_wire(message.sampling, len(samples))
        if len(message.tensors) != 1:
            raise ProtocolError(f"gen_step carries {len(message.tensors)} tensors, not 1")
        for sequence, position, _, _, reserved in rows:
            if position == 0:
                self.stage.open_sequence(sequence, reserved)
        chunks = [SequenceChunk(seq, position, length) for seq, position, length, _, _ in rows]
        out = self.stage.forward(chunks, message.tensors[0])
        if not self.is_last:
            return StepOut(values=out)
        picked = [i for i, (_, _, _, sample, _) in enumerate(rows) if sample is not None]
        if not picked:
            return StepOut()
        return StepOut(tokens=tuple(sample_tokens(out[picked], params, samples)))

    def free(self, sequences: Iterable[int]) -> None:
        for sequence in sequences:
            self.stage.free_sequence(sequence)

    def free_all(self) -> int:
        return self.stage.free_all()


def first_step(
    run: int,
    step: RunStep,
    params: list[SamplingParams],
    *,
    src: str,
    epoch: int,
) -> GenStep:
    """The first stage's step message for the scheduler's ``step``: its rows, its
    sampling rows' settings (``params``, in row order) and their token ids, packed."""
    ids = [token for row in step.rows for token in row.tokens]
    return GenStep(
        run=run,
        step=step.step,
        src=src,
        rows=rows_to_wire(step.rows),
        sampling=sampling_to_wire(params),
        tensors=(torch.tensor(ids, dtype=torch.int64),),
        epoch=epoch,
    )


def after_failed_step(
    scheduler: SequenceScheduler, sequences: Iterable[int]
) -> list[SchedulerCommand]:
    """The first stage's scheduler after a step failed somewhere on the ring: its
    ``sequences`` end (the caller tells their clients), and every other sequence goes
    on. The failed step never comes back and may have written part of its rows'
    caches, so the pipeline counts as restored afresh (the scheduler's recovery: free
    every cache, prefill prompt + generated again), which keeps greedy output
    exact; the steps still in flight are forgotten, and their late tokens ignored."""
    out: list[SchedulerCommand] = []
    for sequence in sequences:
        out += scheduler.cancel(sequence)
    out += scheduler.stage_failed()
    return out + scheduler.pipeline_restored()


def same_units(before: GenSetup, after: GenSetup) -> bool:
    """Whether ``after`` (a re-plan of run ``before.run``) leaves a stage the units
    it built for ``before``, from the same model, with caches of the same shape
    and budget: then it keeps them (emptied) instead of reading them again."""
    return before.run == after.run and all(
        getattr(before, name) == getattr(after, name)
        for name in ("model", "start", "end", "dtype", "kv_budget_bytes", "max_context")
    )


def submitted_tokens(message: GenSubmit, vocab: int) -> tuple[list[int], list[int]]:
    """A ``gen_submit``'s prompt (its first int64 tensor) and the tokens the sequence
    already generated (a second one, when the client sends it again after a re-plan:
    the scheduler prefills both and the stream goes on at the next index)."""
    if len(message.tensors) not in (1, 2):
        raise ProtocolError(f"gen_submit carries {len(message.tensors)} tensors, not 1 or 2")
    out = []
    for tensor, what in zip(message.tensors, ("prompt", "generated tokens"), strict=False):
        if tensor.dtype != torch.int64 or tensor.dim() != 1:
            raise ProtocolError(f"gen_submit: the {what} must be int64 token ids [n]")
        ids = [int(t) for t in tensor.tolist()]
        if any(t >= vocab for t in ids):
            raise ConfigError(f"token ids must be below the vocabulary's {vocab}")
        out.append(ids)
    return out[0], out[1] if len(out) == 2 else []


def load_detokenizer(setup: GenSetup) -> Detokenizer:
    """The tokenizer of the model's checkpoint directory, for the first stage's text
    and stop strings; ConfigError when there is none (or no ``transformers``)."""
    spec = ModelSpec.from_dict(setup.model)
    if spec.weights is None:
        raise ConfigError("text needs a checkpoint directory with a tokenizer; this model has none")
    try:
        import transformers  # optional: only text needs it
    except ImportError:
        raise ConfigError("text needs the transformers package on the first stage") from None
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(spec.weights))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"no tokenizer in {spec.weights}: {exc}") from None
    return SkipSpecialTokens(tokenizer)


# Bytes of a message's header and framing beyond its tensor (a step's rows).
HEADER_ROOM = 64 << 10


def largest_message(setup: GenSetup, work: GenerationStage) -> int:
    """The largest frame this stage receives: hidden states of a step's tokens (at
    most chunk_tokens of prefill and one per other sequence), or a prompt."""
    config = work.stage.config
    element = DTYPE_BYTES[setup.dtype or "float32"]
    tokens = setup.chunk_tokens + setup.max_sequences
    return max(tokens * config.hidden * element, setup.max_context * 8) + HEADER_ROOM


def compute_step(work: GenerationStage, step: GenStep, slowdown_factor: float) -> StepOut:
    """One step in the compute thread, held as long as the emulated device's
    slowdown says (:func:`zpipe.transport.emulation.emulate_slowdown`)."""
    started, cpu = time.perf_counter(), time.thread_time()
    out = work.step(step)
    emulate_slowdown(slowdown_factor, time.perf_counter() - started, time.thread_time() - cpu)
    return out


def expect_sender(src: object, expected: str, message: WireMessage) -> None:
    """A run's message must come from the peer the set-up names for its kind."""
    if src != expected:
        raise ProtocolError(f"{message.KIND} from {src!r}, but it must come from {expected!r}")


def freed_sequences(message: GenFree) -> tuple[int, ...]:
    return tuple(tokens_from_wire(message.sequences, "sequences"))
