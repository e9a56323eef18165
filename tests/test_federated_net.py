"""fl-server and fl-client as real processes on loopback.

One open run (four clients, one killed mid-run, a rogue peer sending junk) and
one run with --keys (an unlisted key is refused). The server's --trace is
replayed through a fresh server object: the networked shell must have made
exactly the decisions of the pure server code fl-sim drives.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import msgpack
import numpy as np
import pytest
import torch
import zmq

pytest.importorskip("sklearn")

from zpipe.federated.model import MLPShape, accuracy
from zpipe.federated.net_trace import read_trace, replay
from zpipe.lossy.data import load_digits_dataset
from zpipe.protocol.federated import FlRegister, FlUpdate
from zpipe.transport.codec import decode, encode
from zpipe.transport.keys import generate_keys

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
        return self.popen.stderr.read()[-2000:]

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=10)


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for proc in started:
        proc.stop()


SERVER_FLAGS = ["--bind", "tcp://127.0.0.1:0", "--register-timeout", "90", "--duration", "120"]


def client_args(endpoint: str, client: int, classes: str, delay: float) -> list[str]:
    return [
        "fl-client",
        "--server",
        endpoint,
        "--id",
        str(client),
        "--classes",
        classes,
        "--samples",
        "60",
        "--delay",
        str(delay),
        "--idle-timeout",
        "60",
    ]


def send_junk(endpoint: str) -> list[dict[str, Any]]:
    """What a buggy or hostile peer sends; returns what the server answered."""
    context = zmq.Context.instance()
    rogue = context.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.setsockopt(zmq.RCVTIMEO, 20_000)
    rogue.connect(endpoint)
    try:
        rogue.send(b"\x00 not msgpack at all")
        rogue.send(msgpack.packb({"v": 1, "k": "no_such_kind", "e": 0, "b": {}, "t": []}))
        forged = FlUpdate(
            task=0,
            client=0,
            n_samples=60,
            train_s=0.1,
            tensors=(torch.zeros(3, dtype=torch.float64),),
        )
        rogue.send_multipart(encode(forged.to_message()))
        bad = FlRegister(client=77, label_counts=[1, 2], latency_s=0.1)  # 2 classes, not 10
        rogue.send_multipart(encode(bad.to_message()))
        return [dict(decode(rogue.recv_multipart()).body) | {"kind": "fl_error"}]
    finally:
        rogue.close()


def test_server_and_clients_train_drop_a_killed_client_and_survive_junk(
    tmp_path: Path, procs: list[Proc]
) -> None:
    trace = tmp_path / "trace.jsonl"
    server = Proc(
        [
            "fl-server",
            *SERVER_FLAGS,
            "--clients",
            "4",
            "--method",
            "ecofl",
            "--groups",
            "2",
            "--rt-floor",
            "1.5",
            "--updates",
            "40",
            "--eval-every",
            "5",
            "--task-timeout",
            "1.5",
            "--trace",
            str(trace),
        ],
        tmp_path,
    )
    procs.append(server)
    endpoint = server.wait_event("listening")["endpoint"]
    # two latency groups: clients 0 and 1 answer in about 0.1 s, 2 and 3 in 0.3 s; a
    # group's range is 1.5 times its centre, so a 1.5 s timeout is out of every range
    layout = {0: ("0,1,2,3,4", 0.1), 1: ("5,6,7,8,9", 0.1), 2: ("0,2,4,6,8", 0.3)}
    for client, (classes, delay) in layout.items():
        procs.append(Proc(client_args(endpoint, client, classes, delay), tmp_path))
    victim = Proc(client_args(endpoint, 3, "1,3,5,7,9", 0.3), tmp_path)
    procs.append(victim)

    answers = send_junk(endpoint)
    assert answers[0]["kind"] == "fl_error" and "label_counts" in answers[0]["reason"]

    victim.wait_event("task")
    victim.popen.send_signal(signal.SIGKILL)
    failed = server.wait_event("task_failed", client=3)
    summary = server.wait_event("fl_server_done")
    assert server.finish() == 0

    # the run ended by its own budget, without the killed client
    assert summary["reason"] == "updates" and summary["global_updates"] == 40
    assert summary["clients"] == [0, 1, 2, 3]
    later = [
        e
        for e in server.seen
        if e.get("event") == "update" and e["client"] == 3 and e["task"] > failed["task"]
    ]
    assert later == []
    assert summary["stats"]["failed_tasks"] >= 1
    assert summary["stats"]["clients_dropped"] >= 1  # a timeout is a latency out of range
    assert summary["dropped_messages"] >= 4
    for proc in procs[1:4]:
        assert proc.finish() == 0, proc.stderr_tail()

    # learning happened: well above chance (10 classes) and above the start
    assert summary["curve"][0]["test_acc"] < 0.2
    assert summary["final_acc"] > 0.3

    # the shell decided nothing itself: a fresh server object given the same inputs
    # dispatches the same tasks and ends with the same model
    events = read_trace(trace)
    replayed = replay(events)
    recorded = [(e["task"], e["client"], e["version"]) for e in events if e["event"] == "dispatch"]
    assert replayed.dispatches == recorded
    assert replayed.version == summary["global_updates"]
    end = events[-1]
    assert end["event"] == "end" and np.array_equal(replayed.weights, np.asarray(end["weights"]))
    dataset = load_digits_dataset()
    shape = MLPShape(dataset.n_features, 32, dataset.n_classes)
    acc = accuracy(replayed.weights, shape, dataset.x_test, dataset.y_test)
    assert round(acc, 4) == summary["final_acc"]


def test_an_unlisted_key_is_refused(tmp_path: Path, procs: list[Proc]) -> None:
    keys = tmp_path / "keys"
    generate_keys(keys, ["fl-server", "alice", "bob"])
    other = tmp_path / "other"
    generate_keys(other, ["mallory"])
    shutil.copy(keys / "fl-server.key", other / "fl-server.key")  # she knows the server

    server = Proc(
        [
            *("fl-server", *SERVER_FLAGS, "--clients", "2", "--method", "fedavg"),
            *("--updates", "3", "--keys", str(keys), "--task-timeout", "20"),
        ],
        tmp_path,
    )
    procs.append(server)
    endpoint = server.wait_event("listening")["endpoint"]
    mallory = Proc(
        [
            *client_args(endpoint, 2, "0,1", 0.0),
            *("--keys", str(other), "--key-name", "mallory", "--connect-timeout", "5"),
        ],
        tmp_path,
    )
    procs.append(mallory)
    for client, name in enumerate(["alice", "bob"]):
        procs.append(
            Proc(
                [
                    *client_args(endpoint, client, "0,1,2,3,4,5,6,7,8,9", 0.0),
                    *("--keys", str(keys), "--key-name", name),
                ],
                tmp_path,
            )
        )
    summary = server.wait_event("fl_server_done")
    assert server.finish() == 0
    assert summary["clients"] == [0, 1] and summary["global_updates"] == 3
    assert mallory.finish() == 1
    assert "fl_welcome" in mallory.stderr_tail()
