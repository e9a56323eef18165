"""bench/federated.py's networked section: real processes against fl-sim's prediction.

One configuration, run twice per method:

- over the network: ``fl-server`` and one ``fl-client`` process per client on
  loopback, each client's latency emulated with ``--delay`` (plus its real
  compute and messaging), until ``--updates`` global updates;
- predicted: the same clients (the same shards, ``fl-client``'s own
  :func:`client_shard`), latencies equal to the delays, the same server
  configuration, initial weights and task seeds, in fl-sim's simulated time
  (:func:`zpipe.federated.simulate.run_federation`) until as many updates.

Reported per method: accuracy after the updates (network, predicted, their
difference) and time to them (the server's wall time from its first task,
the simulated time, and their ratio: what real processes and messages add to
the emulated latencies). The two differ also where timing reorders the
updates, and where measured latencies regroup clients (the prediction's
latencies never change).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from zpipe.federated.net_client import NetClientConfig, client_shard
from zpipe.federated.simulate import Federation, SimConfig, run_federation
from zpipe.lossy.data import Dataset

DELAYS_S = (0.2, 0.25, 0.3, 0.6, 0.7, 0.8)


@dataclass(frozen=True)
class NetBenchConfig:
    method: str = "ecofl"
    delays_s: tuple[float, ...] = DELAYS_S
    updates: int = 60
    groups: int = 2
    concurrent: int = 6
    samples: int = 40
    rt_floor: float = 0.5  # measured latencies are noisy: a wider range than fl-sim's 0.1
    seed: int = 0
    timeout_s: float = 300.0


def _listening_endpoint(server: subprocess.Popen[str], timeout_s: float) -> str:
    """Where fl-server listens, from its first line (it binds port 0: a port picked
    here could be taken by another socket before the server bound it)."""
    assert server.stdout is not None
    ready, _, _ = select.select([server.stdout], [], [], timeout_s)
    line = server.stdout.readline() if ready else ""  # one line, written whole
    event = json.loads(line) if line.startswith("{") else {}
    if event.get("event") != "listening":
        raise RuntimeError(f"fl-server did not say where it listens: {line[:200]!r}")
    return str(event["endpoint"])


def network_run(config: NetBenchConfig) -> dict[str, Any]:
    """fl-server and its clients as processes; the server's fl_server_done object."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    zpipe = [sys.executable, "-m", "zpipe"]
    server_args = [
        *("fl-server", "--bind", "tcp://127.0.0.1:0", "--clients", str(len(config.delays_s))),
        *("--method", config.method, "--groups", str(config.groups)),
        *("--concurrent", str(config.concurrent), "--updates", str(config.updates)),
        *("--eval-every", str(config.updates), "--rt-floor", str(config.rt_floor)),
        *("--seed", str(config.seed), "--task-timeout", "10", "--probe-interval", "1"),
        *("--register-timeout", "120", "--duration", str(config.timeout_s)),
    ]
    with tempfile.TemporaryDirectory(prefix="zpipe-flbench-") as tmp:
        server_log = open(Path(tmp) / "server.log", "w")
        server = subprocess.Popen(
            [*zpipe, *server_args], stdout=subprocess.PIPE, stderr=server_log, text=True, env=env
        )
        clients: list[subprocess.Popen[Any]] = []
        try:
            endpoint = _listening_endpoint(server, timeout_s=120)
            clients = [
                subprocess.Popen(
                    [
                        *zpipe,
                        *("fl-client", "--server", endpoint, "--id", str(c)),
                        *("--samples", str(config.samples), "--seed", str(config.seed)),
                        *("--delay", str(delay), "--connect-timeout", "120"),
                        *("--idle-timeout", "120"),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    env=env,
                )
                for c, delay in enumerate(config.delays_s)
            ]
            out, _ = server.communicate(timeout=config.timeout_s + 60)
        finally:
            processes: list[subprocess.Popen[Any]] = [server, *clients]
            for process in processes:
                if process.poll() is None:
                    process.kill()
                process.wait(timeout=30)
            server_log.close()
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        done = [e for e in lines if e.get("event") == "fl_server_done"]
        if not done:
            log = (Path(tmp) / "server.log").read_text()[-2000:]
            raise RuntimeError(f"fl-server ended without a summary: {log}")
        return dict(done[0])


def predicted_run(config: NetBenchConfig, dataset: Dataset) -> dict[str, Any]:
    """fl-sim's run of the same clients and server configuration, in simulated time."""
    n = len(config.delays_s)
    shards = [
        client_shard(
            NetClientConfig(
                server="tcp://127.0.0.1:1", client=c, samples=config.samples, seed=config.seed
            ),
            dataset,
        )
        for c in range(n)
    ]
    federation = Federation(
        shards,
        np.asarray(config.delays_s, dtype=np.float64),
        np.ones(n),
        dataset.n_classes,
        np.random.default_rng(0),
    )
    sim = SimConfig(
        method=config.method,
        n_clients=n,
        n_groups=config.groups,
        max_concurrent=config.concurrent,
        rt_floor_fraction=config.rt_floor,
        samples_per_client=config.samples,
        change_every_s=1e5,
        change_prob=0.0,
        jitter=0.0,
        budget_s=1e5,
        eval_every_s=1e5,
        seed=config.seed,
    )
    return run_federation(sim, federation, dataset, max_updates=config.updates)


def compare(methods: Sequence[str], dataset: Dataset, **settings: Any) -> list[dict[str, Any]]:
    """One row per method: network against prediction."""
    rows = []
    for method in methods:
        config = NetBenchConfig(method=method, **settings)
        net = network_run(config)
        predicted = predicted_run(config, dataset)
        if "updates_reached_s" not in predicted:
            raise RuntimeError(f"{method}: the prediction never reached {config.updates} updates")
        rows.append(
            {
                "bench": "federated_net",
                "method": method,
                "clients": len(config.delays_s),
                "updates": net["global_updates"],
                "net_acc": net["final_acc"],
                "predicted_acc": round(float(predicted["acc_at_updates"]), 4),
                "net_wall_s": net["wall_s"],
                "predicted_s": round(float(predicted["updates_reached_s"]), 3),
                "net_failed_tasks": net["stats"]["failed_tasks"],
                "net_clients_moved": net["stats"].get("clients_moved", 0),
                "net_clients_dropped": net["stats"].get("clients_dropped", 0),
                "net_probes": net["probes"],
            }
        )
    return rows
