"""A ``transformers`` causal LM in this process, as a :class:`GenerationBackend`.

The single-process baseline: ``python -m zpipe serve`` serves it today, and
``bench/generate.py`` compares the pipelined run against it. A manual token
loop with the model's KV cache (``cache``, once ``past_key_values``) rather than
``model.generate``, so that a sequence can be cancelled between any two tokens
and follows the same rules as the pipelined run's last stage: the next token is
the generation core's :func:`~zpipe.generation.sampling.sample_token` (greedy is
``argmax``, as ``generate`` does; a sampled draw is seeded by the request's seed
and the token's index), and :class:`~zpipe.generation.StopChecker` decides the
end of the sequence and the text each token makes final.

Every forward pass runs on one worker thread (the model is not shared between
threads), so concurrent requests interleave token by token and the event loop
stays free. A sequence's cache lives in its generator and is dropped when the
generator ends or is closed.

``transformers`` is imported when a model is loaded (it is in the ``test`` and
``serve`` extras).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from zpipe._errors import ConfigError
from zpipe.generation import (
    SamplingParams,
    SkipSpecialTokens,
    StopChecker,
    TokenEvent,
    eos_ids_from,
)
from zpipe.generation.sampling import sample_token


class TransformersBackend:
    """Serve ``model`` (a ``transformers`` causal LM) with ``tokenizer``."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any | None,
        *,
        model_id: str,
        max_context: int | None = None,
    ) -> None:
        self._model = model.eval()
        self._tokenizer = tokenizer
        self._model_id = model_id
        limit = _context_of(model.config) if max_context is None else max_context
        if limit is None or limit < 2:
            raise ConfigError(
                f"cannot tell {model_id}'s context length from its config: give max_context"
            )
        self._max_context = int(limit)
        eos = getattr(model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(model.config, "eos_token_id", None)
        if eos is None and tokenizer is not None:
            eos = tokenizer.eos_token_id
        self._eos = eos_ids_from(eos)
        self._detokenizer = None if tokenizer is None else SkipSpecialTokens(tokenizer)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zpipe-model")
        self._sequences = itertools.count()
        self.live_sequences = 0  # generators started and not yet ended or closed

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        *,
        model_id: str | None = None,
        max_context: int | None = None,
    ) -> TransformersBackend:
        """Load a Hugging Face checkpoint directory (model, and its tokenizer when
        the directory has one)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(directory)
        if not path.is_dir():
            raise ConfigError(f"--model {directory}: not a directory")
        model = AutoModelForCausalLM.from_pretrained(path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError):  # a checkpoint without tokenizer files
            tokenizer = None
        return cls(
            model, tokenizer, model_id=model_id or path.resolve().name, max_context=max_context
        )

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def tokenizer(self) -> Any | None:
        return self._tokenizer

    @property
    def max_context(self) -> int:
        return self._max_context

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ConfigError("the prompt is empty")
        if len(prompt) + params.max_tokens > self._max_context:
            raise ConfigError(
                f"{len(prompt)} prompt tokens + max_tokens {params.max_tokens} exceed "
                f"the context length {self._max_context}"
            )
        sequence = next(self._sequences)
        stops = StopChecker(params, self._eos, self._detokenizer)
        state = _Sequence(self._model, params)
        loop = asyncio.get_running_loop()
        self.live_sequences += 1
        try:
            step_input = prompt
            for index in range(params.max_tokens):
                token = await loop.run_in_executor(self._worker, state.step, step_input, index)
                decision = stops.push(token)
                yield TokenEvent(sequence, index, token, decision.text, decision.finish_reason)
                if decision.finish_reason is not None:
                    return
                step_input = [token]
        finally:
            state.release()
            self.live_sequences -= 1


class _Sequence:
    """One sequence's cache; :meth:`step` runs on the worker thread."""

    def __init__(self, model: Any, params: SamplingParams) -> None:
        self._model = model
        self._params = params
        self._cache: Any = None
        # transformers 5 renamed `past_key_values` to `cache` (the old name warns)
        self._cache_arg = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )

    def step(self, input_ids: list[int], index: int) -> int:
        """Feed tokens (the prompt, then each new token), return the next one: the
        sequence's generated token number ``index``."""
        with torch.inference_mode():
            out = self._model(
                input_ids=torch.tensor([input_ids], dtype=torch.long),
                use_cache=True,
                **{self._cache_arg: self._cache},
            )
            self._cache = out[self._cache_arg]
            return sample_token(out.logits[0, -1, :], self._params, index)

    def release(self) -> None:
        self._cache = None


def _context_of(config: Any) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
