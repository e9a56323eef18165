"""The peak memory a piece of torch code allocates, measured rather than estimated.

On CUDA torch's allocator counts it (``max_memory_allocated`` after
``reset_peak_memory_stats``). The CPU allocator keeps no such count, so on
other devices every tensor an operator returns is followed from the moment
it is made until its storage is freed (a ``TorchDispatchMode`` sees each
operator's outputs, a weak reference to the storage sees it go): the largest
sum of live bytes is the peak. Storages that existed before the measurement
(weights, inputs) are not counted, nor are views of them or in-place results
(an output that shares an argument's memory), and views share their storage's
count.
Scratch memory a kernel allocates inside itself (never a tensor Python sees)
is invisible there, so the CPU figure errs low by it; an operator that runs
below the dispatcher's Python key (inside one fused kernel) is counted by its
outputs only.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _address(t: torch.Tensor) -> int:
    """Where ``t``'s memory starts (its storage's, which views share); 0 if it has none."""
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0


class _LiveStorages(TorchDispatchMode):
    """Counts the bytes of storages operators create while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        # A view or an in-place result shares an argument's memory: nothing new.
        shared = {_address(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and _address(leaf) not in shared:
                self._track(leaf)
        return out

    def _track(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensor kinds without a plain storage
            return
        key = id(storage)
        if key in self._seen or storage.data_ptr() == 0:
            return
        size = storage.nbytes()
        self._seen.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, key, size)

    def _freed(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size


class PeakMemory:
    """``with PeakMemory.on(device) as peak: run()``; then ``peak.bytes`` (the peak above
    the start) and ``peak.retained_bytes`` (what is still allocated at the end: a
    training forward's saved activations and outputs)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.retained_bytes = 0

    @classmethod
    @contextmanager
    def on(cls, device: torch.device | str) -> Iterator[PeakMemory]:
        device = torch.device(device)
        result = cls()
        if device.type == "cuda":
            with _cuda_peak(device, result):
                yield result
        else:
            tracker = _LiveStorages()
            try:
                with tracker:
                    yield result
            finally:
                result.bytes = tracker.peak
                result.retained_bytes = tracker.live


@contextmanager
def _cuda_peak(device: torch.device, result: PeakMemory) -> Iterator[None]:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    try:
        yield
    finally:
        torch.cuda.synchronize(device)
        result.bytes = max(0, torch.cuda.max_memory_allocated(device) - before)
        result.retained_bytes = max(0, torch.cuda.memory_allocated(device) - before)


def peak_bytes(step: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """The peak memory ``step`` allocates on ``device`` above what was allocated before
    (what ``step`` returns is alive at its end and counts)."""
    with PeakMemory.on(device) as peak:
        kept = step()
    del kept
    return peak.bytes
