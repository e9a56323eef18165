"""The KV cache of one stage: keys and values of its own decoder blocks, per sequence.

A sequence is opened with the most tokens it may ever hold (prompt plus the
tokens it may generate). Opening reserves that many tokens' bytes against the
stage's budget, so a sequence that does not fit is refused at once
(KvCacheFullError) and a sequence that was admitted can never run the stage
out of memory later: the cache grows by doubling, but never past a
sequence's reservation.

    cache.open(7, max_tokens=40)          # or KvCacheFullError
    cache.check(chunks)                   # SequenceStateError before computing
    cache.prepare(chunks)                 # room for the new tokens
    k, v = cache.write_and_gather(block, chunks, new_k, new_v)   # per block
    cache.commit(chunks)                  # the new tokens count as cached
    cache.free(7)

One tensor per sequence holds all the stage's blocks ([blocks, capacity, 2,
kv heads, head dim]: token-major, so a step writes a sequence's new tokens
with one copy and pads the batch's caches with one call), and a sequence
costs one allocation and one free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from zpipe._errors import ConfigError, KvCacheFullError, SequenceStateError

# The first allocation of a sequence holds at least this many tokens.
_MIN_CAPACITY = 16


@dataclass(frozen=True)
class SequenceChunk:
    """New tokens of one sequence in a step: positions ``start .. start + length - 1``.

    ``start`` equals the tokens this stage has cached for the sequence: prefill
    chunks and decode steps continue the cache and never rewrite it.
    """

    sequence_id: int
    start: int
    length: int

    def __post_init__(self) -> None:
        for name in ("sequence_id", "start", "length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"SequenceChunk.{name} must be an integer, got {value!r}")
        if self.start < 0 or self.length < 1:
            raise ConfigError(
                f"a chunk needs start >= 0 and length >= 1, got start={self.start}, "
                f"length={self.length}"
            )


class _Entry:
    __slots__ = ("length", "reserved", "store")

    def __init__(self, reserved: int) -> None:
        self.reserved = reserved
        self.length = 0
        self.store: torch.Tensor | None = None


class KvCache:
    """Keys and values of decoder blocks ``blocks`` (global indices) per sequence.

    ``budget_bytes`` None: no budget (only the context bounds a sequence).
    """

    def __init__(
        self,
        *,
        blocks: range,
        kv_heads: int,
        head_dim: int,
        max_context: int,
        budget_bytes: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise ConfigError(f"a KV cache budget must be >= 0 bytes, got {budget_bytes}")
        if max_context < 1:
            raise ConfigError(f"max_context must be at least 1, got {max_context}")
        self.blocks = blocks
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.max_context = max_context
        self.budget_bytes = budget_bytes
        self.dtype = dtype
        self.device = torch.device(device)
        element = torch.empty((), dtype=dtype).element_size()
        # A key and a value per block and token.
        self.bytes_per_token = len(blocks) * 2 * kv_heads * head_dim * element
        self._entries: dict[int, _Entry] = {}
        self._reserved_tokens = 0

    # --- admission ---------------------------------------------------------

    @property
    def reserved_bytes(self) -> int:
        return self._reserved_tokens * self.bytes_per_token

    @property
    def free_bytes(self) -> int | None:
        if self.budget_bytes is None:
            return None
        return self.budget_bytes - self.reserved_bytes

    def open(self, sequence_id: int, max_tokens: int) -> None:
        """Reserve room for ``max_tokens`` tokens of a new sequence, or refuse it."""
        if sequence_id in self._entries:
            raise SequenceStateError(sequence_id, "is already open on this stage")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ConfigError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        needed = max_tokens * self.bytes_per_token
        free = self.free_bytes
        if max_tokens > self.max_context:
            raise KvCacheFullError(
                sequence_id,
                needed_bytes=needed,
                free_bytes=free,
                detail=(
                    f"{max_tokens} tokens exceed the context of {self.max_context} tokens; "
                    "shorten the prompt or ask for fewer new tokens"
                ),
            )
        if free is not None and needed > free:
            raise KvCacheFullError(
                sequence_id,
                needed_bytes=needed,
                free_bytes=free,
                detail=(
                    f"its KV cache needs {needed} bytes ({max_tokens} tokens x "
                    f"{self.bytes_per_token} bytes) but {free} of the stage's "
                    f"{self.budget_bytes} bytes are free; retry when a sequence ends, "
                    "or give the stage more memory"
                ),
            )
        self._entries[sequence_id] = _Entry(max_tokens)
        self._reserved_tokens += max_tokens

    def free(self, sequence_id: int) -> bool:
        """Drop a sequence's cache and reservation; False if it was not open."""
        entry = self._entries.pop(sequence_id, None)
        if entry is None:
            return False
        self._reserved_tokens -= entry.reserved
        return True

    def clear(self) -> int:
        """Drop every sequence; returns how many there were."""
        count = len(self._entries)
        self._entries.clear()
        self._reserved_tokens = 0
        return count

    def __contains__(self, sequence_id: object) -> bool:
        return sequence_id in self._entries

    def sequences(self) -> list[int]:
        return list(self._entries)

    def length(self, sequence_id: int) -> int:
        """Tokens cached for the sequence (the next chunk's ``start``)."""
        return self._entry(sequence_id).length

    def allocated_bytes(self) -> int:
        """Bytes of the cache tensors now allocated (at most the reserved bytes)."""
        return sum(
            e.store.numel() * e.store.element_size()
            for e in self._entries.values()
            if e.store is not None
        )

    def _entry(self, sequence_id: int) -> _Entry:
        entry = self._entries.get(sequence_id)
        if entry is None:
            raise SequenceStateError(
                sequence_id, "has no KV cache on this stage (not opened, freed, or lost)"
            )
        return entry

    # --- one step ----------------------------------------------------------

    def check(self, chunks: Sequence[SequenceChunk]) -> None:
        """Refuse a step before anything is computed or written."""
        seen: set[int] = set()
        for chunk in chunks:
            if chunk.sequence_id in seen:
                raise SequenceStateError(chunk.sequence_id, "appears twice in one step")
            seen.add(chunk.sequence_id)
            entry = self._entry(chunk.sequence_id)
            if chunk.start != entry.length:
                raise SequenceStateError(
                    chunk.sequence_id,
                    f"a chunk starts at position {chunk.start} but the stage has cached "
                    f"{entry.length} tokens",
                )
            if chunk.start + chunk.length > entry.reserved:
                raise SequenceStateError(
                    chunk.sequence_id,
                    f"{chunk.start + chunk.length} tokens exceed the {entry.reserved} "
                    "reserved when it was opened",
                )

    def prepare(self, chunks: Sequence[SequenceChunk]) -> None:
        """Grow each sequence's tensor to hold its new tokens (never past its reservation)."""
        for chunk in chunks:
            entry = self._entries[chunk.sequence_id]
            needed = chunk.start + chunk.length
            capacity = 0 if entry.store is None else entry.store.shape[1]
            if needed <= capacity:
                continue
            new_capacity = min(entry.reserved, max(needed, 2 * capacity, _MIN_CAPACITY))
            store = torch.empty(
                (len(self.blocks), new_capacity, 2, self.kv_heads, self.head_dim),
                dtype=self.dtype,
                device=self.device,
            )
            if entry.store is not None and entry.length:
                store[:, : entry.length] = entry.store[:, : entry.length]
            entry.store = store

    def write_and_gather(
        self,
        block: int,
        chunks: Sequence[SequenceChunk],
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the step's new keys/values of `block` ([B, kv heads, N, D], padded
        to the longest chunk), and return every cached key/value of the batch's
        sequences, zero-padded to the longest: [B, kv heads, T, D] (views)."""
        local = block - self.blocks.start
        # [B, N, 2, kv heads, D]: each token's key and value together, as stored
        new = torch.stack((keys, values), dim=1).permute(0, 3, 1, 2, 4)
        cached = []
        for row, chunk in enumerate(chunks):
            store = self._entries[chunk.sequence_id].store
            assert store is not None  # prepare() ran
            end = chunk.start + chunk.length
            store[local, chunk.start : end] = new[row, : chunk.length]
            cached.append(store[local, :end])
        if len(cached) == 1:
            both = cached[0].unsqueeze(0)
        else:
            # one call pads them all (zeros past each sequence's end, masked out)
            both = torch.nn.utils.rnn.pad_sequence(cached, batch_first=True)
        both = both.permute(2, 0, 3, 1, 4)  # [2, B, kv heads, T, D]
        return both[0], both[1]

    def commit(self, chunks: Sequence[SequenceChunk]) -> None:
        for chunk in chunks:
            self._entries[chunk.sequence_id].length = chunk.start + chunk.length
