"""Eco-FL on Flower's deployment engine: a real ``flower-superlink``, real
``flower-supernode`` processes on loopback and ``flwr run``; every client trains
on a zpipe pipeline of two stage processes. The run learns; a SuperNode killed
with SIGKILL mid-round is dropped out by the server (its task fails, the round
goes on without it) and re-admitted when it is started again, after which it
trains again.

Flower starts a process for every message and each starts its pipeline's stage
processes, so a task costs seconds of process start on two cores: two SuperNodes,
one group, generous deadlines, and the test waits on the ServerApp's event log.
Every process started here (Flower detaches some into sessions of their own) carries
a marker in its environment, and the teardown kills each one that does."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._support.flower_processes import FlowerProcesses
from zpipe.federated.flower_deploy import write_app
from zpipe.federated.flower_deploy_control import DeploySettings

pytest.importorskip("flwr.serverapp")

pytestmark = pytest.mark.timeout(900)

STEP_S = 300.0  # for one step of the run (a profiling, a round) on a loaded machine


@pytest.fixture
def flower(tmp_path: Path) -> Iterator[FlowerProcesses]:
    processes = FlowerProcesses(tmp_path)
    try:
        yield processes
    finally:
        processes.close()


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def _wait_for(
    path: Path,
    found: Callable[[list[dict[str, Any]]], bool],
    what: str,
    flower: FlowerProcesses,
    timeout: float = STEP_S,
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = _events(path)
        if found(events):
            return events
        if flower.procs[0].poll() is not None:
            break
        time.sleep(0.5)
    logs = {p.name: p.read_text(errors="replace")[-3000:] for p in flower.home.glob("*.log")}
    raise AssertionError(f"no {what} in time; events: {_events(path)}; logs: {logs}")


def _index(events: list[dict[str, Any]], match: Callable[[dict[str, Any]], bool]) -> int:
    return next(i for i, e in enumerate(events) if match(e))


def test_ecofl_on_superlink_drops_a_killed_supernode_and_readmits_it(
    flower: FlowerProcesses, tmp_path: Path
) -> None:
    events_path = tmp_path / "events.jsonl"
    settings = DeploySettings(
        clients=2,
        max_concurrent=2,
        n_groups=1,
        # RT^g at least twice its centre: a re-profiled latency on a loaded machine
        # stays in range, so the re-admission does not hang on the load
        rt_floor_fraction=2.0,
        max_updates=50,  # the test ends the run once it has seen what it waits for
        # a pipeline's start costs far more than its steps: more steps per task make
        # each of the few updates count
        local_steps=30,
        lr=0.2,
        task_timeout_s=STEP_S,
        profile_timeout_s=STEP_S,
        nodes_timeout_s=STEP_S,
        probe_interval_s=5.0,
        events_path=str(events_path),
    )
    app = write_app(tmp_path / "app", settings)
    flower.cli_config(f'address = "127.0.0.1:{flower.port}"\ninsecure = true')
    flower.superlink("--insecure")
    nodes = {p: flower.supernode(p, "--insecure") for p in (0, 1)}
    submitted = flower.flwr("run", str(app), "local")
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr

    # the first round is out to both clients: kill client 1's SuperNode mid-round
    events = _wait_for(
        events_path,
        lambda es: any(e["event"] == "dispatched" and e["client"] == 1 for e in es),
        "task for client 1",
        flower,
    )
    started = next(e for e in events if e["event"] == "started")
    assert started["groups"] == [[0, 1]] and started["dropped"] == []
    nodes[1].send_signal(signal.SIGKILL)
    nodes[1].wait(timeout=30)

    # its task fails (Flower reports the node unavailable once its heartbeats stop,
    # or the deadline passes): Eco-FL drops it out, and client 0 trains on
    events = _wait_for(
        events_path,
        lambda es: any(e["event"] == "dropped" and e["client"] == 1 for e in es),
        "drop-out of client 1",
        flower,
    )
    failed = next(e for e in events if e["event"] == "task_failed")
    assert failed["client"] == 1 and failed["why"] in ("error reply", "timed out")

    # started again, the SuperNode registers under a new node id; its profiling names
    # client 1, whose latency re-admits it into the group, and it trains again
    flower.supernode(1, "--insecure", name="supernode1-again")
    events = _wait_for(
        events_path,
        _trained_again,
        "update from client 1 after its re-admission, and its merge",
        flower,
        timeout=2 * STEP_S,
    )
    dropped = _index(events, lambda e: e["event"] == "dropped" and e["client"] == 1)
    readmitted = _index(events, lambda e: e["event"] == "readmitted" and e["client"] == 1)
    assert dropped < readmitted
    rejoined = next(e for e in events if e["event"] == "rejoined")
    killed_node = next(e for e in events if e["event"] == "dispatched" and e["client"] == 1)
    assert rejoined["client"] == 1 and rejoined["node"] != killed_node["node"]
    evals = [e["accuracy"] for e in events if e["event"] == "eval"]
    assert len(evals) >= 3 and max(evals[1:]) > evals[0] + 0.05, evals


def _trained_again(events: list[dict[str, Any]]) -> bool:
    """Whether client 1, re-admitted, trained again and its group's model was merged
    (evaluated) since."""
    stage = 0
    for e in events:
        if stage == 0 and e["event"] == "readmitted" and e["client"] == 1:
            stage = 1
        elif stage == 1 and e["event"] == "update" and e["client"] == 1:
            stage = 2
        elif stage == 2 and e["event"] == "eval":
            return True
    return False
