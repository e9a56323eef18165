"""Which torch device a stage (or the profiler) computes on, and how much memory it has.

``--device`` takes ``auto``, ``cpu``, ``cuda``, ``cuda:N`` or ``mps``; ``auto``
picks CUDA if torch sees a GPU, else Apple's MPS, else the CPU. A device this
machine does not offer is a :class:`DeviceUnavailableError` that says what torch
sees, never a silent fall-back to the CPU.

The wire always carries CPU tensors: a stage moves its inputs onto its device
and its outputs back at the boundaries (:class:`BoundaryMover`). On CUDA both
copies go through pinned (page-locked) host memory with ``non_blocking``
copies, the way a DataLoader with ``pin_memory=True`` feeds a GPU: a pageable
source would make the copy synchronous and staged by the driver anyway.

Usable memory (:func:`free_memory_bytes`) is what the planner's memory limit
(PipeEdge Alg. 1, Asteroid eq. 3) applies to: ``MemAvailable`` from
``/proc/meminfo`` on the CPU, the free memory ``torch.cuda.mem_get_info``
reports on CUDA. Stages that share one machine each see all of its free
memory; give them ``--memory-mb`` to split it.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zpipe._errors import ConfigError

DEVICE_CHOICES = "auto|cpu|cuda[:N]|mps"
_DEVICE_PATTERN = re.compile(r"^(auto|cpu|mps|cuda)(?::(\d{1,4}))?$")
MEMINFO = Path("/proc/meminfo")
PROC_STATUS = Path("/proc/self/status")
MIB = 2**20


class DeviceUnavailableError(ConfigError):
    """A device this machine (or this torch build) does not offer."""


@dataclass(frozen=True)
class Backends:
    """The accelerators torch sees on this machine: the seam tests replace to play a
    machine with GPUs."""

    cuda_devices: int = 0
    mps: bool = False
    # torch.version.cuda: None on a CPU-only build, which is worth saying in an error
    cuda_build: str | None = None

    @classmethod
    def detect(cls) -> Backends:
        mps_backend = getattr(torch.backends, "mps", None)
        return cls(
            cuda_devices=torch.cuda.device_count() if torch.cuda.is_available() else 0,
            mps=bool(mps_backend is not None and mps_backend.is_available()),
            cuda_build=torch.version.cuda,
        )


def check_device_text(text: str) -> str:
    """``text`` if it is a device name this module understands (nothing is probed)."""
    match = _DEVICE_PATTERN.match(text.strip().lower())
    if match is None or (match.group(2) is not None and match.group(1) != "cuda"):
        raise ConfigError(f"--device {text!r}: expected {DEVICE_CHOICES}")
    return text.strip().lower()


def resolve_device(text: str = "auto", *, backends: Backends | None = None) -> torch.device:
    """The torch device ``text`` names on this machine; ``auto``: CUDA, else MPS, else CPU."""
    name = check_device_text(text)
    seen = backends if backends is not None else Backends.detect()
    if name == "auto":
        if seen.cuda_devices:
            return torch.device("cuda", 0)
        return torch.device("mps") if seen.mps else torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "mps":
        if not seen.mps:
            raise DeviceUnavailableError(
                "--device mps: this torch sees no Apple MPS device (macOS 12.3+ on Apple "
                "silicon with an MPS-enabled torch); use --device cpu"
            )
        return torch.device("mps")
    index = int(name.partition(":")[2] or 0)
    if not seen.cuda_devices:
        build = (
            f"this torch is built for CUDA {seen.cuda_build} but sees no GPU (driver, "
            "CUDA_VISIBLE_DEVICES)"
            if seen.cuda_build
            else f"this torch ({torch.__version__}) is a CPU-only build; install a CUDA "
            "build (on a Jetson: NVIDIA's wheel, see docs/getting-started/install.md)"
        )
        raise DeviceUnavailableError(f"--device {name}: {build}; use --device cpu")
    if index >= seen.cuda_devices:
        raise DeviceUnavailableError(
            f"--device {name}: torch sees {seen.cuda_devices} CUDA device(s), "
            f"cuda:0..cuda:{seen.cuda_devices - 1}"
        )
    return torch.device("cuda", index)


def device_kind(device: torch.device | str) -> str:
    """``cpu``, ``cuda``, ``mps``, ...: what planning groups devices by."""
    return torch.device(device).type


# --------------------------------------------------------------------------- memory


def meminfo_available_bytes(path: Path = MEMINFO) -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes; None where there is none."""
    try:
        text = path.read_text()
    except OSError:
        return None
    match = re.search(r"^MemAvailable:\s+(\d+)\s*kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def _sysconf_available_bytes() -> int | None:
    """Free physical pages x page size (systems without /proc/meminfo)."""
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return None


def free_memory_bytes(
    device: torch.device | str,
    *,
    meminfo: Path = MEMINFO,
    cuda_mem_get_info: Callable[[torch.device], tuple[int, int]] | None = None,
) -> int | None:
    """Memory ``device`` can still give a model, in bytes; None when it cannot be told.

    CPU (and MPS, whose memory is the machine's): available RAM; CUDA: the free
    memory the driver reports for that GPU (on a Jetson, which shares RAM with
    its GPU, the driver reports what is free of that shared memory).
    """
    device = torch.device(device)
    if device.type == "cuda":
        query = cuda_mem_get_info if cuda_mem_get_info is not None else torch.cuda.mem_get_info
        free, _total = query(device)
        return int(free)
    if device.type in ("cpu", "mps"):
        found = meminfo_available_bytes(meminfo)
        return found if found is not None else _sysconf_available_bytes()
    return None


def _status_bytes(key: str, status: Path) -> int | None:
    try:
        text = status.read_text()
    except OSError:
        return None
    match = re.search(rf"^{key}:\s+(\d+)\s*kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def resident_bytes(status: Path = PROC_STATUS) -> int | None:
    """This process's resident memory now (``VmRSS``); None where it cannot be told."""
    return _status_bytes("VmRSS", status)


def peak_resident_bytes(status: Path = PROC_STATUS) -> int | None:
    """This process's peak resident memory so far (``VmHWM``, else ``ru_maxrss``)."""
    found = _status_bytes("VmHWM", status)
    if found is not None:
        return found
    try:
        import resource

        # kilobytes on Linux, bytes on macOS
        scale = 1 if sys.platform == "darwin" else 1024
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale
    except (ImportError, OSError, ValueError):
        return None


def stage_base_bytes(device: torch.device | str, *, status: Path = PROC_STATUS) -> int | None:
    """What this stage process holds of ``device``'s memory before any model arrives
    (the memory model's base, :mod:`zpipe.planner.memory`): its resident memory on the
    CPU and MPS (whose memory is the machine's); none of a CUDA GPU's, whose free
    memory the driver reports with this process's context already taken off."""
    if torch.device(device).type == "cuda":
        return 0
    return resident_bytes(status)


def usable_memory_mb(measured_bytes: int | None, declared_mb: float | None) -> float | None:
    """The memory the planner may fill: the smaller of what was measured and what the
    operator declared (``--memory-mb``); either alone when the other is unknown."""
    measured_mb = measured_bytes / MIB if measured_bytes is not None else None
    known = [m for m in (measured_mb, declared_mb) if m is not None]
    return min(known) if known else None


def describe_device(device: torch.device, *, free_bytes: int | None) -> dict[str, Any]:
    """What a stage tells the coordinator about its device (``info["device"]``)."""
    name = "cpu"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    elif device.type == "mps":
        name = "mps"
    return {
        "type": device.type,
        "index": device.index,
        "name": name,
        "free_mb": round(free_bytes / MIB, 1) if free_bytes is not None else None,
    }


# --------------------------------------------------------------------------- boundaries


class BoundaryMover:
    """Moves a stage's tensors onto its device and back to the host at its boundaries.

    On the CPU both moves are the identity (the CPU path is unchanged). On CUDA an
    input is copied into pinned host memory and from there to the GPU without
    blocking; outputs come back into fresh pinned tensors (torch's caching host
    allocator reuses their memory only once the copies that used it are done),
    and the stream is synchronized once for all of them before they are handed
    to the wire, so a send never reads a buffer a copy is still filling.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"

    @property
    def is_host(self) -> bool:
        return self.device.type == "cpu"

    def to_device(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        if self.is_host:
            return tuple(tensors)
        return tuple(self._onto_device(t) for t in tensors)

    def to_host(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        if self.is_host:
            return tuple(tensors)
        moved = tuple(self._onto_host(t) for t in tensors)
        self._wait_for_copies()
        return moved

    def _onto_device(self, t: torch.Tensor) -> torch.Tensor:
        if t.device == self.device:
            return t
        if self.pinned and t.device.type == "cpu":
            staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            staged.copy_(t)
            return staged.to(self.device, non_blocking=True)
        return t.to(self.device)

    def _onto_host(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return t
        if self.pinned:
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            out.copy_(t, non_blocking=True)
            return out
        return t.to("cpu")

    def _wait_for_copies(self) -> None:
        if self.pinned:
            torch.cuda.current_stream(self.device).synchronize()


@contextlib.contextmanager
def single_threaded_blas() -> Iterator[None]:
    # The matrices are tiny; BLAS threads only fight the other process on 2 cores
    # (one run went 20x slower with them). torch's own pool too, when it is loaded
    # (the CNN): under load its threads made a convolution's backward ten times
    # slower than on one thread.
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else 0
    with contextlib.ExitStack() as stack:
        if torch is not None:
            torch.set_num_threads(1)
            stack.callback(torch.set_num_threads, threads)
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:  # pragma: no cover - comes with scikit-learn
            yield
            return
        with threadpool_limits(1):
            yield
