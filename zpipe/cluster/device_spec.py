"""One emulated device of a local cluster, and the stage flags that make it so."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from zpipe._errors import ConfigError
from zpipe.devices import check_device_text


@dataclass(frozen=True)
class DeviceSpec:
    """One device: its name, how much slower it computes, its outgoing link, where it
    computes (``device``)."""

    name: str
    slowdown: float = 1.0
    bandwidth_mbps: float | None = None
    latency_ms: float = 0.0
    loss: float = 0.0
    threads: int | None = None
    memory_mb: float | None = None
    # emulated bandwidth of the link to the coordinator (control and bulk state)
    uplink_mbps: float | None = None
    # rows of one data message the stage's data port accepts (--max-batch-rows)
    max_batch_rows: int | None = None
    # where the stage computes (--device: auto, cpu, cuda[:N], mps); None: the stage's
    # default (auto)
    device: str | None = None
    # a slowdown that changes over time ("0:1,60:10", --slowdown-schedule)
    slowdown_schedule: str | None = None

    def __post_init__(self) -> None:
        if self.device is not None:
            check_device_text(self.device)  # a typo is refused before any process starts

    def stage_flags(self) -> list[str]:
        flags = ["--name", self.name, "--slowdown", str(self.slowdown)]
        if self.bandwidth_mbps is not None:
            flags += ["--bandwidth-mbps", str(self.bandwidth_mbps)]
        if self.latency_ms:
            flags += ["--latency-ms", str(self.latency_ms)]
        if self.loss:
            flags += ["--loss", str(self.loss)]
        if self.threads is not None:
            flags += ["--threads", str(self.threads)]
        if self.memory_mb is not None:
            flags += ["--memory-mb", str(self.memory_mb)]
        if self.uplink_mbps is not None:
            flags += ["--uplink-mbps", str(self.uplink_mbps)]
        if self.max_batch_rows is not None:
            flags += ["--max-batch-rows", str(self.max_batch_rows)]
        if self.device is not None:
            flags += ["--device", self.device]
        if self.slowdown_schedule is not None:
            flags += ["--slowdown-schedule", self.slowdown_schedule]
        return flags


def device_spec_of(device: object) -> DeviceSpec:
    """A device as given: a DeviceSpec, or a name for a plain device."""
    if isinstance(device, DeviceSpec):
        return device
    if isinstance(device, str):
        return DeviceSpec(device)
    raise ConfigError(f"a device is a DeviceSpec or a name, got {type(device).__name__} {device!r}")


def local_devices(
    devices: Sequence[DeviceSpec | str] | int, cores: int
) -> tuple[list[DeviceSpec], int]:
    """A local cluster's devices as given (how many plain ones, or each as a spec or a
    name; names unique), and the cores each stage gets: stages that share a machine
    must not fight over its cores, so a device without its own ``threads`` gets that
    share."""
    if isinstance(devices, int):
        if devices < 1:
            raise ConfigError(f"a cluster needs at least one device, got {devices}")
        specs = [DeviceSpec(f"stage{i}") for i in range(devices)]
    else:
        specs = [device_spec_of(d) for d in devices]
    names = [d.name for d in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"device names must be unique, got {names}")
    per_stage = max(1, cores // max(1, len(specs)))
    return [d if d.threads is not None else replace(d, threads=per_stage) for d in specs], per_stage
