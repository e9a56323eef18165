"""A coordinator or stage that dies of a fatal signal leaves every thread's Python
traceback in its log, and SIGUSR1 shows where it is without stopping it."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zpipe.cli.common import enable_crash_tracebacks

DEADLINE_S = 120.0  # process start-up imports torch: slow on a loaded machine


def _wait_for(path: Path, text: str, process: subprocess.Popen[bytes]) -> str:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        log = path.read_text(errors="replace")
        if text in log:
            return log
        if process.poll() is not None:
            raise AssertionError(f"exited ({process.returncode}) before {text!r}:\n{log[-2000:]}")
        time.sleep(0.1)
    raise AssertionError(f"no {text!r} within {DEADLINE_S} s:\n{path.read_text()[-2000:]}")


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 on this platform")
def test_sigusr1_dumps_the_threads_and_a_crash_leaves_its_traceback(tmp_path: Path) -> None:
    log_path = tmp_path / "coordinator.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "zpipe.coordinator", "--bind", "tcp://127.0.0.1:0"],
            stdout=subprocess.DEVNULL,
            stderr=log_file,
        )
    try:
        _wait_for(log_path, "coordinator_listening", process)
        process.send_signal(signal.SIGUSR1)
        # where the event loop waits, by file name: the serve loop in the main thread
        # (waited for by that name: the dump is written a frame at a time, and a read
        # right after its first line sees only part of it)
        dumped = _wait_for(log_path, "cli/common.py", process)
        assert "most recent call first" in dumped and "Current thread" in dumped
        time.sleep(0.5)
        assert process.poll() is None  # a dump does not stop the process
        process.send_signal(signal.SIGABRT)  # what a failed assertion in libzmq raises
        assert process.wait(timeout=DEADLINE_S) == -signal.SIGABRT
        crashed = log_path.read_text(errors="replace")
        assert "Fatal Python error: Aborted" in crashed
        assert crashed.count("most recent call first") >= 2  # the dump, then the crash
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=DEADLINE_S)


def test_a_stderr_without_a_descriptor_is_no_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # run in-process under a capturing harness: nothing to write a traceback to
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    enable_crash_tracebacks()  # must not raise
    monkeypatch.setattr(sys, "stderr", None)
    enable_crash_tracebacks()
