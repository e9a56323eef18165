"""What ``retain_freed_memory`` asks of glibc: a fake libc records the mallopt calls, so
the test process's own allocator is left as it is."""

from __future__ import annotations

import ctypes
import sys
from typing import Any

import pytest

from zpipe.transport import allocator
from zpipe.transport.allocator import MMAP_THRESHOLD_MB, retain_freed_memory

MIB = 1 << 20


class _FakeLibc:
    def __init__(self, accept: bool = True) -> None:
        self.calls: list[tuple[int, int]] = []
        self.accept = accept

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1 if self.accept else 0


@pytest.fixture
def libc(monkeypatch: pytest.MonkeyPatch) -> _FakeLibc:
    fake = _FakeLibc()
    monkeypatch.setattr(allocator.sys, "platform", "linux")
    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda *_a, **_k: fake)
    return fake


def _settings(fake: _FakeLibc) -> dict[str, int]:
    names = {allocator._M_MMAP_THRESHOLD: "mmap", allocator._M_TRIM_THRESHOLD: "trim"}
    return {names[p]: v for p, v in fake.calls}


def test_the_default_keeps_256_mib_and_maps_blocks_of_4_mib_apart(libc: _FakeLibc) -> None:
    # 4 MiB: above it a stage's activations fragmented the heap past the memory
    # model's prediction (bench/memory.py); 1 MiB messages still reuse the heap
    assert MMAP_THRESHOLD_MB == 4
    assert retain_freed_memory() is True
    assert _settings(libc) == {"mmap": 4 * MIB, "trim": 256 * MIB}


@pytest.mark.parametrize(
    ("retain_mb", "threshold_mb", "expected_mmap_mib"),
    [
        (256, 32, 32),  # the old setting, still reachable
        (256, 64, 32),  # older glibc refuses more than 32 MiB
        (2, 4, 2),  # never past what is retained
        (256, 0, 1),  # at least 1 MiB: a 0 would map every block
    ],
)
def test_the_mmap_threshold_is_bounded(
    libc: _FakeLibc, retain_mb: int, threshold_mb: int, expected_mmap_mib: int
) -> None:
    assert retain_freed_memory(retain_mb, mmap_threshold_mb=threshold_mb) is True
    assert _settings(libc) == {"mmap": expected_mmap_mib * MIB, "trim": retain_mb * MIB}


def test_nothing_is_asked_with_zero_retained_or_off_linux(
    libc: _FakeLibc, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert retain_freed_memory(0) is False
    monkeypatch.setattr(allocator.sys, "platform", "darwin")
    assert retain_freed_memory() is False
    assert libc.calls == []


def test_a_refusal_or_a_libc_without_mallopt_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator.sys, "platform", "linux")
    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda *_a, **_k: _FakeLibc(accept=False))
    assert retain_freed_memory() is False

    def no_libc(*_a: Any, **_k: Any) -> Any:
        raise OSError("no libc")

    monkeypatch.setattr(allocator.ctypes, "CDLL", no_libc)
    assert retain_freed_memory() is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_glibc_accepts_the_default_thresholds() -> None:
    try:
        ctypes.CDLL("libc.so.6").mallopt  # noqa: B018
    except (OSError, AttributeError):
        pytest.skip("not glibc")
    # setting the stage's values in the test process is harmless: both only decide
    # when freed memory goes back to the kernel (and no ldconfig is started: the
    # unit lane's guard would fail the test)
    assert retain_freed_memory() is True
