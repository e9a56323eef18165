"""Pipelined generation with causal language models: the pure core.

What a generation request asks for (`SamplingParams`) and what a run streams
back (`TokenEvent`) live here, below the run time and the HTTP endpoint, so that
the sampler on the last stage, the client's stream and `zpipe serve` share one
definition of each. No I/O: the stage and client shells carry these values.
"""

from __future__ import annotations

from zpipe.generation.params import FinishReason, SamplingParams, TokenEvent

__all__ = ["FinishReason", "SamplingParams", "TokenEvent"]
