"""When a sequence stops, and which text of it is final: one `StopChecker` per sequence.

A sequence stops at its end-of-sequence token (`eos`), when its token budget is
spent (`length`), or when its text contains one of the request's stop strings
(`stop`). The text follows OpenAI's semantics: it streams as it becomes final,
the stop string itself and everything after it is never emitted, and only the
tail that could still be the start of a stop string is held back (until the
next token settles it, or the sequence ends and it is flushed).

Tokens do not map to text one by one: a character may take several byte
tokens, and a tokenizer may merge or re-space pieces. So the checker decodes
the whole generated id list each step and emits the part beyond what it already
emitted; a decoded text that ends in U+FFFD (an unfinished multi-byte
character) keeps that tail back until the character completes. The EOS token
contributes no text (``skip_special_tokens``' behaviour).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from zpipe._errors import ConfigError
from zpipe.generation.params import FinishReason, SamplingParams

_REPLACEMENT = "\ufffd"


class Detokenizer(Protocol):
    """What the stop checker needs of a tokenizer: the text of a list of ids,
    special tokens left out (wrap a `transformers` tokenizer in
    `SkipSpecialTokens`)."""

    def decode(self, ids: Sequence[int]) -> str: ...


class SkipSpecialTokens:
    """A `transformers` tokenizer as a `Detokenizer`: its ``decode`` keeps special
    tokens (``<|im_end|>``, ``</s>``) by default; streamed text must not."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))


@dataclass(frozen=True)
class StopDecision:
    """What one token adds: the text that became final with it, and why the
    sequence finished (None: it goes on)."""

    text: str
    finish_reason: FinishReason | None = None


def eos_ids_from(value: int | Sequence[int] | None) -> frozenset[int]:
    """The end-of-sequence ids from a config's ``eos_token_id`` (an int, a list of
    ints as Llama 3's and Qwen2's configs give, or None)."""
    if value is None:
        return frozenset()
    items = [value] if isinstance(value, int) else list(value)
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in items):
        raise ConfigError(f"eos_token_id must be a token id or a list of them, got {value!r}")
    return frozenset(items)


class StopChecker:
    """The stop and text state of one sequence: feed each generated token to `push`."""

    def __init__(
        self,
        params: SamplingParams,
        eos_ids: Collection[int] = (),
        detokenizer: Detokenizer | None = None,
    ) -> None:
        if params.stop and detokenizer is None:
            raise ConfigError("stop strings need a tokenizer: give the model's tokenizer")
        self._params = params
        # end tokens carry no text even when they do not stop the sequence
        self._no_text = frozenset(eos_ids)
        self._eos = self._no_text if params.stop_at_eos else frozenset()
        self._detokenizer = detokenizer
        self._stops = params.stop
        self._tokens: list[int] = []
        self._emitted = ""  # the text streamed so far
        self._text = ""  # the whole decoded text of the tokens that carry text
        self.finish_reason: FinishReason | None = None

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    @property
    def text(self) -> str:
        """Everything streamed so far (the final text once finished)."""
        return self._emitted

    def push(self, token: int) -> StopDecision:
        if self.finish_reason is not None:
            raise ValueError(f"the sequence already finished ({self.finish_reason})")
        if token in self._eos:
            # the end token adds no text; what was held back is final now
            self._tokens.append(token)
            return self._finish("eos", self._text)
        self._tokens.append(token)
        if self._detokenizer is not None:
            self._text = self._detokenizer.decode(
                [t for t in self._tokens if t not in self._no_text]
            )
        hit = self._first_stop()
        if hit is not None:
            return self._finish("stop", self._text[:hit])
        if len(self._tokens) >= self._params.max_tokens:
            return self._finish("length", self._text)
        return StopDecision(self._advance(self._text[: self._final_end()]))

    def _finish(self, reason: FinishReason, final: str) -> StopDecision:
        self.finish_reason = reason
        return StopDecision(self._advance(final), reason)

    def _advance(self, final: str) -> str:
        """Emit what `final` adds beyond the text streamed so far."""
        # When `final` does not extend the streamed text (a tokenizer that re-decodes
        # earlier text differently, which a rare merge can do), what was streamed
        # cannot be taken back: go on from the same length.
        delta = final[len(self._emitted) :]
        self._emitted += delta
        return delta

    def _first_stop(self) -> int | None:
        """Where the earliest stop string starts, searching only where one could
        start that the text streamed so far did not rule out."""
        if not self._stops:
            return None
        longest = max(len(s) for s in self._stops)
        start = max(0, len(self._emitted) - longest + 1)
        hits = [i for s in self._stops if (i := self._text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _final_end(self) -> int:
        """The end of the text that no later token can change or turn into a stop
        string: hold back an unfinished character and any tail that is the start
        of a stop string."""
        text = self._text
        end = len(text)
        while end > 0 and text[end - 1] == _REPLACEMENT:
            end -= 1
        held = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, end), held, -1):
                if text.endswith(stop[:k], 0, end):
                    held = k
                    break
        return end - held
