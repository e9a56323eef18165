"""Capacities from measured times (FTPipeHD), and when a change warrants migration (Eco-FL).

FTPipeHD (section III-D, eqs. 1-3): worker ``i`` reports its average
execution time per batch ``T_e^i`` over its units ``[start_i, end_i)``;
with ``T_{e,j}^0`` each unit's time on the reference device (the central
node, whose capacity is 1.0),

    C_i = T_e^i / sum_{j=start_i}^{end_i - 1} T_{e,j}^0        (eqs. 1-2)
    T_{e,j}^i = T_{e,j}^0 * C_i                                   (eq. 3)

so ``C_i`` is a time ratio (2.0: twice as slow) and ``1 / C_i`` the speed
``v_d`` that lightweight re-planning weighs stages with. A device that runs
only part of each micro-batch (a member of a data-parallel group) did only
that fraction of the units' work; ``work_fraction`` says how much.

Eco-FL (section 4.4): when a device's current execution time deviates from
its history by more than a threshold, re-schedule and migrate work. The
comparison here is on capacities, not raw times: after a migration a stage's
time changes because its work did, and that must not look like a slowdown.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zpipe._errors import ConfigError
from zpipe.planner.cluster import ClusterSpec
from zpipe.planner.cost import device_unit_times
from zpipe.planner.profile import ModelProfile


def estimate_capacities(
    measured_s: Mapping[str, float],
    ranges: Mapping[str, tuple[int, int]],
    reference_unit_times: Sequence[float],
    *,
    work_fraction: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """FTPipeHD's eqs. 1-2: each measured device's ``C_i`` (time ratio to the reference)."""
    out: dict[str, float] = {}
    for device, t in measured_s.items():
        if device not in ranges:
            raise ConfigError(f"device {device!r} reported a time but runs no units")
        if not (math.isfinite(t) and t > 0):
            raise ConfigError(f"device {device!r}: execution time must be > 0 s, got {t!r}")
        start, end = ranges[device]
        if not 0 <= start < end <= len(reference_unit_times):
            raise ConfigError(
                f"device {device!r}: units [{start}, {end}) are outside the reference "
                f"profile's {len(reference_unit_times)} units"
            )
        fraction = 1.0 if work_fraction is None else float(work_fraction.get(device, 1.0))
        if not (math.isfinite(fraction) and 0 < fraction <= 1):
            raise ConfigError(f"device {device!r}: work fraction must be in (0, 1], got {fraction}")
        reference = math.fsum(reference_unit_times[start:end]) * fraction
        if reference <= 0:
            raise ConfigError(
                f"device {device!r}: its units [{start}, {end}) take no time on the reference "
                "device, so its capacity cannot be estimated from them"
            )
        out[device] = t / reference
    return out


def scaled_unit_times(reference_unit_times: Sequence[float], capacity: float) -> list[float]:
    """FTPipeHD's eq. 3: each unit's estimated time on a device of capacity ``C_i``."""
    if not (math.isfinite(capacity) and capacity > 0):
        raise ConfigError(f"a capacity must be a positive number, got {capacity!r}")
    return [t * capacity for t in reference_unit_times]


def speeds_from_capacities(capacities: Mapping[str, float]) -> dict[str, float]:
    """Relative speeds ``v_d = 1 / C_d``, as lightweight re-planning and cluster specs use them."""
    for d, c in capacities.items():
        if not (math.isfinite(c) and c > 0):
            raise ConfigError(f"device {d!r}: capacity must be a positive number, got {c!r}")
    return {d: 1.0 / c for d, c in capacities.items()}


def speeds_from_cluster(
    profile: ModelProfile, cluster: ClusterSpec, batch_size: int
) -> dict[str, float]:
    """Each device's speed relative to ``profile``, before any measurement of the run.

    A device with its own profile (as the coordinator plans stages) is as fast
    as the model profile's total time over its own; any other has its
    declared ``speed``. The starting point that re-estimated capacities replace.
    """
    total = math.fsum(profile.times(batch_size))
    out = {}
    for device in cluster.devices:
        own = math.fsum(device_unit_times(profile, device, batch_size))
        out[device.name] = device.speed if own <= 0 or total <= 0 else total / own
    return out


@dataclass(frozen=True)
class Deviation:
    """A device whose current capacity differs from its history's median beyond the threshold."""

    device: str
    current: float
    baseline: float

    @property
    def ratio(self) -> float:
        """Current over baseline: above 1 it slowed down, below 1 it sped up."""
        return self.current / self.baseline

    @property
    def slower(self) -> bool:
        return self.current > self.baseline


def find_deviations(
    current: Mapping[str, float],
    history: Mapping[str, Sequence[float]],
    *,
    threshold: float = 0.25,
    min_history: int = 3,
) -> list[Deviation]:
    """Eco-FL's check: devices whose ``|current / median(history) - 1| > threshold``.

    Both directions count: a device that recovers from a load spike can take work
    back. Devices with fewer than ``min_history`` past values are not judged yet.
    Largest deviation first.
    """
    if not (math.isfinite(threshold) and threshold > 0):
        raise ConfigError(f"the deviation threshold must be a positive number, got {threshold!r}")
    out = []
    for device, value in current.items():
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"device {device!r}: a capacity must be > 0, got {value!r}")
        past = history.get(device, ())
        if len(past) < min_history:
            continue
        baseline = statistics.median(past)
        if baseline > 0 and abs(value / baseline - 1.0) > threshold:
            out.append(Deviation(device, value, baseline))
    return sorted(out, key=lambda d: (-abs(math.log(d.ratio)), d.device))


class CapacityHistory:
    """Per-device windows of capacity estimates; reports each change of regime once.

    Feed it the capacities of every period (FTPipeHD re-estimates every 100
    mini-batches; Eco-FL on each report). A device that deviates has its
    window restarted at the new value, so the migration that answers the
    deviation is not asked for again by the same change.
    """

    def __init__(self, *, window: int = 10, threshold: float = 0.25, min_history: int = 3) -> None:
        if window < min_history or min_history < 1:
            raise ConfigError(
                f"need 1 <= min_history ({min_history}) <= window ({window}) to judge at all"
            )
        self.window = window
        self.threshold = threshold
        self.min_history = min_history
        self._past: dict[str, deque[float]] = {}

    def update(self, capacities: Mapping[str, float]) -> list[Deviation]:
        """Compare with the history, then record; the deviations found (largest first)."""
        history = {d: list(v) for d, v in self._past.items()}
        found = find_deviations(
            capacities, history, threshold=self.threshold, min_history=self.min_history
        )
        moved = {d.device for d in found}
        for device, value in capacities.items():
            past = self._past.setdefault(device, deque(maxlen=self.window))
            if device in moved:
                past.clear()
            past.append(float(value))
        return found

    def forget(self, device: str) -> None:
        """Drop a device's history (it left, or came back as a different machine)."""
        self._past.pop(device, None)

    def history(self, device: str) -> list[float]:
        return list(self._past.get(device, ()))
