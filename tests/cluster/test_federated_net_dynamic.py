"""A networked federated run whose membership changes: one shared secure run.

fl-server with --keys whose roles.txt gives clients c0-c3 the client role
and stage0 the stage role. Three clients register; client 2 answers fast,
then one task slowly (past --task-timeout: dropped out), then fast again,
which only the server's latency probes can see: it must be re-admitted and
train again. Client 3 registers after the run started: it must be associated
and get tasks. A peer holding the stage key tries to register as an fl
client and must be refused. The trace, joins and probes included, replays to
the same decisions through a fresh server object.

The late client is started with the others, behind a gate (a TCP forwarder the
test opens once the run has started), and the test waits for its join: the run
must not end while its process is still starting (3 of 5 runs failed so at load
13-24, the 60 updates done before the late client's imports were).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

pytest.importorskip("sklearn")

from tests._support.fl_procs import DEADLINE_S, Proc
from zpipe.cluster.coordinator_process import PortHold
from zpipe.federated.net_trace import read_trace, replay
from zpipe.protocol.federated import FlRegister
from zpipe.transport import security
from zpipe.transport.codec import decode, encode
from zpipe.transport.keys import load_keypair, load_keypair_public
from zpipe.transport.roles import generate_keys_with_roles

SLOW_CLIENT = 2
LATE_CLIENT = 3


def client_args(endpoint: str, keys: Path, client: int, classes: str, delay: str) -> list[str]:
    return [
        *("fl-client", "--server", endpoint, "--id", str(client), "--classes", classes),
        *("--samples", "40", "--idle-timeout", "60", "--connect-timeout", "60"),
        *("--keys", str(keys), "--key-name", f"c{client}", "--delay", delay),
    ]


def register_with_stage_key(endpoint: str, keys: Path) -> dict[str, Any]:
    """A stage's key trying to act as an fl client; returns the server's answer."""
    context = zmq.Context.instance()
    peer = context.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.RCVTIMEO, int(DEADLINE_S * 1000))
    security.secure_client(
        peer, load_keypair(keys, "stage0"), load_keypair_public(keys, "fl-server")
    )
    peer.connect(endpoint)
    try:
        register = FlRegister(client=9, label_counts=[4] * 10, latency_s=0.2)
        peer.send_multipart(encode(register.to_message()))
        answer = decode(peer.recv_multipart())
        return {"kind": answer.kind, **answer.body}
    finally:
        peer.close()


class Gate:
    """A loopback port that forwards each connection to the server, but only once
    opened: a client started early connects here and waits (its register waits for
    a handshake), so its process start is no longer raced against the run."""

    def __init__(self, server_endpoint: str) -> None:
        host, port = server_endpoint.removeprefix("tcp://").rsplit(":", 1)
        self._server = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.endpoint = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._held: list[socket.socket] = []
        self.connected = threading.Event()  # the early client reached the gate
        self._open = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connected.set()
            with self._lock:
                if self._open.is_set():
                    self._forward(conn)
                else:
                    self._held.append(conn)  # libzmq retries it if this takes long

    def open(self) -> None:
        with self._lock:
            self._open.set()
            for conn in self._held:
                self._forward(conn)
            self._held.clear()

    def _forward(self, conn: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self._server, timeout=DEADLINE_S)
        except OSError:  # the server has ended (a client reconnecting after its done)
            conn.close()
            return
        for src, dst in ((conn, upstream), (upstream, conn)):
            threading.Thread(target=_pump, args=(src, dst), daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    src.settimeout(None)
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@dataclass
class Run:
    server: Proc
    clients: list[Proc]
    summary: dict[str, Any]
    stage_answer: dict[str, Any]
    trace: Path


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    tmp = tmp_path_factory.mktemp("fldyn")
    keys = tmp / "keys"
    generate_keys_with_roles(keys, ["fl-server", "stage0"])  # stage0: the stage role
    generate_keys_with_roles(keys, ["c0", "c1", "c2", "c3"], role="client")
    trace = tmp / "trace.jsonl"
    # held (bound, not listening) until the test ends: the clients start beside the
    # server, and no socket bound to port 0 meanwhile can be given the port
    hold = PortHold("tcp://127.0.0.1:0")
    endpoint = hold.endpoint
    # the late client starts with the server, behind the gate: its process start
    # overlaps the others', and its registration waits there while they start (give
    # it the time: fl-client's connect timeout counts that wait)
    gate = Gate(endpoint)
    late_args = client_args(gate.endpoint, keys, LATE_CLIENT, "1,3,5,7,9", "0.2")
    late = Proc([*late_args, "--connect-timeout", str(3 * DEADLINE_S)], tmp)
    started = [late]
    try:
        # groups near 0.2 s and 0.5 s, each admitting up to 2.5 times its centre: a 2.5 s
        # timeout is out of every range
        server = Proc(
            [
                *("fl-server", "--bind", endpoint, "--keys", str(keys), "--trace", str(trace)),
                *("--clients", "3", "--method", "ecofl", "--groups", "2", "--rt-floor", "1.5"),
                *("--updates", "60", "--eval-every", "10", "--task-timeout", "2.5"),
                *("--probe-interval", "1", "--probe-timeout", "2.5"),
                *("--register-timeout", "90", "--duration", "150"),
            ],
            tmp,
        )
        started.append(server)
        server.wait_event("listening")
        clients = [
            Proc(client_args(endpoint, keys, 0, "0,1,2,3,4", "0.2"), tmp),
            Proc(client_args(endpoint, keys, 1, "5,6,7,8,9", "0.5"), tmp),
            # fast for two answers, one task of 3 s (past the timeout), then fast again
            Proc(
                [
                    *client_args(endpoint, keys, SLOW_CLIENT, "0,2,4,6,8", "0.5"),
                    *("--delay-from", "2:3", "--delay-from", "3:0.5"),
                ],
                tmp,
            ),
        ]
        started += clients
        stage_answer = register_with_stage_key(endpoint, keys)
        server.wait_event("eval", global_updates=0)  # the run has started
        assert gate.connected.wait(DEADLINE_S), "the late client never reached the gate"
        gate.open()
        try:
            server.wait_event("joined", client=LATE_CLIENT)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nthe late client: {late.stderr_tail()}") from None
        summary = server.wait_event("fl_server_done")
        yield Run(server, [*clients, late], summary, stage_answer, trace)
    finally:
        for proc in started:
            proc.stop()
        hold.close()
        gate.close()


def _client_events(client: Proc) -> list[dict[str, Any]]:
    """Everything the client printed up to its end of run."""
    if not any(e.get("event") == "done" for e in client.seen):
        client.wait_event("done")
    return client.seen


def _server_events(run: Run, *names: str) -> list[dict[str, Any]]:
    return [e for e in run.server.seen if e.get("event") in names]


def test_the_run_ends_by_its_budget_with_every_client(run: Run) -> None:
    assert run.server.finish() == 0, run.server.stderr_tail()
    assert run.summary["reason"] == "updates"
    assert run.summary["clients"] == [0, 1, 2, 3]
    for client in run.clients:
        assert client.finish() == 0, client.stderr_tail()
        done = [e for e in _client_events(client) if e.get("event") == "done"]
        assert done[0]["reason"] == "updates"


def test_a_dropped_client_is_probed_and_readmitted_when_it_is_fast_again(run: Run) -> None:
    events = _server_events(run, "task_failed", "dropped", "probe", "readmitted", "update")
    mine = [e for e in events if e.get("client") == SLOW_CLIENT]
    kinds = [e["event"] for e in mine]
    failed = kinds.index("task_failed")
    dropped = kinds.index("dropped", failed)
    readmitted = kinds.index("readmitted", dropped)
    probes = [e for e in mine[dropped:readmitted] if e["event"] == "probe"]
    assert probes and probes[-1]["answered"] and probes[-1]["latency_s"] < 2.5
    assert "update" in kinds[readmitted:], "re-admitted but never trained again"
    assert run.summary["probes"] >= len(probes)
    stats = run.summary["stats"]
    assert stats["clients_dropped"] >= 1 and stats["clients_readmitted"] >= 1
    assert any(e.get("event") == "probed" for e in _client_events(run.clients[SLOW_CLIENT]))
    # while it was out it got no task, not even from the round its failure ended
    events = read_trace(run.trace)
    out = next(
        i
        for i, e in enumerate(events)
        if e["event"] == "silent" and e["client"] == SLOW_CLIENT and e["waited_s"] == 2.5
    )
    # back in at the answer the server re-admitted it on (a probe slowed by a loaded
    # machine may re-admit it above any fixed latency, and tasks follow at once)
    readmitted_at = mine[readmitted]["latency_s"]
    back = next(
        i
        for i, e in enumerate(events)
        if i > out
        and e["event"] == "latency"
        and e["client"] == SLOW_CLIENT
        and round(e["latency_s"], 4) == readmitted_at
    )
    between = events[out:back]
    assert not [e for e in between if e["event"] == "dispatch" and e["client"] == SLOW_CLIENT]


def test_a_late_client_is_associated_and_trains(run: Run) -> None:
    joined = _server_events(run, "joined")
    assert [e["client"] for e in joined] == [LATE_CLIENT]
    assert joined[0]["dropped"] is False  # 0.2 s fits a group's range
    updates = [e for e in _server_events(run, "update") if e["client"] == LATE_CLIENT]
    assert updates, "the late client never trained"
    assert run.summary["stats"]["clients_joined"] == 1


def test_a_stage_key_cannot_act_as_an_fl_client(run: Run) -> None:
    assert run.stage_answer["kind"] == "fl_error"
    assert "stage key may not send 'fl_register'" in run.stage_answer["reason"]
    assert 9 not in run.summary["clients"]
    assert "role_refused" in run.server.stderr_tail()


def test_the_trace_replays_to_the_same_decisions(run: Run) -> None:
    events = read_trace(run.trace)
    assert any(e["event"] == "join" for e in events)
    replayed = replay(events)
    recorded = [(e["task"], e["client"], e["version"]) for e in events if e["event"] == "dispatch"]
    assert replayed.dispatches == recorded
    end = events[-1]
    assert end["event"] == "end" and np.array_equal(replayed.weights, np.asarray(end["weights"]))
