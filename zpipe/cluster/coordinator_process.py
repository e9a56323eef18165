"""A local cluster's coordinator process: where it listens, and whether it still runs.

The coordinator binds a port it picks itself (``--bind tcp://127.0.0.1:0``) and
writes the endpoint it got to a file (``--endpoint-file``), which the cluster waits
for before it starts the stages. A port chosen by the cluster and bound by the
coordinator a second later (once it has started) could be taken meanwhile by any
socket bound to port 0 on the machine: the client's own sink, a stage's port,
another program's. The coordinator then failed to bind and exited, and the client,
connected to whatever held the port (a PULL refuses a DEALER's handshake, and
libzmq does not try again), waited out ``coordinator_silence_s`` before it said
``coordinator_lost``.

A restarted coordinator cannot do that: the stages and the client know only the
endpoint it had, so it binds the same port again. While it is down (from its death
to its successor's bind, a second or two of starting) the port is free, and the same
race could hand it to any socket bound to port 0. :class:`PortHold` closes that
window: the cluster binds the port itself (bound, not listening: connections are
refused exactly as with nobody there, and neither ``bind`` to port 0 nor an outgoing
connection's local port can be given it) from the kill until the new coordinator
listens. Both set ``SO_REUSEADDR`` (libzmq does on its listeners), so the coordinator
binds and listens while the hold is still bound, and the hold is let go after.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

from zpipe._errors import PipelineError

# how often a starting cluster looks whether the coordinator listens yet
ENDPOINT_POLL_S = 0.02
# how often a wait for stages looks whether the coordinator still runs
EXIT_POLL_S = 0.2
ENDPOINT_FILE = "coordinator.endpoint"

T = TypeVar("T")


class StageProcess(Protocol):
    """What the cluster needs of a process: :class:`subprocess.Popen`, or a forked stage."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class CoordinatorStart:
    """The wait for a just-started coordinator to listen, bounded by ``timeout_s``."""

    def __init__(
        self, process: StageProcess, path: Path, logs: Callable[[], str], timeout_s: float
    ) -> None:
        self.process = process
        self.path = path
        self.logs = logs
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s

    def endpoint(self) -> str | None:
        """The endpoint the coordinator wrote, None while it has not yet; PipelineError
        (with its log) when it exited first or the time ran out."""
        if self.path.exists():
            endpoint = self.path.read_text().strip()  # written whole: renamed into place
            if endpoint:
                return endpoint
        if self.process.poll() is not None:
            raise PipelineError(
                f"the coordinator exited with {self.process.returncode} before it "
                f"listened:\n{self.logs()}"
            )
        if time.monotonic() >= self.deadline:
            raise PipelineError(
                f"the coordinator did not listen within {self.timeout_s:g} s:\n{self.logs()}"
            )
        return None

    def wait(self) -> str:
        while (endpoint := self.endpoint()) is None:
            time.sleep(ENDPOINT_POLL_S)
        return endpoint

    async def wait_async(self) -> str:
        while True:
            endpoint = self.endpoint()
            if endpoint is not None:
                return endpoint
            await asyncio.sleep(ENDPOINT_POLL_S)


