"""The user's batches: splitting them into micro-batches, and keeping them to replay.

Pure data handling (no sockets): inference batches are split by size
(:func:`split_microbatches`), training mini-batches into a count of parts
(:func:`split_minibatch`), and :class:`BatchSource` hands a training run its
mini-batches once each while keeping those a recovery may train again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import torch

from zpipe._errors import ConfigError

Batch = torch.Tensor | Sequence[torch.Tensor]
Outputs = tuple[torch.Tensor, ...]
# a training mini-batch: (inputs..., labels)
TrainBatch = Sequence[torch.Tensor]


def as_tensors(batch: Batch) -> tuple[torch.Tensor, ...]:
    if isinstance(batch, torch.Tensor):
        return (batch,)
    tensors = tuple(batch)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ConfigError("a batch must be a tensor or a non-empty sequence of tensors")
    return tensors


def microbatch_count(batches: object, microbatch_size: int | None) -> int | None:
    """How many micro-batches ``batches`` splits into, when it is a sequence we can
    look into (a progress bar's total); None otherwise."""
    if not isinstance(batches, Sequence):
        return None
    count = 0
    for batch in batches:
        first = as_tensors(batch)[0]
        rows = int(first.shape[0]) if first.dim() > 0 else 1
        count += 1 if microbatch_size is None else max(1, -(-rows // microbatch_size))
    return count


def split_microbatches(
    tensors: tuple[torch.Tensor, ...], microbatch_size: int | None
) -> list[tuple[torch.Tensor, ...]]:
    """Split along dim 0; every tensor of a batch must have the same batch size."""
    if any(t.dim() == 0 for t in tensors):
        raise ConfigError("every tensor of a batch needs a batch dimension; got a scalar")
    sizes = {int(t.shape[0]) for t in tensors}
    if len(sizes) != 1:
        raise ConfigError(f"every tensor of a batch needs the same batch size, got {sizes}")
    (batch_size,) = sizes
    if microbatch_size is None or microbatch_size >= batch_size:
        return [tuple(t.contiguous() for t in tensors)]
    parts = [torch.split(t, microbatch_size) for t in tensors]
    return [tuple(p.contiguous() for p in group) for group in zip(*parts, strict=False)]


def check_fits_first_stage(
    tensors: Sequence[torch.Tensor], limit: int | None, first_stage: str
) -> None:
    """Refuse a micro-batch that the first stage's data port would drop.

    ``limit``: the port's most bytes per frame under this plan (the stage's
    ``--max-batch-rows`` times the model's largest tensor per sample; None: not
    known). libzmq closes a connection that sends a larger frame without a word,
    which the client would only see as a stall until the result deadline.
    """
    if limit is None:
        return
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if nbytes > limit:
            rows = int(t.shape[0]) if t.dim() > 0 else 1
            raise ConfigError(
                f"a micro-batch of {rows} rows sends a tensor of {nbytes} bytes, but the "
                f"first stage {first_stage!r} accepts at most {limit} bytes per tensor "
                f"under this plan; use smaller micro-batches (microbatch_size, or more "
                f"micro-batches per mini-batch) or start "
                f"the stage with a larger --max-batch-rows"
            )


def first_stage_limits(
    devices: Sequence[str], described: Mapping[str, Any], fallback: int | None
) -> dict[str, int | None]:
    """Each first-stage device's data-port limit per frame: a data-parallel first
    stage's devices each take a share of every micro-batch under their own limit (the
    training plan's ``first_limits``, by device); a device it does not name (an older
    coordinator's plan) gets ``fallback`` (``first_max_message_bytes``)."""
    given = described.get("first_limits")
    named = dict(given) if isinstance(given, Mapping) else {}
    limits: dict[str, int | None] = {}
    for device in devices:
        limit = named.get(device, fallback)
        limits[device] = int(limit) if isinstance(limit, int) else fallback
    return limits


def split_minibatch(batch: TrainBatch, num_microbatches: int) -> list[tuple[torch.Tensor, ...]]:
    """``num_microbatches`` parts along dim 0, sizes differing by at most one."""
    tensors = tuple(batch)
    if len(tensors) < 2 or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ConfigError("a training batch is a sequence of tensors: (inputs..., labels)")
    sizes = {int(t.shape[0]) if t.dim() > 0 else -1 for t in tensors}
    if len(sizes) != 1 or -1 in sizes:
        raise ConfigError(f"every tensor of a batch needs the same batch size, got {sizes}")
    (size,) = sizes
    if size < num_microbatches:
        raise ConfigError(
            f"a mini-batch of {size} samples cannot be split into {num_microbatches} "
            "micro-batches; drop the last incomplete batch (drop_last=True) or use fewer"
        )
    parts = [torch.tensor_split(t, num_microbatches) for t in tensors]
    return [tuple(p[i].contiguous() for p in parts) for i in range(num_microbatches)]


def first_batch_size(batches: object) -> int | None:
    """The first batch's size when ``batches`` is a sequence we can look into."""
    if not isinstance(batches, Sequence) or not batches:
        return None
    first = batches[0]
    if first and isinstance(first[0], torch.Tensor) and first[0].dim() > 0:
        return int(first[0].shape[0])
    return None


_END = object()
T = TypeVar("T")


class ReplayBuffer(Generic[T]):
    """The mini-batches a recovery may train again, kept to replay (pure bookkeeping).

    Which ones the fit's controller decides
    (:class:`~zpipe.client.runs.training_attempts.TrainingAttempts`): with exact
    consistency those since the last replica (and since the newest global copy
    between chain replicas); with fast consistency, or without recovery, only those
    whose loss has not come back, so a long run fed from a generator holds at most
    the mini-batches in flight and the one the feed is about to send.

    ``replica_step``: the mini-batch the coordinator's replica was taken before
    (every mini-batch before it is in the replica); ``resume``: that replica's
    (run, the run's own step); ``kept_from``: the mini-batch ``kept[0]`` is, where
    the next attempt starts (the replica's, or with `fast` consistency the first
    mini-batch that had not completed).
    """

    def __init__(self) -> None:
        self.kept: list[T] = []
        self.kept_from = 0
        self.replica_step = 0
        self.resume: tuple[int, int] | None = None
        self.replicas: list[int] = []
        # chain replicas with global copies between them: the newest global copy (its
        # mini-batch and (run, run step)) and the mini-batches from it to replica_step,
        # which a recovery from that copy trains again
        self.global_step: int | None = None
        self.global_resume: tuple[int, int] | None = None
        self.since_global: list[T] = []

    def keep(self, batch: T) -> None:
        """A new mini-batch (the one after every kept one) is on its way."""
        self.kept.append(batch)

    def forget_before(self, step: int) -> None:
        """Mini-batches before ``step`` will not be trained again."""
        if step <= self.kept_from:  # already let go of (a late acknowledgement)
            return
        self.kept = self.kept[step - self.kept_from :]
        self.kept_from = step

    def replicated(
        self, step: int, run: int, run_step: int, *, global_copy: bool = False, keep: bool = False
    ) -> None:
        """The coordinator holds a replica taken before mini-batch ``step``; with
        ``global_copy`` a copy of every unit. ``keep``: global copies are taken between
        chain replicas, so the mini-batches since the newest one are kept too."""
        if global_copy or not keep:
            self.since_global = []
            self.global_step = step if global_copy else None
            self.global_resume = (run, run_step) if global_copy else None
        elif self.global_step is not None:  # nothing to keep without a global copy
            self.since_global += self.kept[: step - self.kept_from]
        self.forget_before(step)
        self.replica_step = step
        self.resume = (run, run_step)
        self.replicas.append(step)

    def rewind_to_global(self) -> None:
        """The run resumes from the newest global copy, older than the replica:
        the mini-batches since that copy are trained again."""
        if self.global_step is None or self.global_resume is None:
            raise ConfigError("no global copy to resume from is known here")
        self.kept = self.since_global + self.kept
        self.kept_from = self.replica_step = self.global_step
        self.resume = self.global_resume
        self.since_global = []


class BatchSource(ReplayBuffer[TrainBatch]):
    """The mini-batches, once each, and those a recovery may train again, kept to replay."""

    def __init__(self, batches: Iterable[TrainBatch] | AsyncIterable[TrainBatch]) -> None:
        super().__init__()
        self._sync: Iterator[TrainBatch] | None = None
        self._async: AsyncIterator[TrainBatch] | None = None
        if isinstance(batches, AsyncIterable):
            self._async = aiter(batches)
        else:
            self._sync = iter(batches)
        self._pending: asyncio.Future[Any] | None = None

    async def iterate(self) -> AsyncIterator[TrainBatch]:
        """The kept mini-batches again, then new ones (kept too)."""
        for batch in list(self.kept):
            yield batch
        while True:
            batch = await self._next()
            if batch is _END:
                return
            self.keep(batch)
            yield batch

    async def _next(self) -> Any:
        if self._sync is not None:
            return next(self._sync, _END)
        assert self._async is not None
        if self._pending is None:
            self._pending = asyncio.ensure_future(anext(self._async, _END))
        # Shielded: a recovery may cancel the feed while the source makes its next
        # batch; that batch then goes to the next attempt instead of being lost.
        batch = await asyncio.shield(self._pending)
        self._pending = None
        return batch
