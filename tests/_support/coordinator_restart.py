"""Helpers shared by tests (moved from test_coordinator_restart.py)."""

from __future__ import annotations

import json
from pathlib import Path

from zpipe.cluster import DeviceSpec, LocalCluster

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
    found = []
    for line in log.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == event:
            found.append(record)
    return found
