"""Real Flower processes for the deployment-engine tests: a SuperLink, SuperNodes
and the ``flwr`` CLI, each with its log in the test's folder.

Flower detaches its SuperExec, ServerApp and ClientApp processes into sessions of
their own, and a ClientApp's pipeline starts stage processes: every process started
here carries a marker in its environment, and :meth:`FlowerProcesses.close` kills
each one that does, so no test leaves a process behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from zpipe.transport.ports import free_tcp_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
MARKER = "ZPIPE_FLOWER_TEST"
LISTEN_S = 120.0  # for a SuperLink to listen on a loaded machine


class FlowerProcesses:
    """Processes in ``home`` (their logs; ``FLWR_HOME`` is ``home/flwr``)."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.marker = uuid.uuid4().hex
        self.env = {
            **os.environ,
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "FLWR_HOME": str(home / "flwr"),
            # no telemetry and no look for a newer flwr: nothing leaves the machine
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            MARKER: self.marker,
        }
        self.port = free_tcp_port()
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        """``args[0]`` from the venv's bin folder, its output in ``home/NAME.log``."""
        with (self.home / f"{name}.log").open("ab") as out:
            proc = subprocess.Popen(
                [str(BIN / args[0]), *args[1:]],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.home / f"{name}.log").read_text(errors="replace")

    def superlink(self, *extra: str) -> subprocess.Popen[bytes]:
        """A SuperLink on :attr:`port` (no dependency installation: no network), once
        it listens."""
        proc = self.start(
            "superlink",
            [
                "flower-superlink",
                "--port",
                str(self.port),
                "--disable-runtime-dependency-installation",
                *extra,
            ],
        )
        if not listening(self.port, proc, LISTEN_S):
            raise AssertionError(
                f"the SuperLink did not listen in time: {self.log('superlink')[-3000:]}"
            )
        return proc

    def supernode(self, partition: int, *extra: str, name: str = "") -> subprocess.Popen[bytes]:
        return self.start(
            name or f"supernode{partition}",
            [
                "flower-supernode",
                "--superlink",
                f"127.0.0.1:{self.port}",
                "--port",
                str(free_tcp_port()),
                "--node-config",
                f"partition-id={partition}",
                *extra,
            ],
        )

    def cli_config(self, connection: str) -> None:
        """The ``flwr`` CLI's ``local`` connection (``connection``: TOML lines)."""
        flwr_home = self.home / "flwr"
        flwr_home.mkdir(parents=True, exist_ok=True)
        text = f'[superlink]\ndefault = "local"\n\n[superlink.local]\n{connection}\n'
        (flwr_home / "config.toml").write_text(text, encoding="utf-8")

    def flwr(self, *args: str, timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(BIN / "flwr"), *args],
            env={**self.env, "COLUMNS": "200"},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10.0
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10.0)
        for pid in marked(self.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def listening(port: int, proc: subprocess.Popen[bytes], deadline_s: float) -> bool:
    """Whether ``proc`` accepts connections on ``port`` within ``deadline_s`` (False
    at once when it exits)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return True
        except OSError:
            time.sleep(0.5)
    return False


def marked(marker: str) -> list[int]:
    """The processes whose environment carries ``marker``."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found
