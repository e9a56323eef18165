"""The fl-server's tests: a raw client socket's send and receive of typed messages, and
the controller's configuration and fake clients' messages the unit tests feed it (no
fl-client)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import zmq

from zpipe.federated.model import MLPShape
from zpipe.federated.net_commands import Command, NetServerConfig
from zpipe.federated.server import ServerConfig
from zpipe.protocol import REGISTRY, WireMessage
from zpipe.protocol.federated import FlRegister, FlUpdate
from zpipe.transport.codec import decode, encode

SHAPE = MLPShape(4, 3, 2)


def send_fl(sock: zmq.Socket[bytes], message: WireMessage) -> None:
    sock.send_multipart(encode(message.to_message()), copy=False)


def receive_fl(sock: zmq.Socket[bytes], timeout_s: float) -> WireMessage | None:
    """The next message, parsed; None after ``timeout_s`` without one."""
    if not sock.poll(int(timeout_s * 1000)):
        return None
    return REGISTRY.parse(decode(sock.recv_multipart(copy=False)))


def controller_config(**changes: object) -> NetServerConfig:
    """A FedAsync server of one client, no probes, deadlines that only a test's own
    clock reaches; ``changes`` replace fields."""
    base = NetServerConfig(
        server=ServerConfig(method="fedasync", max_concurrent=2, seed=3),
        clients=1,
        task_timeout_s=10.0,
        task_floor_s=1.0,
        probe_interval_s=0.0,
        max_updates=10_000,
        duration_s=10_000.0,
        eval_every=1_000,
        ids_per_address=4,
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def route(client: int, connection: int = 0) -> bytes:
    """The routing id of fake client ``client``'s ``connection``-th connection."""
    return f"peer-{client}-{connection}".encode()


def register(client: int) -> FlRegister:
    return FlRegister(client=client, label_counts=[5, 5], latency_s=0.1)


def update(task: int, client: int) -> FlUpdate:
    """An answer to ``task`` of weights all 0.5."""
    weights = torch.full((SHAPE.size,), 0.5, dtype=torch.float64)
    return FlUpdate(task=task, client=client, n_samples=10, train_s=0.1, tensors=(weights,))


def of(kind: type, commands: list[Command]) -> list[Any]:
    """The commands of class ``kind``."""
    return [c for c in commands if isinstance(c, kind)]
