"""fl-server and fl-client as real processes on loopback, one shared secure run.

A server with --keys and four listed clients (one training on a 2-stage zpipe
pipeline, one killed mid-run); meanwhile a
client with an unlisted key tries to join and a listed but buggy peer sends
junk. The server's --trace is replayed through a fresh server object: the
networked shell must have made exactly the decisions of the pure server code
fl-sim drives. (Process start-up dominates: about 2.5 CPU-s each, for torch and
scikit-learn, so the run is shared.)
"""

from __future__ import annotations

import json
import math
import shutil
import signal
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import zmq

pytest.importorskip("sklearn")

from tests._support.fl_procs import DEADLINE_S, Proc
from zpipe._errors import ProtocolError
from zpipe.cluster.coordinator_process import PortHold
from zpipe.federated.grouping import GroupingPolicy
from zpipe.federated.model import MLPShape, accuracy, local_train
from zpipe.federated.net_client import NetClientConfig, client_shard
from zpipe.federated.net_trace import config_from_json, config_to_json, read_trace, replay
from zpipe.federated.net_wire import shape_from, weights_from
from zpipe.federated.server import ServerConfig
from zpipe.lossy.data import load_digits_dataset
from zpipe.protocol.federated import FlRegister, FlUpdate
from zpipe.transport import security
from zpipe.transport.codec import decode, encode
from zpipe.transport.keys import (
    generate_keys,
    key_prefix,
    load_keypair,
    load_keypair_public,
)

MU = 0.2  # FedProx's mu, sent with every task (the pipeline client must apply it too)


SERVER_FLAGS = ["--register-timeout", "90", "--duration", "120"]


def client_args(endpoint: str, keys: Path, name: str, client: int, classes: str) -> list[str]:
    return [
        *("fl-client", "--server", endpoint, "--id", str(client), "--classes", classes),
        *("--samples", "60", "--idle-timeout", "60", "--connect-timeout", "60"),
        *("--keys", str(keys), "--key-name", name),
    ]


def send_junk(endpoint: str, keys: Path) -> dict[str, Any]:
    """What a buggy peer with a listed key sends; returns the server's answer."""
    context = zmq.Context.instance()
    rogue = context.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.setsockopt(zmq.RCVTIMEO, int(DEADLINE_S * 1000))
    security.secure_client(
        rogue, load_keypair(keys, "rogue"), load_keypair_public(keys, "fl-server")
    )
    rogue.connect(endpoint)
    try:
        rogue.send(b"\x00 not msgpack at all")
        rogue.send(msgpack.packb({"v": 1, "k": "no_such_kind", "e": 0, "b": {}, "t": []}))
        forged = FlUpdate(  # client 0's first task, from a peer that is not client 0
            task=0,
            client=0,
            n_samples=60,
            train_s=0.1,
            tensors=(torch.zeros(3, dtype=torch.float64),),
        )
        rogue.send_multipart(encode(forged.to_message()))
        bad = FlRegister(client=77, label_counts=[1, 2], latency_s=0.1)  # 2 classes, not 10
        rogue.send_multipart(encode(bad.to_message()))
        answer = decode(rogue.recv_multipart())
        return {"kind": answer.kind, **answer.body}
    finally:
        rogue.close()


