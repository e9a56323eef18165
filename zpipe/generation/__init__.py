"""Pipelined generation with causal language models: the pure core.

What a generation request asks for (`SamplingParams`) and what a run streams
back (`TokenEvent`) live here, below the run time and the HTTP endpoint, so that
the sampler on the last stage, the client's stream and `zpipe serve` share one
definition of each. No I/O: the stage and client shells carry these values.

The loop's pure parts: `StopChecker` (when a sequence ends, which text is final),
`SequenceScheduler` (which sequences ride which step, events in and commands
out) and, in `zpipe.generation.sampling` (it imports torch),
`sample_tokens`, the seeded sampler.
"""

from __future__ import annotations

from zpipe.generation.params import FinishReason, SamplingParams, TokenEvent
from zpipe.generation.sequences import (
    FreeCache,
    KvBudget,
    Row,
    RunStep,
    SchedulerCommand,
    SchedulerLimits,
    SequenceScheduler,
    StreamToken,
)
from zpipe.generation.stopping import (
    Detokenizer,
    SkipSpecialTokens,
    StopChecker,
    StopDecision,
    eos_ids_from,
)

__all__ = [
    "Detokenizer",
    "FinishReason",
    "FreeCache",
    "KvBudget",
    "Row",
    "RunStep",
    "SamplingParams",
    "SchedulerCommand",
    "SchedulerLimits",
    "SequenceScheduler",
    "SkipSpecialTokens",
    "StopChecker",
    "StopDecision",
    "StreamToken",
    "TokenEvent",
    "eos_ids_from",
]
