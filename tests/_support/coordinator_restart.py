"""Helpers shared by tests (moved from test_coordinator_restart.py)."""

from __future__ import annotations

from pathlib import Path

from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.log import read_events

# generous floors: a live stage starved of CPU must not be declared dead
INTERVAL = 0.5


def _cluster(names: list[str], state_dir: Path | None) -> LocalCluster:
    return LocalCluster(
        [DeviceSpec(name) for name in names],
        heartbeat_interval_s=INTERVAL,
        suspect_after=6,
        probe_intervals=4,
        state_dir=state_dir,
    )


def _events(log: str, event: str) -> list[dict[str, object]]:
    return read_events(log, event)
