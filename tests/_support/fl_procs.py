"""fl-server and fl-client processes for the multi-process federated tests."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

DEADLINE_S = 120.0  # generous: the machine is shared and loaded


class Proc:
    """A zpipe command with its stdout JSON lines collected by a thread."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "zpipe", *args],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self._stderr: str | None = None
        assert self.popen.stdout is not None
        threading.Thread(target=self._read, args=(self.popen.stdout,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            try:
                self.events.put(json.loads(line))
            except json.JSONDecodeError:
                continue

    def wait_event(self, name: str, **match: Any) -> dict[str, Any]:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            try:
                event = self.events.get(timeout=1.0)
            except queue.Empty:
                if self.popen.poll() is not None and self.events.empty():
                    break
                continue
            self.seen.append(event)
            if event.get("event") == name and all(event.get(k) == v for k, v in match.items()):
                return event
        raise AssertionError(
            f"no {name} event {match} after {self.seen[-30:]}; stderr: {self.stderr_tail()}"
        )

    def finish(self) -> int:
        return self.popen.wait(timeout=DEADLINE_S)

    def stderr_tail(self) -> str:
        if self.popen.poll() is None or self.popen.stderr is None:
            return "(running)"
        if self._stderr is None:
            self._stderr = self.popen.stderr.read()
        return self._stderr[-4000:]

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=10)
