"""A stage that slows 100x mid-run has the run looked at before its next scheduled look
(issue 30): its own forward watch tells the coordinator (``speed_changed``), the
coordinator relays it to the client, and the client looks before its next mini-batch.

Real processes on loopback: three stages, the middle one emulating a device that
turns 100 times slower 3 s after its first forward (``--slowdown-schedule``). The
watch sees wall time, waits for a core included, and emulation adds only the extra
work (``(factor - 1)`` times the forward's CPU), so waits shrink the ratio: with a
10x device, a suite run at load 13-16 relayed no verdict in its 240 s (under 3x: the
waits were over 3.5 times the work); 100x reads over 3x until the waits pass about
48 times the work. The scheduled looks are out of reach (the first after 10,000
mini-batches), so every look the run makes is an early one. The feed is a generator
that goes on until the coordinator has relayed the slowed stage's verdict (or kept it
for a look in progress: another stage's watch may fire on a loaded host's noise, and
before, a verdict during a look was dropped: the likeliest reason a CI run relayed
none of b's), then feeds 20 more
mini-batches (the look comes at the first of them the client feeds after the relay):
no step of the test waits on a clock, only the generous cap on the whole run does.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from tests._support.log_events import logged as _logged
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.log import read_events
from zpipe.models import ModelSpec

# forwards of several milliseconds: a loaded host's waits for a core (load 15 here) are
# a small part of them, so the other stages' watches do not fire on noise (a look they
# start can drop b's verdict: the coordinator drops verdicts during a look)
SPEC = ModelSpec("mlp", {"dims": [12, 512, 512, 512, 512, 512, 4], "activation": "gelu"}, seed=3)
FACTOR = 3.0  # the watch's: the slowdown is 100x, so noise of a loaded host stays under it
AFTER_RELAY = 20  # mini-batches fed once the coordinator relayed the verdict
CAP_S = 240.0  # the whole run's cap (the old code never looks: the test fails there)


def _relayed_from(cluster: LocalCluster, stage: str) -> list[dict[str, Any]]:
    """``stage``'s verdicts the coordinator took: relayed to the client, or kept for a
    look in progress (which takes it, or it is relayed when that look ends)."""
    log = cluster.logs("coordinator")
    relayed = read_events(log, "speed_change_relayed", "speed_change_deferred")
    return [r for r in relayed if r.get("stage") == stage and float(r["ratio"]) >= FACTOR]


def _batches(cluster: LocalCluster) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(11)
    started = time.monotonic()
    left: int | None = None
    while left is None or left > 0:
        if left is None and _relayed_from(cluster, "b"):
            left = AFTER_RELAY
        if left is not None:
            left -= 1
        elif time.monotonic() - started > CAP_S:
            return  # never relayed: the assertions say so
        yield (
            torch.randn(32, 12, generator=generator),
            torch.randint(0, 4, (32,), generator=generator),
        )


def test_a_stage_that_slows_mid_run_is_looked_at_before_the_next_scheduled_look() -> None:
    devices = [
        DeviceSpec("a", threads=1),
        DeviceSpec("b", threads=1, slowdown_schedule="0:1,3:100"),
        DeviceSpec("c", threads=1),
    ]
    with LocalCluster(devices, log_level="info") as cluster:
        report = cluster.fit(
            SPEC,
            _batches(cluster),
            optimizer={"name": "adam", "lr": 1e-3},
            num_microbatches=1,
            schedule="async-1f1b",
            partition=[[0, 2], [2, 4], [4, 6]],
            repartition={"first": 10_000, "every": 10_000, "forward_watch": FACTOR},
            progress=False,
        )
        verdicts = _logged(cluster.logs("b"), "speed_changed")
        relayed = _relayed_from(cluster, "b")
        considered = _logged(cluster.logs("coordinator"), "repartition_considered")
        dropped = _logged(cluster.logs("coordinator"), "speed_change_dropped")
    # the slowed stage saw its forwards slow down and the coordinator relayed it, or
    # kept it for a look in progress (its ratio against the forwards before it: under
    # 10 when a look moved its units meanwhile and the new baseline caught the first
    # slow forwards)
    assert relayed, (
        f"no verdict of b relayed; b's verdicts: {verdicts}; dropped: {dropped}; "
        f"looks: {considered}"
    )
    first = min(int(r["step"]) for r in relayed)
    # a look came after it: no scheduled one is due in this run, so this one is early
    looks = [r for r in report.repartitions if int(r["at"]) > first]
    assert looks, f"no look after b's verdict at {first}: {report.repartitions}"
    assert all(int(r["at"]) < 10_000 for r in report.repartitions)
    # the look after the verdict measured b by it (its window holds too few slow
    # forwards to show the change); a look before the verdict did not
    taken = {int(r["at"]) for r in considered if "b" in r.get("verdicts_taken", [])}
    next_look = min(int(r["at"]) for r in considered if int(r["at"]) > first)
    assert next_look in taken and min(taken) > first, considered
    assert report.steps >= first + AFTER_RELAY // 2
