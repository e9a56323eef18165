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
is invisible there (a convolution's: 36 MiB of outputs, 54 MiB resident, for
a 64-channel 96x96 convolution of 8 images); an operator that runs below the
dispatcher's Python key (inside one fused kernel) is counted by its outputs
only. So on Linux with glibc the CPU figure is also measured as the process's
resident memory (:class:`ResidentPeak`): freed memory the allocator keeps is
handed back first (``malloc_trim``), the kernel's record of the peak is set
back to what the process holds (``clear_refs``), and the peak's growth while
the code runs is what it needed, scratch included; the larger of the two
figures is reported. Elsewhere (macOS, musl, no ``/proc``) only the tensors
are followed, and the figure errs low by the scratch. The resident figure is
the whole process's: what other threads allocate meanwhile counts too, and
the process's own ``VmHWM`` is set back each time (read a process's peak
after any profile it runs, not across one).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import re
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
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


PROC_SELF = Path("/proc/self")


def _status_kib(text: str, key: str) -> int | None:
    match = re.search(rf"^{key}:\s+(\d+)\s*kB", text, re.MULTILINE)
    return int(match.group(1)) if match else None


class ResidentPeak:
    """This process's peak resident memory while a piece of code runs, above what it
    held before (Linux: ``VmHWM`` set back by ``clear_refs`` 5; glibc's
    ``malloc_trim`` first, so that freed memory the allocator keeps resident is not
    reused unseen). ``ResidentPeak.available()`` says whether it can run here."""

    def __init__(self, proc: Path = PROC_SELF) -> None:
        self._proc = proc
        self._before = 0
        self.bytes = 0
        self.retained_bytes = 0

    @staticmethod
    @functools.cache
    def available(proc: Path = PROC_SELF) -> bool:
        """Linux with glibc whose peak can be set back (Linux 4.0+, and a writable
        ``clear_refs``: some containers refuse it)."""
        if not sys.platform.startswith("linux") or _malloc_trim() is None:
            return False
        probe = ResidentPeak(proc)
        try:
            probe.start()
        except (OSError, ValueError):
            return False
        return True

    def _status(self) -> tuple[int, int]:
        text = (self._proc / "status").read_text()
        rss, hwm = _status_kib(text, "VmRSS"), _status_kib(text, "VmHWM")
        if rss is None or hwm is None:
            raise ValueError("no VmRSS or VmHWM in /proc/self/status")
        return rss * 1024, hwm * 1024

    def start(self) -> None:
        gc.collect()  # garbage from before is not the code's
        trim = _malloc_trim()
        if trim is not None:
            trim(0)
        (self._proc / "clear_refs").write_text("5")
        self._before, _ = self._status()

    def stop(self) -> None:
        rss, hwm = self._status()
        self.bytes = max(0, hwm - self._before)
        self.retained_bytes = max(0, rss - self._before)


@functools.cache
def _warm_tracker() -> None:
    """Run the tracker once: its first use imports about 800 modules (torch's dispatch
    machinery), whose memory is not the measured code's."""
    with _LiveStorages():
        torch.zeros(1) + 1


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (hands free heap pages back to the kernel); None where
    the C library has none (musl, macOS)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        # glibc's own name: find_library("c") would start ldconfig
        trim: Callable[[int], int] = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


class PeakMemory:
    """``with PeakMemory.on(device) as peak: run()``; then ``peak.bytes`` (the peak above
    the start) and ``peak.retained_bytes`` (what is still allocated at the end: a
    training forward's saved activations and outputs). On the CPU ``peak.tensor_bytes``
    is the tensors' part alone; with ``resident`` (the default) ``peak.bytes`` is the
    larger of it and the process's resident growth, where :class:`ResidentPeak` can run."""

    def __init__(self) -> None:
        self.bytes = 0
        self.retained_bytes = 0
        self.tensor_bytes = 0

    @classmethod
    @contextmanager
    def on(cls, device: torch.device | str, *, resident: bool = True) -> Iterator[PeakMemory]:
        device = torch.device(device)
        result = cls()
        if device.type == "cuda":
            with _cuda_peak(device, result):
                yield result
            result.tensor_bytes = result.bytes
            return
        tracker = _LiveStorages()
        process = ResidentPeak() if resident and ResidentPeak.available() else None
        if process is not None:
            _warm_tracker()
            process.start()
        try:
            with tracker:
                yield result
        finally:
            if process is not None:
                process.stop()
            result.tensor_bytes = tracker.peak
            result.bytes = max(tracker.peak, process.bytes if process else 0)
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


def peak_bytes(
    step: Callable[[], object], device: torch.device | str = "cpu", *, resident: bool = True
) -> int:
    """The peak memory ``step`` allocates on ``device`` above what was allocated before
    (what ``step`` returns is alive at its end and counts); see :class:`PeakMemory`."""
    with PeakMemory.on(device, resident=resident) as peak:
        kept = step()
    del kept
    return peak.bytes
