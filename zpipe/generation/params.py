"""A generation request's sampling settings and the events a generation streams."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from zpipe._errors import ConfigError

# Why a sequence ended: its token budget, the model's end-of-sequence token, one of
# the request's stop strings, or a cancellation (its client went away).
FinishReason = Literal["length", "eos", "stop", "cancelled"]

MAX_STOP_STRINGS = 16  # OpenAI's API allows 4; more than 16 is a malformed request


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop.

    `temperature == 0` is greedy (argmax, ties to the lowest id, like
    `torch.argmax`); otherwise the logits are divided by `temperature`, cut to the
    `top_k` most likely tokens (0: no cut) and to the smallest set whose
    probability reaches `top_p` (1.0: no cut), and sampled from a generator
    seeded with `seed`, so a seeded request is reproducible.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    # stop at the model's end-of-sequence token (False: run to max_tokens)
    stop_at_eos: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ConfigError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not _finite_number(self.temperature) or self.temperature < 0:
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        if not _finite_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ConfigError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class TokenEvent:
    """One step of one sequence's stream: the token chosen at `index` (0-based
    among the generated tokens), the text it completes when a tokenizer is known,
    and, on the last event of the sequence, why it finished."""

    sequence: int
    index: int
    token: int
    text: str = ""
    finish_reason: FinishReason | None = None


def _finite_number(value: object) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )
