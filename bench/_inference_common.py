"""Shared pieces of ``bench/inference.py``: its constants, the emulated devices, the
seeded batches, output comparison and the CPU meter (split out of that script to
keep it small; behaviour unchanged).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import torch

from zpipe.cluster import DeviceSpec
from zpipe.models import ModelSpec, load_layer_sequence

BENCH = "inference"
DRIVER_KEY = "client/driver"  # this process: zpipe's client, or the rpc driver
VIT_PRESETS = ("vit-tiny", "vit-base", "vit-large")
Outputs = tuple[torch.Tensor, ...]

# The heterogeneous section's cluster: one device 4x slower than the fastest (the
# demo's first three devices, named apart so that this benchmark stays put when the
# demo changes). Links are fast enough that compute sets the pipeline's pace (a
# ViT-Base activation of a micro-batch of 2 is 1.2 MB: 12 ms at 800 Mbit/s, 48 ms at
# 200), unless a plan cuts after an MLP's first layer (4x that), which the planner
# sees and avoids.
HETERO_DEVICES = (
    DeviceSpec("fast", slowdown=1.0, bandwidth_mbps=800.0, latency_ms=2.0),
    DeviceSpec("slow", slowdown=4.0, bandwidth_mbps=400.0, latency_ms=5.0),
    DeviceSpec("mid", slowdown=1.5, bandwidth_mbps=200.0, latency_ms=5.0),
)
# Emulated devices share this machine's cores. A device with slowdown s computes for
# 1/s of its busy time (it sleeps the rest), so a pipeline whose stages are all busy
# needs sum(threads / s) cores. Past about half the cores, stages wait for a core,
# and a stage's emulated slowdown stretches that wait s times over (it sleeps s - 1
# times its measured compute): the devices stop being independent, which neither a
# real cluster nor the planner's cost model has. By default every slowdown is scaled
# up (the same factor for all, so their ratios stay) until the devices need at most
# this share of the cores.
HOST_CORE_SHARE = 0.5
HETERO_PLANNERS = ("pipeedge", "even")


def _devices(
    args: argparse.Namespace, threads: int | None, specs: tuple[DeviceSpec, ...], scale: float = 1.0
) -> list[DeviceSpec]:
    devices = []
    for d in specs:
        link: dict[str, Any] = {"bandwidth_mbps": d.bandwidth_mbps, "latency_ms": d.latency_ms}
        if args.no_links:
            link = {"bandwidth_mbps": None, "latency_ms": 0.0}
        devices.append(DeviceSpec(d.name, slowdown=d.slowdown * scale, threads=threads, **link))
    return devices


def _cpu_demand(devices: list[DeviceSpec], threads: int) -> float:
    """Cores the emulated devices use when every one of them is busy all the time."""
    return sum((d.threads or threads) / max(d.slowdown, 1.0) for d in devices)


def _auto_slowdown_scale(specs: tuple[DeviceSpec, ...], threads: int, cores: int) -> float:
    """The least multiple of 0.25 (at least 1) that keeps ``specs`` within their cores' share."""
    demand = _cpu_demand(list(specs), threads)
    return max(1.0, math.ceil(4.0 * demand / (HOST_CORE_SHARE * cores)) / 4.0)


def _device_config(devices: list[DeviceSpec]) -> list[dict[str, Any]]:
    return [
        {
            "name": d.name,
            "slowdown": d.slowdown,
            "bandwidth_mbps": d.bandwidth_mbps,
            "latency_ms": d.latency_ms,
        }
        for d in devices
    ]


def _make_batches(args: argparse.Namespace, spec: ModelSpec) -> tuple[list[Outputs], list[Outputs]]:
    """The warm-up batches and the timed batches, seeded (the same in both sections)."""
    sequence = load_layer_sequence(spec)
    generator = torch.Generator().manual_seed(args.seed)

    def make(count: int) -> list[Outputs]:
        return [
            sequence.example_input(
                args.batch_size, seed=int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
            )
            for _ in range(count)
        ]

    return make(args.warmup_batches), make(args.batches)


def _median_index(values: list[float]) -> int:
    order = sorted(range(len(values)), key=values.__getitem__)
    return order[(len(order) - 1) // 2]


def _max_abs_diff(a: Outputs, b: Outputs) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))


def _close(a: Outputs, b: Outputs, tol: float) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and torch.allclose(x.float(), y.float(), atol=tol, rtol=tol)
        for x, y in zip(a, b, strict=True)
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def _round(x: float | None, digits: int = 4) -> float | None:
    return round(x, digits) if x is not None else None


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc); 0.0 if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds that this process and the given processes spend between start and stop."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._start: dict[str, float] = {}
        self.cpu_s: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        now = {name: _proc_cpu_s(pid) for name, pid in self.pids.items()}
        now[DRIVER_KEY] = time.process_time()
        return now

    def start(self) -> None:
        self._start = self._now()

    def stop(self) -> None:
        now = self._now()
        self.cpu_s = {name: round(now[name] - self._start[name], 3) for name in now}
        self.cpu_s["total"] = round(sum(self.cpu_s.values()), 3)


async def _metered(batches: list[Outputs], meter: CpuMeter) -> AsyncIterator[Outputs]:
    """The batches, starting ``meter`` when the client starts streaming (after set-up)."""
    meter.start()
    for batch in batches:
        yield batch
