"""Clusters as a coordinator measures them, for planning benchmarks and tests.

A live coordinator measures every device's speed and every link (each direction,
and to the client), so no two of its numbers are equal: every device would be a
category of its own without bucketing (:mod:`zpipe.planner.bucketing`). These
clusters reproduce that from a few device kinds, each number a little off its
kind's value, seeded so that a run can be repeated.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from zpipe.planner.cluster import CLIENT, ClusterDevice, ClusterLink, ClusterSpec

GIB = 1 << 30
CLIENT_MBPS = 1000.0


def measured_cluster(n: int, seed: int, kinds: Sequence[tuple[float, float, float]]) -> ClusterSpec:
    """``n`` devices named ``m0``... cycling through ``kinds`` of (speed, memory GiB,
    Mbit/s): speeds within 2 % of their kind's, link bandwidths 0-4 % under the
    slower end's, latencies 0.1-2 ms."""
    if n < 1 or not kinds:
        raise ValueError(f"a measured cluster needs devices and kinds, got {n} and {len(kinds)}")
    rng = random.Random(seed)
    caps = {CLIENT: CLIENT_MBPS}
    devices = []
    for i in range(n):
        speed, memory_gib, bandwidth = kinds[i % len(kinds)]
        memory = int(memory_gib * GIB)
        devices.append(ClusterDevice(f"m{i}", memory, speed * rng.uniform(0.98, 1.02)))
        caps[f"m{i}"] = bandwidth
    links = {
        (a, b): ClusterLink(min(caps[a], caps[b]) * rng.uniform(0.96, 1.0), rng.uniform(0.1, 2))
        for a in caps
        for b in caps
        if a != b
    }
    return ClusterSpec(tuple(devices), links)
