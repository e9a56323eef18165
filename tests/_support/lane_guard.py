"""What a lane forbids, enforced around each phase of its tests (see tests/unit/conftest.py).

While a guarded phase (setup, call, teardown) runs, each forbidden operation raises
:class:`LaneViolation`; a test that catches the error still fails at the end of the
phase. The patches are lifted between phases, so tests of other lanes in the same
run are unaffected. The session's load generator (``--cpu-burners``,
tests/conftest.py) may start its processes while a guarded test sets up.
"""

from __future__ import annotations

import multiprocessing.process
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Generator
from typing import Any

import pytest
import zmq.sugar.socket

from tests._support import SUPPORT_DIR

PROCESSES: list[tuple[Any, str, str]] = [
    (subprocess.Popen, "__init__", "starts a process (subprocess.Popen)"),
    (multiprocessing.process.BaseProcess, "start", "starts a process (multiprocessing)"),
    *[
        (os, name, f"starts a process (os.{name})")
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system")
        if hasattr(os, name)
    ],
]
SOCKETS: list[tuple[Any, str, str]] = [
    (zmq.sugar.socket.Socket, "__init__", "opens a ZeroMQ socket"),
    *[
        (socket.socket, name, f"uses the network (socket.{name})")
        for name in ("bind", "connect", "connect_ex", "listen", "sendto")
    ],
]
_ORIGINALS = {(id(owner), name): getattr(owner, name) for owner, name, _ in [*PROCESSES, *SOCKETS]}
_ROOT_CONFTEST = str(SUPPORT_DIR.parent / "conftest.py")
_seen: list[str] = []


class LaneViolation(RuntimeError):
    """A test did what its lane forbids (started a process, opened a socket)."""


def _from_the_burners() -> bool:
    """Whether the session's load generator (tests/conftest.py) is the caller."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "cpu_burners" and code.co_filename == _ROOT_CONFTEST:
            return True
        frame = frame.f_back
    return False


def _refuse(owner: Any, name: str, what: str, lane: str) -> Callable[..., Any]:
    original = _ORIGINALS[(id(owner), name)]

    def refused(*args: Any, **kwargs: Any) -> Any:
        if _from_the_burners():
            return original(*args, **kwargs)
        _seen.append(what)
        raise LaneViolation(f"a test of {lane} {what}")

    return refused


def guarded_phase(
    forbidden: list[tuple[Any, str, str]], lane: str, where: str
) -> Generator[None, Any, Any]:
    """The body of a ``pytest_runtest_*`` wrapper: the phase runs with ``forbidden``
    refused; ``where`` says which lane the test belongs in instead."""
    _seen.clear()
    for owner, name, what in forbidden:
        setattr(owner, name, _refuse(owner, name, what, lane))
    try:
        result = yield
    finally:
        for owner, name, _ in forbidden:
            setattr(owner, name, _ORIGINALS[(id(owner), name)])
    if _seen:
        pytest.fail(
            f"{lane}: this test {'; '.join(dict.fromkeys(_seen))}; move it to {where}",
            pytrace=False,
        )
    return result
