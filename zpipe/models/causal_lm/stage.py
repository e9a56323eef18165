"""One stage of a causal LM: units ``[start, end)``, their KV cache, and a step.

A step is a micro-batch of several sequences, each with its new tokens (a
prefill chunk, or one token when decoding) at positions that continue what the
stage has cached for it. Values travel *packed*: the new tokens of every
sequence one after another, in the order of the chunks, as one tensor that
crosses a stage boundary as it is:

    first stage    int64 token ids        [T]        T = sum of chunk lengths
    other stages   hidden states          [T, hidden]
    last stage ->  logits of each chunk's last token [B, vocab]
                   (or of every token, [T, vocab], with all_logits=True)

    stage = CausalLmStage.build(spec, 0, 3, kv_budget_bytes=64 << 20)
    stage.open_sequence(7, max_tokens=40)       # KvCacheFullError if it cannot fit
    hidden = stage.forward([SequenceChunk(7, 0, 12)], token_ids)
    stage.free_sequence(7)

Every row is computed as that sequence alone would be (see StepContext).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from zpipe._errors import ConfigError
from zpipe.models.causal_lm.config import CausalLmConfig
from zpipe.models.causal_lm.context import StepContext
from zpipe.models.causal_lm.family import FAMILY, CausalLmSequence
from zpipe.models.causal_lm.kv_cache import KvCache, SequenceChunk
from zpipe.models.causal_lm.units import LmHead
from zpipe.models.spec import ModelSpec


class CausalLmStage:
    """Units ``[start, end)`` of a causal LM, serving many sequences with a KV cache.

    ``kv_budget_bytes``: the most bytes the cache may reserve (None: unbounded);
    ``max_context``: the most tokens of one sequence (default and limit: the
    model's ``max_position_embeddings``). The cache takes the units' dtype and
    device. Not thread-safe: open, free and step from one thread (a stage's
    compute thread).
    """

    def __init__(
        self,
        config: CausalLmConfig,
        units: Sequence[nn.Module],
        *,
        start: int,
        kv_budget_bytes: int | None = None,
        max_context: int | None = None,
    ) -> None:
        end = start + len(units)
        if not units or not 0 <= start < end <= config.num_units:
            raise ConfigError(
                f"a stage holds units [start, end) within [0, {config.num_units}), "
                f"got [{start}, {end})"
            )
        if max_context is not None and not 1 <= max_context <= config.max_positions:
            raise ConfigError(
                f"max_context must be in [1, {config.max_positions}] (the model's "
                f"positions), got {max_context}"
            )
        self.config = config
        self.units = list(units)
        self.start, self.end = start, end
        first = next(iter(self.units[0].parameters()))
        self.device, self.dtype = first.device, first.dtype
        self.cache = KvCache(
            blocks=range(max(start, 1) - 1, min(end, config.num_units - 1) - 1),
            kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            max_context=max_context or config.max_positions,
            budget_bytes=kv_budget_bytes,
            dtype=self.dtype,
            device=self.device,
        )

    @classmethod
    def build(
        cls,
        spec: ModelSpec,
        start: int,
        end: int,
        *,
        kv_budget_bytes: int | None = None,
        max_context: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> CausalLmStage:
        """Build units ``[start, end)`` of a ``causal_lm`` spec (reading only their
        weights, in float32, then moved to `dtype` and `device` if given) and an
        empty cache."""
        if spec.family != FAMILY:
            raise ConfigError(f"a causal LM stage needs a {FAMILY!r} spec, got {spec.family!r}")
        sequence = CausalLmSequence(spec)
        units = sequence.build_units(start, end)
        if dtype is not None or device is not None:
            units = [unit.to(device=device, dtype=dtype) for unit in units]
        return cls(
            sequence.config,
            units,
            start=start,
            kv_budget_bytes=kv_budget_bytes,
            max_context=max_context,
        )

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == self.config.num_units

    def open_sequence(self, sequence_id: int, max_tokens: int) -> None:
        """Reserve cache for a sequence of at most `max_tokens` tokens (prompt plus
        new tokens), or raise KvCacheFullError; nothing else changes then."""
        self.cache.open(sequence_id, max_tokens)

    def free_sequence(self, sequence_id: int) -> bool:
        """Drop a finished (or abandoned) sequence's cache; False if it was not open."""
        return self.cache.free(sequence_id)

    def free_all(self) -> int:
        """Drop every sequence's cache (a re-plan, a lost client); returns how many."""
        return self.cache.clear()

    def cached_tokens(self, sequence_id: int) -> int:
        return self.cache.length(sequence_id)

    @torch.no_grad()
    def forward(
        self,
        chunks: Sequence[SequenceChunk],
        values: torch.Tensor,
        *,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Run the step through the stage's units; see the module docstring for shapes.

        Refused before any compute (SequenceStateError, ConfigError) when a chunk
        does not continue its sequence's cache or `values` does not fit the chunks.
        """
        chunks = list(chunks)
        self._check_values(chunks, values)
        self.cache.check(chunks)
        self.cache.prepare(chunks)
        lengths = [chunk.length for chunk in chunks]
        context = StepContext.for_chunks(chunks, self.cache, self.device)
        hidden = _pad(values.to(self.device), lengths)
        for unit in self.units:
            if isinstance(unit, LmHead):
                if not all_logits:
                    # Only the last token's logits choose the next token; the norm is per token.
                    last = torch.tensor(lengths, device=self.device) - 1
                    hidden = hidden[torch.arange(len(chunks), device=self.device), last]
                    self.cache.commit(chunks)
                    return unit(hidden)
                hidden = unit(hidden)
            else:
                hidden = unit(hidden, context)
        self.cache.commit(chunks)
        return _unpad(hidden, lengths)

    def _check_values(self, chunks: list[SequenceChunk], values: torch.Tensor) -> None:
        if not chunks:
            raise ConfigError("a step needs at least one sequence chunk")
        total = sum(chunk.length for chunk in chunks)
        if self.is_first:
            if values.dtype != torch.int64 or values.shape != (total,):
                raise ConfigError(
                    f"the first stage takes int64 token ids [{total}], got {values.dtype} "
                    f"{tuple(values.shape)}"
                )
            if total and (int(values.min()) < 0 or int(values.max()) >= self.config.vocab_size):
                raise ConfigError(f"token ids must be in [0, {self.config.vocab_size})")
        elif not values.is_floating_point() or values.shape != (total, self.config.hidden):
            raise ConfigError(
                f"stage [{self.start}, {self.end}) takes hidden states "
                f"[{total}, {self.config.hidden}], got {values.dtype} {tuple(values.shape)}"
            )


def _pad(values: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Packed [T, ...] -> [B, N, ...], N the longest chunk (padding repeats nothing useful)."""
    longest = max(lengths)
    if all(length == longest for length in lengths):
        return values.view(len(lengths), longest, *values.shape[1:])
    padded = values.new_zeros((len(lengths), longest, *values.shape[1:]))
    for row, part in enumerate(values.split(lengths)):
        padded[row, : part.shape[0]] = part
    return padded


def _unpad(padded: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    longest = padded.shape[1]
    if all(length == longest for length in lengths):
        return padded.reshape(sum(lengths), *padded.shape[2:])
    return torch.cat([padded[row, :length] for row, length in enumerate(lengths)])


def chain_forward(
    stages: Sequence[CausalLmStage],
    chunks: Sequence[SequenceChunk],
    token_ids: torch.Tensor,
    *,
    all_logits: bool = False,
) -> torch.Tensor:
    """One step through stages that hold the whole model in order, in this process
    (what a pipeline does across devices): token ids in, logits out."""
    values = token_ids
    for stage in stages:
        values = stage.forward(chunks, values, all_logits=all_logits)
    return values
