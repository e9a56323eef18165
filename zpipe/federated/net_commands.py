"""What fl-server's controller is configured with, and the commands it returns.

:class:`NetServerConfig` is the networked server's configuration (the
``fl-server`` flags). The controller
(:class:`zpipe.federated.net_controller.FlServerController`) never touches a
socket, a clock or a file; it returns these commands, which the shell
(:class:`zpipe.federated.net_server.FederatedShell`) carries out in order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from zpipe._errors import ConfigError, ZpipeError
from zpipe.federated.net_wire import SERVER_KEY_NAME
from zpipe.federated.server import ServerConfig
from zpipe.protocol import WireMessage

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class NetServerConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    bind: str = "tcp://127.0.0.1:0"
    clients: int = 3  # registrations awaited before the run starts
    hidden: int = 32
    local_steps: int = 10
    batch_size: int = 10
    lr: float = 0.1
    mu: float = 0.05
    seed: int = 0
    register_timeout_s: float = 60.0
    task_timeout_s: float = 30.0
    # a task's deadline never comes sooner than this, whatever its client's history
    task_floor_s: float = 5.0
    # without --keys: live client ids one peer address may hold (a key holds one id)
    ids_per_address: int = 16
    # a set-aside client silent this long (no answer to a task or a probe) is released
    # as if its connection had closed: its address may register another id
    release_after_s: float = 120.0
    probe_interval_s: float = 5.0  # 0: never probe dropped clients
    probe_timeout_s: float = 30.0
    send_timeout_s: float = 5.0
    max_updates: int = 50
    duration_s: float = 600.0
    eval_every: int = 5  # global updates between evaluations
    keys_dir: Path | None = None
    key_name: str = SERVER_KEY_NAME
    trace: Path | None = None

    def __post_init__(self) -> None:
        if self.clients < 1 or self.max_updates < 1 or self.eval_every < 1:
            raise ConfigError("--clients, --updates and --eval-every must be at least 1")
        if self.ids_per_address < 1:
            raise ConfigError("--ids-per-address must be at least 1")
        timeouts = (
            self.register_timeout_s,
            self.task_timeout_s,
            self.task_floor_s,
            self.send_timeout_s,
            self.probe_timeout_s,
            self.release_after_s,
            self.duration_s,
        )
        if not all(t > 0 and math.isfinite(t) for t in timeouts):
            raise ConfigError("timeouts and the duration must be finite and > 0")
        if not (self.probe_interval_s >= 0 and math.isfinite(self.probe_interval_s)):
            raise ConfigError("--probe-interval must be finite and >= 0")
        grouped = self.server.method not in ("fedavg", "fedasync")
        if grouped and self.server.max_concurrent < self.server.grouping.n_groups:
            raise ConfigError(
                f"--concurrent {self.server.max_concurrent} cannot serve "
                f"--groups {self.server.grouping.n_groups}: every group needs a client in flight"
            )


# ------------------------------------------------------------------- commands


@dataclass(frozen=True)
class SendMessage:
    """Send ``message`` to the peer at ``to``; ``task``: the task it carries, whose
    latency and deadline count from the moment it is sent."""

    to: bytes
    message: WireMessage
    peer: str
    task: int | None = None


@dataclass(frozen=True)
class Emit:
    """A line of the run's output (what happened, for people and benches)."""

    event: Mapping[str, Any]


@dataclass(frozen=True)
class TraceLine:
    """A line of the ``--trace`` file (an input of the server object, or its output)."""

    event: Mapping[str, Any]


@dataclass(frozen=True)
class LogLine:
    level: str
    event: str
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Evaluate:
    """Measure the global model of ``version`` on the test set, and emit it."""

    version: int
    weights: FloatArray


@dataclass(frozen=True)
class Abort:
    """The run cannot go on: the shell raises ``error`` (after the commands before it)."""

    error: ZpipeError


Command = SendMessage | Emit | TraceLine | LogLine | Evaluate | Abort


def client_peer(client_id: int) -> str:
    """How a client is named in a :class:`SendMessage` (its logs and send errors)."""
    return f"fl client {client_id}"
