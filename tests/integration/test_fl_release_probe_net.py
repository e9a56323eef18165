"""An open fl-server on real sockets: ids of clients that left are released, and a
client set aside is probed back (issue 33).

The server runs in a thread of this process (its real shell and socket), the clients
are DEALER sockets of the test. One address fills its ``--ids-per-address``; two of
its clients close their connections, the server's socket monitor sees them go, and a
new client from the address is admitted. And a client that left a task unanswered is
set aside, probed, stays aside while it does not answer, and is given tasks again
once it answers a probe.
"""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import zmq

pytest.importorskip("sklearn")

from tests._support.fl_raw import receive_fl, send_fl
from zpipe.federated.net_commands import NetServerConfig
from zpipe.federated.net_server import FederatedShell
from zpipe.federated.server import ServerConfig
from zpipe.lossy.data import load_digits_dataset
from zpipe.protocol import WireMessage
from zpipe.protocol.federated import (
    FlDone,
    FlError,
    FlProbe,
    FlProbeReply,
    FlRegister,
    FlTask,
    FlUpdate,
    FlWelcome,
)

DEADLINE_S = 120.0  # generous: the machine is shared and loaded
COUNTS = [10] * 10  # the digits' ten classes


def _answer(task: FlTask, client: int) -> FlUpdate:
    weights = task.tensors[0].clone()
    return FlUpdate(
        task=task.task, client=client, n_samples=sum(COUNTS), train_s=0.0, tensors=(weights,)
    )


class Server:
    """A FederatedShell serving in a thread; its output lines readable as they come."""

    def __init__(self, config: NetServerConfig) -> None:
        self.out = io.StringIO()
        self.shell = FederatedShell(config, load_digits_dataset(), out=self.out)
        self.endpoint = self.shell.open()
        self.result: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            self.result["summary"] = asyncio.run(self.shell.serve())
        except BaseException as exc:  # the test reports it
            self.result["error"] = exc

    def events(self, name: str) -> list[dict[str, Any]]:
        lines = [json.loads(line) for line in self.out.getvalue().splitlines() if line]
        return [e for e in lines if e["event"] == name]

    def close(self) -> None:
        self.thread.join(DEADLINE_S)
        self.shell.close()


