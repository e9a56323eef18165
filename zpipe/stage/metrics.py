"""Per-stage counters: where a stage's time went and what crossed its links."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field


@dataclass
class StageCounters:
    busy_s: float = 0.0  # computing micro-batches
    idle_s: float = 0.0  # waiting for input while nothing was queued
    send_blocked_s: float = 0.0  # waiting for the downstream link or queue
    bytes_in: int = 0
    bytes_out: int = 0
    microbatches: int = 0
    errors: int = 0  # micro-batches whose compute raised
    dropped: int = 0  # messages that failed validation
    stale: int = 0  # messages of an older plan epoch
    lost: int = 0  # messages the emulated link lost
    started_at: float = field(default_factory=time.monotonic)

    def to_dict(self) -> dict[str, float | int]:
        data = asdict(self)
        data["uptime_s"] = time.monotonic() - data.pop("started_at")
        return data

    def reset(self) -> None:
        fresh = StageCounters()
        for name, value in asdict(fresh).items():
            setattr(self, name, value)