class PortHold:
    """A TCP port held (bound, not listening) while its coordinator is down, or before
    it starts: ``tcp://HOST:0`` holds any free port (:attr:`endpoint` then names it)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._socket: socket.socket | None = None
        self.error: OSError | None = None  # why the port could not be held
        self.take()

    def take(self) -> bool:
        """Hold the port (again); False, with :attr:`error` set, when another has it."""
        if self._socket is not None:
            return True
        host, _, port_text = self.endpoint.split("://", 1)[-1].rpartition(":")
        host, port = host.strip("[]"), int(port_text)
        hold = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            hold.bind((host, port))
        except OSError as exc:
            hold.close()
            self.error = exc
            return False
        self._socket, self.error = hold, None
        if port == 0:  # the one the system gave
            self.endpoint = f"{self.endpoint.rsplit(':', 1)[0]}:{hold.getsockname()[1]}"
        return True

    def check(self) -> None:
        """A :class:`PipelineError` unless the port is held: a coordinator started now
        could not listen where the stages and the client look for it."""
        if not self.take():
            raise PipelineError(
                f"cannot restart the coordinator on {self.endpoint}: while it was down "
                f"another socket took the port ({self.error}); the stages and the client "
                "know only that endpoint: start a new cluster"
            )

    def release_once_listening(self, start: CoordinatorStart) -> None:
        """Let the port go once ``start``'s coordinator listens (or exited, or its time
        ran out), from a thread: the caller (a client's callback, often) goes on."""

        def release() -> None:
            try:
                start.wait()
            except PipelineError:
                pass  # its exit and log are the caller's to see, as without a hold
            finally:
                self.close()

        threading.Thread(target=release, name="coordinator-port-hold", daemon=True).start()

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


async def coordinator_exit(processes: Mapping[str, StageProcess]) -> int:
    """Once the coordinator process exits, its exit status (looked up by name each
    time: a restarted coordinator replaces the old one)."""
    while True:
        returncode = processes["coordinator"].poll()
        if returncode is not None:
            return returncode
        await asyncio.sleep(EXIT_POLL_S)


async def unless_coordinator_exits(
    waiting: asyncio.Future[T],
    processes: Mapping[str, StageProcess],
    what: str,
    logs: Callable[[], str],
) -> T:
    """``waiting``'s result, or a :class:`PipelineError` with the coordinator's log
    (``logs()``, read then) as soon as the coordinator exits first: nothing registers once it
    has, so the wait should not last the client's ``coordinator_silence_s`` or its
    own timeout. ``what`` names what was awaited."""
    exited = asyncio.ensure_future(coordinator_exit(processes))
    await first_of(waiting, exited)
    if not waiting.cancelled():  # done first (the loser is cancelled)
        return waiting.result()
    raise PipelineError(f"the coordinator exited with {exited.result()} while {what}:\n{logs()}")


def coordinator_argv(
    *,
    endpoint_file: Path,
    suspect_after: int,
    probe_intervals: int,
    measure_links: bool,
    state_dir: Path | None,
    common: list[str],
) -> list[str]:
    """The interpreter arguments of a local cluster's coordinator, listening on a port
    it picks itself and writing it to ``endpoint_file``."""
    return [
        "-m",
        "zpipe.coordinator",
        "--bind",
        "tcp://127.0.0.1:0",
        "--endpoint-file",
        str(endpoint_file),
        "--suspect-after",
        str(suspect_after),
        "--probe-intervals",
        str(probe_intervals),
        *([] if measure_links else ["--no-measure-links"]),
        *(["--state-dir", str(state_dir)] if state_dir is not None else []),
        *common,
    ]


async def first_of(*futures: asyncio.Future[Any]) -> None:
    """Wait until one of ``futures`` is done; cancel (and await) the others, and all
    of them when this wait itself is cancelled."""
    try:
        await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for future in futures:
            future.cancel()  # nothing to a future that is done
        await asyncio.gather(*futures, return_exceptions=True)


def stop_processes(processes: Mapping[str, StageProcess], timeout_s: float) -> None:
    """SIGTERM every process (the coordinator last), then SIGKILL what is left after
    ``timeout_s``."""
    order = [n for n in processes if n != "coordinator"] + ["coordinator"]
    for name in order:
        process = processes.get(name)
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for name in order:
        process = processes.get(name)
        if process is None:
            continue
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


def registered_now(processes: Mapping[str, StageProcess], members: list[dict[str, Any]]) -> bool:
    """Whether no running process of ``processes`` is still represented among the
    live ``members`` by an older process of its name: a stage killed and started again
    is counted alive under its name until the coordinator finds the killed one dead,
    and a run started before the new one registers is refused ("b is not connected")."""
    by_name = {m["name"]: m for m in members}
    for name, process in processes.items():
        member = by_name.get(name)
        if member is None or process.poll() is not None:
            continue  # another name (--name in the extra flags), or it exited
        pid = member.get("info", {}).get("pid")
        if isinstance(pid, int) and pid != process.pid:
            return False
    return True
