"""What the HTTP endpoint needs from whatever generates tokens.

The endpoint never touches a model: it validates a request, turns its prompt
into token ids with :attr:`GenerationBackend.tokenizer`, and iterates
:meth:`GenerationBackend.generate`. A backend applies every rule of
:class:`~zpipe.generation.SamplingParams` itself (sampling, ``max_tokens``,
end of sequence, stop strings), because the pipelined run applies them on its
last stage, far from the endpoint.

The contract of :meth:`~GenerationBackend.generate`:

- each :class:`~zpipe.generation.TokenEvent` carries the text it adds
  (``text``; concatenated, the events' texts are the completion), with a
  matched stop string and anything after it left out;
- the last event carries ``finish_reason`` (``"length"``, ``"eos"`` or
  ``"stop"``), and the stream ends after it;
- closing the async generator early (``aclose()``, which the endpoint does when
  its HTTP client goes away or a wait times out) cancels the sequence and frees
  what it holds (its KV cache) -- that is how cancellation reaches the backend;
  that clean-up must be prompt (bounded by its own deadlines), since the
  endpoint waits for it;
- an error before the first event that is the request's fault is a
  :class:`~zpipe._errors.ConfigError` (the endpoint answers 400); any other
  exception is the model's failure (500, or an error event mid-stream).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol, runtime_checkable

from zpipe.generation import SamplingParams, TokenEvent


@runtime_checkable
class GenerationBackend(Protocol):
    """A model that streams tokens for a prompt (see the module's contract)."""

    @property
    def model_id(self) -> str:
        """The name clients ask for in a request's ``model`` field."""
        ...

    @property
    def tokenizer(self) -> Any | None:
        """A ``transformers`` tokenizer, or None (then only token-id prompts work)."""
        ...

    @property
    def max_context(self) -> int:
        """Prompt plus generated tokens of one sequence, at most."""
        ...

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        """An async generator of the sequence's events; ``aclose()`` cancels it."""
        ...
