"""The unit lane: no processes, no sockets; a test that starts one fails here.

While a test of tests/unit/ sets up, runs and tears down, every way to start a
process (subprocess, os.fork/posix_spawn/system, multiprocessing) and every way to
reach a network (a socket's bind/connect/listen/sendto, a ZeroMQ socket) raises
:class:`UnitLaneViolation`; a test that catches the error still fails at the end
of its phase. A test that needs one of them belongs in tests/integration/ (real
sockets, one process) or tests/cluster/ (processes). The guard is installed only
around the phases of this lane's tests, so a run of the whole suite is not
affected. The one exception is the session's load generator (``--cpu-burners``,
tests/conftest.py), which may start its processes while a unit test sets up.

The lane's tensors are tiny: torch computes them on one thread (the pool's threads
only fight the other xdist worker for two cores; its size is restored after each
phase).
"""

from __future__ import annotations

import multiprocessing.process
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq.sugar.socket

# loky (joblib, under scikit-learn's KMeans) counts the physical cores once per
# process by running lscpu; seed its cache with the logical count, which is what it
# falls back to when lscpu cannot run, so the unit lane starts no process for it.
try:
    from joblib.externals.loky.backend import context as _loky_context
except ImportError:  # scikit-learn (and joblib) not installed: nothing to seed
    pass
else:
    if getattr(_loky_context, "physical_cores_cache", None) is None:
        _loky_context.physical_cores_cache = os.cpu_count() or 1


class UnitLaneViolation(RuntimeError):
    """A unit test started a process or used a socket."""


_GUARDED: list[tuple[Any, str, str]] = [
    (subprocess.Popen, "__init__", "starts a process (subprocess.Popen)"),
    (multiprocessing.process.BaseProcess, "start", "starts a process (multiprocessing)"),
    (zmq.sugar.socket.Socket, "__init__", "opens a ZeroMQ socket"),
    *[
        (os, name, f"starts a process (os.{name})")
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system")
        if hasattr(os, name)
    ],
    *[
        (socket.socket, name, f"uses the network (socket.{name})")
        for name in ("bind", "connect", "connect_ex", "listen", "sendto")
    ],
]
_ORIGINALS = {(id(owner), name): getattr(owner, name) for owner, name, _ in _GUARDED}
_seen: list[str] = []
_ROOT_CONFTEST = str(Path(__file__).resolve().parents[1] / "conftest.py")


def _from_the_burners() -> bool:
    """Whether the session's load generator (tests/conftest.py) is the caller."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "cpu_burners" and code.co_filename == _ROOT_CONFTEST:
            return True
        frame = frame.f_back
    return False


def _refuse(owner: Any, name: str, what: str) -> Callable[..., Any]:
    original = _ORIGINALS[(id(owner), name)]

    def refused(*args: Any, **kwargs: Any) -> Any:
        if _from_the_burners():
            return original(*args, **kwargs)
        _seen.append(what)
        raise UnitLaneViolation(
            f"a unit test {what}; move it to tests/integration/ or tests/cluster/"
        )

    return refused


def _install() -> None:
    for owner, name, what in _GUARDED:
        setattr(owner, name, _refuse(owner, name, what))


def _remove() -> None:
    for owner, name, _ in _GUARDED:
        setattr(owner, name, _ORIGINALS[(id(owner), name)])


def _phase() -> Generator[None, Any, Any]:
    _seen.clear()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    _install()
    try:
        result = yield
    finally:
        _remove()
        torch.set_num_threads(threads)
    if _seen:
        pytest.fail(
            f"unit lane: this test {'; '.join(dict.fromkeys(_seen))} (tests/unit/ allows no "
            "processes and no sockets: move it to tests/integration/ or tests/cluster/)",
            pytrace=False,
        )
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _phase())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _phase())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _phase())