@dataclass
class Run:
    server: Proc
    clients: list[Proc]
    victim: Proc
    mallory: Proc
    summary: dict[str, Any]
    failed: dict[str, Any]
    junk_answer: dict[str, Any]
    trace: Path
    mallory_key: bytes


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    tmp = tmp_path_factory.mktemp("flnet")
    keys = tmp / "keys"
    generate_keys(keys, ["fl-server", "c0", "c1", "c2", "c3", "rogue"])
    other = tmp / "other"
    generate_keys(other, ["mallory"])
    shutil.copy(keys / "fl-server.key", other / "fl-server.key")  # she knows the server
    trace = tmp / "trace.jsonl"
    # held (bound, not listening) until the test ends: the clients start beside the
    # server, and no socket bound to port 0 meanwhile can be given the port
    hold = PortHold("tcp://127.0.0.1:0")
    endpoint = hold.endpoint
    # two latency groups: client 0 answers in about 0.1 s, 1 and 2 in 0.3 s; a group's
    # range is 1.5 times its centre, so a 1.5 s timeout is out of every range
    server = Proc(
        [
            *("fl-server", *SERVER_FLAGS, "--bind", endpoint, "--keys", str(keys)),
            *("--clients", "4", "--method", "ecofl", "--groups", "2", "--rt-floor", "1.5"),
            *("--updates", "40", "--eval-every", "5", "--task-timeout", "1.5"),
            *("--trace", str(trace), "--mu", str(MU)),
        ],
        tmp,
    )
    started = [server]
    try:
        layout = {0: ("0,1,2,3,4", "0.1"), 1: ("5,6,7,8,9", "0.3"), 2: ("0,2,4,6,8", "0.3")}
        clients = [
            Proc([*client_args(endpoint, keys, f"c{c}", c, classes), "--delay", delay], tmp)
            for c, (classes, delay) in layout.items()
        ]
        # client 3 trains on a 2-stage zpipe pipeline (a coordinator and two stage processes)
        piped = Proc(
            [*client_args(endpoint, keys, "c3", 3, "1,3,5,7,9"), "--pipeline-stages", "2"], tmp
        )
        started += [*clients, piped]
        server.wait_event("listening")  # so that a timeout cannot be a server not yet up
        mallory = Proc(
            [*client_args(endpoint, other, "mallory", 4, "0,1"), "--connect-timeout", "3"], tmp
        )
        started.append(mallory)
        junk_answer = send_junk(endpoint, keys)
        victim = clients[2]
        victim.wait_event("task")
        victim.popen.send_signal(signal.SIGKILL)
        failed = server.wait_event("task_failed", client=2)
        summary = server.wait_event("fl_server_done")
        yield Run(
            server,
            [*clients, piped],
            victim,
            mallory,
            summary,
            failed,
            junk_answer,
            trace,
            load_keypair_public(other, "mallory"),
        )
    finally:
        for proc in started:
            proc.stop()
        hold.close()


def test_the_run_ends_by_its_budget_and_the_live_clients_exit_cleanly(run: Run) -> None:
    assert run.server.finish() == 0, run.server.stderr_tail()
    assert run.summary["reason"] == "updates" and run.summary["global_updates"] == 40
    assert run.summary["clients"] == [0, 1, 2, 3]
    for client in [*run.clients[:2], run.clients[3]]:
        assert client.finish() == 0, client.stderr_tail()
        assert client.wait_event("done")["reason"] == "updates"


def test_the_federation_learns_well_above_chance(run: Run) -> None:
    curve = run.summary["curve"]
    assert curve[0]["global_updates"] == 0 and curve[0]["test_acc"] < 0.2  # 10 classes
    # FedAsync over non-IID shards oscillates: each update pulls the global model
    # towards its client's classes, and which client reports last depends on the
    # machine's load (a loaded run ended at 0.28 after peaking at 0.31). So: the
    # curve rises to three times chance, and the end stays at twice chance.
    assert max(point["test_acc"] for point in curve) > 0.3
    assert run.summary["final_acc"] > 0.2


