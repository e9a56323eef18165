"""What a stage process is told on its command line."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from zpipe._errors import ConfigError
from zpipe.config import Timeouts
from zpipe.devices import check_device_text, resolve_device
from zpipe.planner.profile import ModelProfile
from zpipe.transport.emulation import LinkSpec
from zpipe.transport.slowdown import Slowdown, SlowdownClock, SlowdownSchedule
from zpipe.transport.sockets import SocketOptions

# Rows of one data message a stage accepts by default (--max-batch-rows): a micro-batch
# of this many samples of the model's largest boundary tensor fits in one frame.
DEFAULT_MAX_BATCH_ROWS = 4096


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
    # a slowdown that changes over time (--slowdown-schedule), instead of ``slowdown``
    slowdown_schedule: SlowdownSchedule | None = None
    link: LinkSpec = field(default_factory=LinkSpec)
    # the emulated uplink to the coordinator (control and bulk state share it)
    uplink: LinkSpec = field(default_factory=LinkSpec)
    # the memory budget the operator declared (--memory-mb); the stage reports the
    # smaller of it and the free memory it measures on its device
    memory_mb: float | None = None
    # where the shard computes (--device): auto, cpu, cuda[:N], mps
    device: str = "auto"
    # rows of one data message the data port accepts (see zpipe.stage.ports.data_port_limits)
    max_batch_rows: int = DEFAULT_MAX_BATCH_ROWS
    keys_dir: Path | None = None
    timeouts: Timeouts = field(default_factory=Timeouts)
    socket_options: SocketOptions = field(default_factory=SocketOptions)
    # --emulate-compute: sleep for this profile's times instead of computing
    # (zpipe.stage.emulated_compute)
    emulate_compute: ModelProfile | None = None

    def __post_init__(self) -> None:
        if not self.slowdown >= 1.0:
            raise ConfigError(
                f"--slowdown must be >= 1 (a factor on compute time), got {self.slowdown}"
            )
        if self.slowdown_schedule is not None and self.slowdown != 1.0:
            raise ConfigError("give --slowdown or --slowdown-schedule, not both")
        if self.max_batch_rows < 1:
            raise ConfigError(f"--max-batch-rows must be >= 1, got {self.max_batch_rows}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")
        check_device_text(self.device)

    @cached_property
    def resolved_device(self) -> torch.device:
        """The torch device ``device`` names here (``auto``: CUDA, else MPS, else CPU)."""
        return resolve_device(self.device)

    def emulated_slowdown(self) -> Slowdown:
        """What the stage's shards stretch compute by: the fixed factor, or a new clock
        of the schedule (its seconds count from the first compute step)."""
        if self.slowdown_schedule is not None:
            return SlowdownClock(self.slowdown_schedule)
        return self.slowdown

    @property
    def probe_endpoint_to_bind(self) -> str:
        if self.probe_bind is not None:
            return self.probe_bind
        # The data socket's host with any free port: reachable wherever data is.
        return self.data_bind.rsplit(":", 1)[0] + ":0"
