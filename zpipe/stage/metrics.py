"""Per-stage counters: where a stage's time went and what crossed its links."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field


@dataclass
class StageCounters:
    """The compute loop is always in one of three states, so for a stage that has
    started streaming ``busy_s + idle_s + blocked_s`` is its wall time since the
    first input; sending runs concurrently and is counted apart in ``send_s``.
    """

    busy_s: float = 0.0  # computing micro-batches
    idle_s: float = 0.0  # waiting for input (counted from the first input on)
    blocked_s: float = 0.0  # waiting for room to hand an output to the sender
    send_s: float = 0.0  # the sender waiting on the link or the downstream queue
    bytes_in: int = 0
    bytes_out: int = 0
    microbatches: int = 0
    errors: int = 0  # micro-batches whose compute raised
    dropped: int = 0  # messages that failed validation
    stale: int = 0  # messages of an older plan epoch
    lost: int = 0  # messages the emulated link lost
    # training: most forwards awaiting their backward at once, and the bytes they held
    peak_live_activations: int = 0
    peak_activation_bytes: int = 0
    allreduce_s: float = 0.0  # summing gradients with the rest of the stage's group
    # training: where busy time went (busy_s is all three plus inference forwards)
    forward_s: float = 0.0
    backward_s: float = 0.0
    step_s: float = 0.0
    backwards: int = 0  # micro-batches whose backward ran here (forwards: microbatches)
    started_at: float = field(default_factory=time.monotonic)

    @property
    def utilisation(self) -> float:
        total = self.busy_s + self.idle_s + self.blocked_s
        return self.busy_s / total if total > 0 else 0.0

    def to_dict(self) -> dict[str, float | int]:
        data = asdict(self)
        data["uptime_s"] = time.monotonic() - data.pop("started_at")
        data["utilisation"] = self.utilisation
        return data

    def reset(self) -> None:
        fresh = StageCounters()
        for name, value in asdict(fresh).items():
            setattr(self, name, value)