def test_a_client_trains_on_a_zpipe_pipeline(run: Run) -> None:
    events = read_trace(run.trace)
    updates = [e for e in events if e["event"] == "update" and e["client"] == 3]
    assert updates, "the pipeline client's updates never reached the server"
    # its pipeline trained what the numpy trainer would, FedProx's mu included
    dataset = load_digits_dataset()
    config = NetClientConfig(server="tcp://127.0.0.1:1", client=3, classes=(1, 3, 5, 7, 9))
    shard = client_shard(replace(config, samples=60), dataset)
    sent = replay(events).task_weights
    shape = MLPShape(dataset.n_features, 32, dataset.n_classes)

    def numpy_update(task: int, mu: float) -> np.ndarray:
        return local_train(
            sent[task],
            shape,
            shard.x,
            shard.y,
            steps=10,
            batch_size=10,
            lr=0.1,
            mu=mu,
            rng=np.random.default_rng([0, 5, task]),
        )

    for update in updates:
        got = np.asarray(update["weights"])
        assert not np.allclose(got, sent[update["task"]])
        np.testing.assert_allclose(got, numpy_update(update["task"], MU), atol=1e-5)  # float32
        without_prox = numpy_update(update["task"], 0.0)
        assert np.abs(got - without_prox).max() > 1e-4  # mu reached the stages


def test_a_killed_client_times_out_and_drops_out(run: Run) -> None:
    later_updates = [
        e
        for e in run.server.seen
        if e.get("event") == "update" and e["client"] == 2 and e["task"] > run.failed["task"]
    ]
    assert later_updates == []
    stats = run.summary["stats"]
    assert stats["failed_tasks"] >= 1
    assert stats["clients_dropped"] >= 1  # the timeout is a latency out of every range


def test_junk_is_dropped_with_a_typed_answer_and_the_server_serves_on(run: Run) -> None:
    assert run.junk_answer["kind"] == "fl_error"
    assert "label_counts" in run.junk_answer["reason"]
    assert run.summary["dropped_messages"] >= 4
    log = run.server.stderr_tail()
    for reason in ("not valid msgpack", "no_such_kind", "fl_update", "label_counts"):
        assert reason in log


def test_an_unlisted_key_is_refused(run: Run) -> None:
    assert run.mallory.finish() == 1
    assert "fl_welcome" in run.mallory.stderr_tail()
    assert 4 not in run.summary["clients"]
    log = run.server.stderr_tail()
    assert "peer_refused" in log and key_prefix(run.mallory_key) in log


def test_the_shell_made_exactly_the_pure_servers_decisions(run: Run) -> None:
    events = read_trace(run.trace)
    replayed = replay(events)
    recorded = [(e["task"], e["client"], e["version"]) for e in events if e["event"] == "dispatch"]
    assert replayed.dispatches == recorded
    assert any(e["event"] == "failed" for e in events)  # the drop-out was replayed too
    assert replayed.version == run.summary["global_updates"]
    end = events[-1]
    assert end["event"] == "end" and np.array_equal(replayed.weights, np.asarray(end["weights"]))
    dataset = load_digits_dataset()
    shape = MLPShape(dataset.n_features, 32, dataset.n_classes)
    acc = accuracy(replayed.weights, shape, dataset.x_test, dataset.y_test)
    assert round(acc, 4) == run.summary["final_acc"]


def test_weights_from_the_wire_are_checked() -> None:
    good = torch.arange(6, dtype=torch.float64)
    assert np.array_equal(weights_from((good,), 6, what="t"), np.arange(6.0))
    bad = [
        (),
        (good, good),
        (good.float(),),
        (good.reshape(2, 3),),
        (torch.arange(5, dtype=torch.float64),),
        (torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, float("nan")], dtype=torch.float64),),
    ]
    for tensors in bad:
        with pytest.raises(ProtocolError):
            weights_from(tensors, 6, what="t")
    assert shape_from([64, 32, 10]) == MLPShape(64, 32, 10)
    for values in ([64, 32], [64, 0, 10], [64, True, 10], [64, 10**9, 10], [64, 3.0, 10]):
        with pytest.raises(ProtocolError):
            shape_from(values)


def test_a_server_config_survives_the_trace() -> None:
    config = ServerConfig(
        method="astraea",
        max_concurrent=7,
        alpha=0.3,
        staleness="hinge",
        grouping=GroupingPolicy(n_groups=3, lam=math.inf, rt_factor=2.0, rt_floor_fraction=0.5),
        seed=4,
    )
    text = json.dumps(config_to_json(config))
    assert config_from_json(json.loads(text)) == config
