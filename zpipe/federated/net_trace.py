"""What fl-server fed its server object, and a replay of it (pure).

fl-server drives the same sans-IO server as fl-sim (:mod:`zpipe.federated.server`),
with real messages in real time. Its ``--trace`` file records every input the
server object got, in order, as JSON lines::

    {"event": "config", "server": {...}, "initial_weights": [...]}
    {"event": "profiles", "profiles": [[client, latency_s, [label counts]], ...]}
    {"event": "dispatch", "task": 0, "client": 3, "version": 0}   (an output)
    {"event": "update", "task": 0, "client": 3, "n_samples": 40, "weights": [...]}
    {"event": "failed", "task": 5}
    {"event": "latency", "client": 3, "latency_s": 0.21}          (a task's or a probe's)
    {"event": "join", "client": 7, "latency_s": 0.3, "label_counts": [...]}  (a late client)
    {"event": "end", "version": 12, "weights": [...]}

:func:`replay` feeds the inputs to a fresh server object and returns what it
decided, so a test (or an auditor) can check that the networked shell decided
nothing itself. JSON floats round-trip exactly, so the replayed weights must be
equal, not close.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from zpipe._errors import ConfigError
from zpipe.federated.grouping import ClientProfile, GroupingPolicy
from zpipe.federated.server import ClientUpdate, ServerConfig, TrainTask, make_server

FloatArray = npt.NDArray[np.float64]


def config_to_json(config: ServerConfig) -> dict[str, Any]:
    out = asdict(config)
    out["grouping"]["lam"] = _float_out(config.grouping.lam)
    return out


def config_from_json(data: Mapping[str, Any]) -> ServerConfig:
    fields = dict(data)
    grouping = dict(fields.pop("grouping"))
    grouping["lam"] = float(grouping["lam"])
    return ServerConfig(**fields, grouping=GroupingPolicy(**grouping))


def _float_out(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


@dataclass(frozen=True)
class Replay:
    dispatches: list[tuple[int, int, int]]  # (task, client, version), in order
    weights: FloatArray
    version: int
    task_weights: dict[int, FloatArray]  # what each task sent its client to train


def dispatch_events(tasks: Iterable[TrainTask]) -> list[dict[str, Any]]:
    return [
        {"event": "dispatch", "task": t.task_id, "client": t.client_id, "version": t.version}
        for t in tasks
    ]


def read_trace(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def replay(events: Iterable[Mapping[str, Any]]) -> Replay:
    """Run a fresh server object on a trace's inputs; what it dispatched and its model."""
    server = None
    config: ServerConfig | None = None
    initial: FloatArray | None = None
    dispatched: list[TrainTask] = []
    for event in events:
        kind = event["event"]
        if kind == "config":
            config = config_from_json(event["server"])
            initial = np.asarray(event["initial_weights"], dtype=np.float64)
        elif kind == "profiles":
            if config is None or initial is None:
                raise ConfigError("a trace names its config before its profiles")
            profiles = [
                ClientProfile(int(c), float(lat), tuple(n)) for c, lat, n in event["profiles"]
            ]
            server = make_server(profiles, initial, config)
            dispatched += server.start()
        elif server is None:
            continue  # nothing but config and profiles come before the server
        elif kind == "update":
            update = ClientUpdate(
                int(event["task"]),
                int(event["client"]),
                np.asarray(event["weights"], dtype=np.float64),
                int(event["n_samples"]),
            )
            dispatched += server.on_update(update)
        elif kind == "failed":
            dispatched += server.on_task_failed(int(event["task"]))
        elif kind == "silent":
            dispatched += server.observe_silence(int(event["client"]), float(event["waited_s"]))
        elif kind == "latency":
            dispatched += server.observe_latency(int(event["client"]), float(event["latency_s"]))
        elif kind == "join":
            profile = ClientProfile(
                int(event["client"]), float(event["latency_s"]), tuple(event["label_counts"])
            )
            dispatched += server.add_client(profile)
    if server is None:
        raise ConfigError("the trace holds no profiles: the run never started")
    return Replay(
        [(t.task_id, t.client_id, t.version) for t in dispatched],
        server.global_weights,
        server.version,
        {t.task_id: t.weights for t in dispatched},
    )
