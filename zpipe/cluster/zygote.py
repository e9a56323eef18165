"""Stage and coordinator processes forked from a warm interpreter (a zygote).

``python -m zpipe.stage`` imports torch afresh: about three seconds of CPU per
process, which a test suite that starts a few hundred clusters of four processes
pays many times over on a two-core machine. :func:`fork_stage` avoids it by
forking the caller, but only a caller that has run no threaded torch work may
fork (a test that computed its reference first may not). The zygote is a clean
interpreter of its own: it imports the stage and coordinator once, runs nothing,
and forks a process for each launch it is asked for (a JSON line on its stdin:
the command's module, arguments, log file, environment and working directory).

Each launched process is a grandchild: the zygote forks a short-lived middle
process, which forks the command and exits at once, so the command is orphaned
and the kernel hands it to the nearest ancestor marked a *child subreaper*: the
process that owns the zygote (marked by :class:`Zygote`). That owner can then
wait for it, signal it and read its exit status exactly as it does a child it
spawned (:class:`~zpipe.cluster.forked.ForkedStage`). Linux only
(``PR_SET_CHILD_SUBREAPER``); :func:`zygote_available` says whether it works here.

A launched process's resident memory starts lower than a fresh interpreter's: the
shared libraries' pages it has not touched yet are not counted as its own, so the
process base a stage reports at registration is lower than a spawned one's (tests of
memory limits spawn their stages).

Nothing here crosses a network: the requests are the owner's own, on a pipe.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from zpipe._errors import PipelineError
from zpipe.cluster.forked import ForkedStage, exit_with, redirect_output

# the command modules a launch may run, by the name ``python -m`` would take
COMMANDS = {
    "zpipe.stage": "zpipe.cli.stage",
    "zpipe.coordinator": "zpipe.cli.coordinator",
}
_PR_SET_CHILD_SUBREAPER = 36
_START_TIMEOUT_S = 120.0  # importing torch on a loaded machine
_LAUNCH_TIMEOUT_S = 60.0


def _mark_subreaper() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def zygote_available() -> bool:
    """Whether launched processes can be this process's to wait for (Linux)."""
    return _mark_subreaper()


class Zygote:
    """A warm interpreter that launches ``python -m zpipe.stage`` / ``zpipe.coordinator``
    as processes this one waits for (see the module notes)."""

    def __init__(self, python: str = sys.executable) -> None:
        if not _mark_subreaper():
            raise PipelineError("a zygote needs Linux's child subreapers (PR_SET_CHILD_SUBREAPER)")
        self._lock = threading.Lock()
        self._process = subprocess.Popen(
            [python, "-m", "zpipe.cluster.zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,  # the zygote's own failures go where this process's do
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self._read(_START_TIMEOUT_S)  # {"ready": true} once the imports are done

    def _read(self, timeout_s: float) -> dict[str, Any]:
        stdout = self._process.stdout
        assert stdout is not None
        line: list[bytes] = []
        reader = threading.Thread(target=lambda: line.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not line or not line[0]:
            self.close()
            raise PipelineError(f"the zygote did not answer within {timeout_s:.0f} s")
        reply: dict[str, Any] = json.loads(line[0])
        if "error" in reply:
            raise PipelineError(f"the zygote could not launch: {reply['error']}")
        return reply

    def launch(
        self,
        module: str,
        args: Sequence[str],
        log_path: Path,
        *,
        env: Mapping[str, str],
        cwd: str | None = None,
    ) -> ForkedStage:
        """Run ``python -m MODULE ARGS`` forked from the zygote, its output appended to
        ``log_path``; the process is this one's to wait for."""
        if module not in COMMANDS:
            raise PipelineError(f"the zygote runs {sorted(COMMANDS)}, not {module!r}")
        request = {
            "module": module,
            "args": list(args),
            "log": str(log_path),
            "env": dict(env),
            "cwd": cwd or os.getcwd(),
        }
        with self._lock:
            stdin = self._process.stdin
            if stdin is None or self._process.poll() is not None:
                raise PipelineError("the zygote has exited")
            stdin.write(json.dumps(request).encode() + b"\n")
            stdin.flush()
            reply = self._read(_LAUNCH_TIMEOUT_S)
        return ForkedStage(int(reply["pid"]))

    def close(self) -> None:
        """Stop the zygote (the processes it launched run on)."""
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


_shared: Zygote | None = None
_shared_lock = threading.Lock()


def shared_zygote() -> Zygote:
    """This process's zygote, started on first use and stopped when it exits."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared._process.poll() is not None:
            _shared = Zygote()
            atexit.register(_shared.close)
        return _shared


# -- the zygote process ------------------------------------------------------


def _run_command(request: dict[str, Any]) -> int:
    """In the launched process: become ``python -m MODULE ARGS`` (never returns normally)."""
    redirect_output(request["log"])
    # a fresh interpreter's dispositions (the zygote's own are for its owner's pipe)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    # the owner's import path as a fresh interpreter would have taken it from PYTHONPATH
    for entry in reversed([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    os.chdir(request["cwd"])
    module = str(request["module"])
    sys.argv = [f"python -m {module}", *request["args"]]
    try:
        runpy.run_module(COMMANDS[module], run_name="__main__", alter_sys=True)
    except SystemExit as exc:  # the command's exit status, or argparse's errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


def _wait_for_adoption(middle_pid: int) -> None:
    """Return once the middle process has left and this one is its owner's: a command
    that watches its parent (``--parent-pid``) must not see the middle one."""
    deadline = time.monotonic() + _LAUNCH_TIMEOUT_S
    while os.getppid() == middle_pid and time.monotonic() < deadline:
        time.sleep(0.001)


def _launch(request: dict[str, Any]) -> int:
    """Fork the command as a grandchild; its pid."""
    read_fd, write_fd = os.pipe()
    middle = os.fork()
    if middle == 0:  # the middle process: fork the command, say its pid, leave
        os.close(read_fd)
        code = 0
        try:
            middle_pid = os.getpid()
            pid = os.fork()
            if pid == 0:
                os.close(write_fd)

                def adopted_then_run() -> int:
                    _wait_for_adoption(middle_pid)
                    return _run_command(request)

                exit_with(adopted_then_run)
            os.write(write_fd, str(pid).encode())
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        said = pipe.read()
    # reaped before the owner hears the pid: the command is the owner's by then
    os.waitpid(middle, 0)
    if not said:
        raise OSError("the launch's middle process could not fork")
    return int(said)


def main() -> None:
    # The stage's and coordinator's modules and torch's lazily imported ones, once:
    # every launched process shares them copy-on-write and starts in milliseconds.
    import zpipe.coordinator.server
    import zpipe.stage.runtime  # noqa: F401
    from zpipe.lazy_torch import import_lazy_torch_modules

    # what the commands import (by name: this layer never imports the one above); the
    # command modules themselves leave again, for runpy runs them afresh as __main__
    for command in COMMANDS.values():
        importlib.import_module(command)
        del sys.modules[command]
    import_lazy_torch_modules()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    gc.collect()
    gc.freeze()  # the children's collections leave these pages shared
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            reply: dict[str, Any] = {"pid": _launch(json.loads(line))}
        except Exception as exc:  # the owner hears it; the zygote serves on
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