class Live:
    """A client that answers every task after ``pace_s``, while the test waits."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], endpoint: str, client: int):
        self.client = client
        self.sock = context.socket(zmq.DEALER)
        self.sock.connect(endpoint)
        self.done: FlDone | None = None
        send_fl(self.sock, FlRegister(client=client, label_counts=COUNTS, latency_s=0.05))
        assert isinstance(receive_fl(self.sock, DEADLINE_S), FlWelcome)

    def serve_until(self, condition: Callable[[], bool], pace_s: float = 0.1) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not condition():
            assert time.monotonic() < deadline, "the awaited event never came"
            assert self.done is None, "the run ended first"
            message = receive_fl(self.sock, 0.05)
            if isinstance(message, FlTask):
                time.sleep(pace_s)
                send_fl(self.sock, _answer(message, self.client))
            elif isinstance(message, FlDone):
                self.done = message

    def serve_to_the_end(self) -> FlDone:
        deadline = time.monotonic() + DEADLINE_S
        while self.done is None and time.monotonic() < deadline:
            message = receive_fl(self.sock, 1.0)
            if isinstance(message, FlTask):
                send_fl(self.sock, _answer(message, self.client))
            elif isinstance(message, FlDone):
                self.done = message
        assert self.done is not None, "no fl_done"
        return self.done


def test_an_address_whose_clients_left_registers_a_new_one() -> None:
    server = Server(
        NetServerConfig(
            server=ServerConfig(method="fedasync", max_concurrent=2, seed=0),
            clients=1,
            hidden=8,
            local_steps=1,
            task_timeout_s=DEADLINE_S / 4,  # a gone client's task is taken back sooner
            probe_interval_s=0.0,
            max_updates=30,
            duration_s=DEADLINE_S,
            eval_every=1000,
            ids_per_address=3,
            register_timeout_s=DEADLINE_S / 2,
        )
    )
    context = zmq.Context()
    sockets: list[zmq.Socket[bytes]] = []
    try:
        live = Live(context, server.endpoint, 0)
        sockets.append(live.sock)

        def register(client: int) -> tuple[zmq.Socket[bytes], WireMessage | None]:
            sock = context.socket(zmq.DEALER)
            sockets.append(sock)
            sock.connect(server.endpoint)
            send_fl(sock, FlRegister(client=client, label_counts=COUNTS, latency_s=0.05))
            return sock, receive_fl(sock, DEADLINE_S)

        first, welcome1 = register(100)
        second, welcome2 = register(101)
        assert isinstance(welcome1, FlWelcome) and isinstance(welcome2, FlWelcome)
        _, refused = register(102)  # 127.0.0.1 holds 0, 100 and 101
        assert isinstance(refused, FlError) and "--ids-per-address 3" in refused.reason
        first.close(linger=0)
        second.close(linger=0)
        # the server learns it from its socket monitor, with the next message it reads
        live.serve_until(lambda: len(server.events("released")) == 2)
        _, admitted = register(103)
        assert isinstance(admitted, FlWelcome)
        done = live.serve_to_the_end()
    finally:
        for sock in sockets:
            sock.close(linger=0)
        context.term()
        server.close()
    assert "error" not in server.result, server.result.get("error")
    released = server.events("released")
    assert {e["client"] for e in released} == {100, 101}
    assert all(e["reason"] == "its connection closed" for e in released)
    summary = server.result["summary"]
    assert done.reason == "updates" and summary["global_updates"] == 30
    assert summary["clients"] == [0, 100, 101, 103]
    # each held a task (100 the free slot, 101 the one 100's gave back): taken back
    # when its connection closed; at the 30 s deadline the run would have been over
    failed = [e["client"] for e in server.events("task_failed")]
    assert sorted(failed) == [100, 101] and summary["wall_s"] < DEADLINE_S / 4


def test_a_set_aside_client_is_probed_and_used_again_once_it_answers() -> None:
    server = Server(
        NetServerConfig(
            server=ServerConfig(method="fedasync", max_concurrent=2, seed=0),
            clients=1,
            hidden=8,
            local_steps=1,
            # a measured client's task is taken back after 3 s (the floor), the live
            # client's and the sleeper's alike: the live one answers in about 0.1 s
            task_timeout_s=DEADLINE_S / 4,
            task_floor_s=3.0,
            probe_interval_s=0.5,
            probe_timeout_s=1.5,
            max_updates=500,
            duration_s=DEADLINE_S,
            eval_every=1000,
            register_timeout_s=DEADLINE_S / 2,
        )
    )
    context = zmq.Context()
    sleeper = context.socket(zmq.DEALER)
    got: list[str] = []  # what the sleeper received, in order
    try:
        live = Live(context, server.endpoint, 0)
        sleeper.connect(server.endpoint)
        send_fl(sleeper, FlRegister(client=1, label_counts=COUNTS, latency_s=0.05))
        assert isinstance(receive_fl(sleeper, DEADLINE_S), FlWelcome)
        probes = 0
        trained = False

        def step() -> bool:
            """The sleeper: answers its first task (so it is measured), ignores the
            second and its first probe, answers the next probe and every task after
            it. True once it has trained again."""
            nonlocal probes, trained
            message = receive_fl(sleeper, 0.0)
            if isinstance(message, FlTask):
                got.append("task")
                if got.count("task") == 1:
                    send_fl(sleeper, _answer(message, 1))
                elif probes >= 2:
                    send_fl(sleeper, _answer(message, 1))
                    trained = True
            elif isinstance(message, FlProbe):
                got.append("probe")
                probes += 1
                if probes >= 2:
                    send_fl(sleeper, FlProbeReply(probe=message.probe, client=1, work_s=0.01))
            return trained

        live.serve_until(step, pace_s=0.05)
        live.serve_to_the_end()
    finally:
        sleeper.close(linger=0)
        live.sock.close(linger=0)
        context.term()
        server.close()
    assert "error" not in server.result, server.result.get("error")
    # its second task was taken back; no task came while it was aside (two probes)
    assert got[:5] == ["task", "task", "probe", "probe", "task"], got
    mine = [e for e in server.events("probe") if e["client"] == 1]
    assert [e["answered"] for e in mine[:2]] == [False, True]
    assert [e["client"] for e in server.events("readmitted")] == [1]
    assert len([e for e in server.events("update") if e["client"] == 1]) == 2
    assert server.result["summary"]["probes"] >= 2
