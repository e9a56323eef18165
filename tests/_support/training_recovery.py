"""Helpers shared by tests (moved from test_training_recovery.py)."""

from __future__ import annotations

import torch

from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.log import read_events

# Detection floors of several seconds: a live stage starved of CPU (a loaded CI
# machine, --cpu-burners) may miss a second of heartbeats and must not die of it.
INTERVAL = 0.5
SUSPECT_AFTER = 6
PROBE_INTERVALS = 4


def _cluster(names: list[str]) -> LocalCluster:
    return LocalCluster(
        [DeviceSpec(name) for name in names],
        heartbeat_interval_s=INTERVAL,
        suspect_after=SUSPECT_AFTER,
        probe_intervals=PROBE_INTERVALS,
    )


def _learnable_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Four mini-batches of a learnable task (labels from a fixed projection), four epochs."""
    generator = torch.Generator().manual_seed(41)
    projection = torch.randn(12, 4, generator=generator)
    epoch = []
    for _ in range(4):
        x = torch.randn(18, 12, generator=generator)
        epoch.append((x, (x @ projection).argmax(1)))
    return epoch * 4


def _events(log: str, event: str) -> list[dict[str, object]]:
    return read_events(log, event)
