"""What a stage process is told on its command line."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from zpipe._errors import ConfigError
from zpipe.config import Timeouts
from zpipe.transport.emulation import LinkSpec
from zpipe.transport.sockets import SocketOptions


@dataclass(frozen=True)
class StageConfig:
    name: str
    coordinator: str
    data_bind: str = "tcp://0.0.0.0:0"
    # Where link probes are answered; None: the data socket's host, any free port.
    probe_bind: str | None = None
    advertise_host: str | None = None
    threads: int | None = None
    slowdown: float = 1.0
    link: LinkSpec = field(default_factory=LinkSpec)
    # the emulated uplink to the coordinator (control and bulk state share it)
    uplink: LinkSpec = field(default_factory=LinkSpec)
    memory_mb: float | None = None
    keys_dir: Path | None = None
    timeouts: Timeouts = field(default_factory=Timeouts)
    socket_options: SocketOptions = field(default_factory=SocketOptions)

    def __post_init__(self) -> None:
        if not self.slowdown >= 1.0:
            raise ConfigError(
                f"--slowdown must be >= 1 (a factor on compute time), got {self.slowdown}"
            )
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")

    @property
    def probe_endpoint_to_bind(self) -> str:
        if self.probe_bind is not None:
            return self.probe_bind
        # The data socket's host with any free port: reachable wherever data is.
        return self.data_bind.rsplit(":", 1)[0] + ":0"
