"""The fl-server's tests: a raw client socket's send and receive of typed messages, and
the controller's configuration the unit tests vary (fake clients, no fl-client)."""

from __future__ import annotations

from dataclasses import replace

import zmq

from zpipe.federated.model import MLPShape
from zpipe.federated.net_commands import NetServerConfig
from zpipe.federated.server import ServerConfig
from zpipe.protocol import REGISTRY, WireMessage
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
