"""The resident-memory half of a unit's peak (zpipe/peak_memory.py): it sees memory
no tensor holds, as a kernel's scratch, and it reads the kernel's own record."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from zpipe.peak_memory import PeakMemory, ResidentPeak, peak_bytes

MIB = 2**20
# Linux counts resident pages per CPU and folds them in lazily: a reading can be a few
# hundred KiB short
NEAR = 0.9
LINUX_PEAK = pytest.mark.skipif(
    not ResidentPeak.available(), reason="needs Linux, glibc and a writable clear_refs"
)


def _scratch(size: int) -> None:
    """What a kernel does inside: malloc, touch every page, free; no tensor."""
    libc = ctypes.CDLL("libc.so.6")  # the tests that call it run only with glibc
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    block = libc.malloc(size)
    assert block
    ctypes.memset(block, 1, size)
    libc.free(block)


@LINUX_PEAK
def test_the_resident_peak_sees_scratch_no_tensor_holds() -> None:
    with PeakMemory.on("cpu") as peak:
        _scratch(32 * MIB)
    assert peak.tensor_bytes == 0  # the tensors' part cannot see it
    assert NEAR * 32 * MIB <= peak.bytes < 40 * MIB
    assert peak_bytes(lambda: _scratch(32 * MIB), resident=False) == 0


@LINUX_PEAK
def test_memory_the_allocator_kept_is_not_reused_unseen() -> None:
    # freed and kept resident by glibc (below its trim threshold); a second step that
    # reuses it must still count it: the measure hands kept memory back first
    for _ in range(3):
        assert peak_bytes(lambda: _scratch(8 * MIB)) >= NEAR * 8 * MIB
    x = torch.ones(4 * MIB)  # 16 MiB, a tensor
    del x
    assert peak_bytes(lambda: torch.ones(4 * MIB)) >= 16 * MIB  # the tensors' part


def _fake_proc(tmp_path: Path, rss_kib: int, hwm_kib: int) -> Path:
    (tmp_path / "clear_refs").write_text("")
    (tmp_path / "status").write_text(
        f"Name:\tpython\nVmHWM:\t  {hwm_kib} kB\nVmRSS:\t  {rss_kib} kB\n"
    )
    return tmp_path


def test_the_peak_is_the_growth_of_the_kernels_record(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path, rss_kib=1000, hwm_kib=5000)
    peak = ResidentPeak(proc)
    peak.start()
    assert (proc / "clear_refs").read_text() == "5"  # the record was set back
    _fake_proc(tmp_path, rss_kib=1500, hwm_kib=3000)
    peak.stop()
    assert peak.bytes == 2000 * 1024
    assert peak.retained_bytes == 500 * 1024


def test_without_a_peak_record_it_is_not_available(tmp_path: Path) -> None:
    assert not ResidentPeak.available(tmp_path / "missing")
    (tmp_path / "status").write_text("Name:\tpython\n")  # no VmRSS, VmHWM (not Linux's)
    (tmp_path / "clear_refs").write_text("")
    assert not ResidentPeak.available(tmp_path)


@LINUX_PEAK
def test_with_a_peak_record_it_is_available(tmp_path: Path) -> None:
    assert ResidentPeak.available(_fake_proc(tmp_path, 1, 1))
