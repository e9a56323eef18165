"""What every unit of a stage needs to know about one step: positions, the mask,
and where its blocks' keys and values go.

A step carries several sequences, each with its own number of new tokens and
of cached tokens. Units see them padded to ``[B, N, ...]`` (N the longest
chunk); the mask lets query ``j`` of sequence ``b`` (position ``start_b + j``)
see keys ``0 .. start_b + j`` of that sequence only, so every row is what the
sequence alone would compute. Padded query rows attend as the row's last real
token does (finite values, never read).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zpipe.models.causal_lm.kv_cache import KvCache, SequenceChunk
from zpipe.models.causal_lm.rope import Rotary


class StepContext:
    def __init__(
        self,
        *,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        chunks: Sequence[SequenceChunk] = (),
        cache: KvCache | None = None,
    ) -> None:
        self.positions = positions  # [B, N] int64
        self.mask = mask  # [B, 1, N, T] bool (True: attend), or None: all
        self.chunks = chunks
        self.cache = cache
        self._cos_sin: tuple[torch.Tensor, ...] | None = None

    @classmethod
    def causal(cls, batch: int, length: int, device: torch.device) -> StepContext:
        """A whole sequence at once, nothing cached (a stateless forward)."""
        positions = torch.arange(length, device=device).expand(batch, length)
        mask = None
        if length > 1:
            mask = torch.ones(length, length, dtype=torch.bool, device=device).tril()
            mask = mask.expand(batch, 1, length, length)
        return cls(positions=positions, mask=mask)

    @classmethod
    def for_chunks(
        cls, chunks: Sequence[SequenceChunk], cache: KvCache, device: torch.device
    ) -> StepContext:
        starts = torch.tensor([c.start for c in chunks], dtype=torch.int64, device=device)
        lengths = torch.tensor([c.length for c in chunks], dtype=torch.int64, device=device)
        longest = int(lengths.max())
        offsets = torch.arange(longest, device=device)
        # A padded token takes its row's last real position: valid for GPT-2's
        # position table and for the mask below.
        positions = starts[:, None] + torch.minimum(offsets[None, :], lengths[:, None] - 1)
        mask = None
        if len(chunks) > 1 or longest > 1:
            total = int((starts + lengths).max())
            keys = torch.arange(total, device=device)
            mask = (keys[None, None, :] <= positions[:, :, None]).unsqueeze(1)
        return cls(positions=positions, mask=mask, chunks=chunks, cache=cache)

    def keys_values(
        self, block: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """All keys/values a block's queries attend to: the new ones appended to the
        cache, or (no cache) the new ones alone."""
        if self.cache is None:
            return keys, values
        return self.cache.write_and_gather(block, self.chunks, keys, values)

    def cos_sin(self, rotary: Rotary, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The step's rotary cos and sin, computed once for all the stage's blocks."""
        if self._cos_sin is None:
            self._cos_sin = rotary.cos_sin(self.positions, dtype)
        return self._cos_sin
