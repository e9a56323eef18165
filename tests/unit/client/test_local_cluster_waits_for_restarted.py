"""A LocalCluster's wait for its stages waits for the processes it runs now: a stage
killed and started again is still counted alive under its name (with the killed
process's pid) until the coordinator finds it dead, and a run started in between is
refused ("b is not connected"). Pure: the processes and the members are made up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zpipe.cluster.local import registered_now


@dataclass
class _Process:
    pid: int
    returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


def _member(name: str, pid: int | None) -> dict[str, Any]:
    info = {} if pid is None else {"pid": pid}
    return {"name": name, "state": "alive", "info": info}


def test_the_wait_holds_while_a_name_is_held_by_an_older_process() -> None:
    processes: dict[str, Any] = {"a": _Process(101), "b": _Process(202)}
    assert registered_now(processes, [_member("a", 101), _member("b", 202)])
    # b was killed (pid 200) and started again as 202: its old registration is not it
    assert not registered_now(processes, [_member("a", 101), _member("b", 200)])
    # a process that exited, a name no process runs, or no pid said: not waited for
    processes["b"] = _Process(202, returncode=-9)
    assert registered_now(processes, [_member("a", 101), _member("b", 200)])
    assert registered_now(processes, [_member("a", 101), _member("x", 7), _member("b", None)])
