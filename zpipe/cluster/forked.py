"""Stage processes forked from this one, for clusters of many stages on one machine.

Starting ``python -m zpipe.stage`` imports torch afresh, seconds of CPU and a
hundred-odd megabytes each: 64 of them on two cores take minutes and gigabytes.
A forked stage shares the parent's imported modules copy-on-write and starts in
milliseconds. :func:`fork_stage` runs the stage command (``python -m zpipe.stage``,
by its module name, as a spawned interpreter would) with the given arguments in a
child of this process; the parent's objects are frozen out
of the collector first (:func:`gc.freeze`), so the children's collections do
not touch, and so copy, the pages they live on.

Forking is safe only where the parent holds nothing a child could trip on: call
it from synchronous code (not inside a running event loop), before the parent
runs multi-threaded torch work. Each child sets its own torch threads (the
stage's ``--threads``) and builds its own zmq context; the parent's sockets it
inherits are never used, and the child leaves with :func:`os._exit`.
"""

from __future__ import annotations

import gc
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

# The stage's own modules, imported here so that every child shares them (the
# command module itself is small: the child runs it by name).
import zpipe.stage.runtime  # noqa: F401
from zpipe.lazy_torch import import_lazy_torch_modules

STAGE_COMMAND = "zpipe.cli.stage"


class ForkedStage:
    """A forked stage process, with the part of :class:`subprocess.Popen`'s interface
    that :class:`~zpipe.cluster.LocalCluster` uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"forked stage {self.pid}", timeout or 0.0)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def redirect_output(log_path: Path | str) -> None:
    """In a forked child: stdin from /dev/null, stdout and stderr appended to
    ``log_path`` (the parent's streams may be a test runner's captures)."""
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null_fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null_fd, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    os.close(null_fd)
    sys.stdin = open(0, closefd=False)  # lives as long as the process
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)


def _run_child(args: Sequence[str], log_path: Path) -> int:
    redirect_output(log_path)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGALRM):
        signal.signal(sig, signal.SIG_DFL)
    signal.setitimer(signal.ITIMER_REAL, 0)  # a parent's alarm (a bench --timeout) is not ours
    sys.argv = ["python -m zpipe.stage", *args]
    try:
        runpy.run_module(STAGE_COMMAND, run_name="__main__", alter_sys=True)
    except SystemExit as exc:  # the command's exit status, or argparse's errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


def exit_with(run: Callable[[], int]) -> NoReturn:
    """In a forked child: ``run()``, then leave with its status (1 if it raised, the
    traceback printed), never returning into the parent's code."""
    code = 1
    try:
        code = run()
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def fork_stage(args: Sequence[str], log_path: Path) -> ForkedStage:
    """Run ``python -m zpipe.stage ARGS`` as a child of this process, its output
    appended to ``log_path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    import_lazy_torch_modules()  # once here, shared by every child
    gc.collect()
    gc.freeze()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the parent's code
        exit_with(lambda: _run_child(args, log_path))
    return ForkedStage(pid)
