"""What r-TX and ACK really put on the wire of a lossy run on ordinary stages.

Runs the same hybrid lossy run (three local stages, seeded links) with recovery
none, r-TX and ACK, and prints per scheme the stages' wire counts (copies sent
and lost, duplicates discarded, acknowledgements sent, lost and received), the
simulated transmissions they must match, and the run's wall time. The summary
gives each scheme's wall time and copies on the wire as ratios to 'none' in the
same run (ACK's sender waits for each acknowledgement the seeded decision lets
through, a round trip per copy). The machine's load average is printed with it:
timings on a shared machine are noisy.

    .venv/bin/python -m bench.lossy_wire --steps 20
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from bench._common import emit, loadavg, summary
from zpipe.client.runs.lossy import StagesLossyResult, run_lossy
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.lossy.data import Dataset
from zpipe.lossy.links import Recovery
from zpipe.lossy.simulate import PreparedRun, RunConfig, prepare_run
from zpipe.stage.executors.lossy_recovery import WireCounts

SCHEMES = {"none": Recovery("none"), "rtx": Recovery("rtx", copies=2),
           "ack": Recovery("ack", max_attempts=3)}  # fmt: skip


def _data(features: int, classes: int) -> Dataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, features))
    y = rng.integers(0, classes, size=400)
    y[0] = classes - 1
    return Dataset("random", x, y, x[:20], y[:20])


def _run(cluster: LocalCluster, prepared: PreparedRun, data: Dataset) -> StagesLossyResult:
    async def go() -> StagesLossyResult:
        async with cluster.client() as client:
            return await run_lossy(client, prepared, data, stage_names=names)

    names = [d.name for d in cluster.devices]
    return asyncio.run(go())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="mini-batches per run")
    parser.add_argument("--repeats", type=int, default=2, help="runs per scheme")
    args = parser.parse_args()
    data = _data(12, 5)
    base = RunConfig(allocation="hybrid", n_devices=3, region_m=80.0, seed=3, hidden=(8, 6),
                     lr=0.1, batch_size=5, n_data=args.steps, mapping="exhaustive")  # fmt: skip
    walls: dict[str, float] = {}
    copies: dict[str, int] = {}
    with LocalCluster([DeviceSpec(f"s{i}") for i in range(3)], log_level="warning") as cluster:
        cluster.wait_for_stages(3, timeout_s=60)
        for name, recovery in SCHEMES.items():
            prepared = prepare_run(replace(base, recovery=recovery), data)
            best = float("inf")
            for _ in range(args.repeats):
                started = time.perf_counter()
                result = _run(cluster, prepared, data)
                best = min(best, time.perf_counter() - started)
            wire = {k: sum(c.get(k, 0) for c in result.on_wire.values())
                    for k in WireCounts().as_dict()}  # fmt: skip
            # the run's own count of transmissions (training and test passes), which
            # equals its simulation's (tests/cluster/test_lossy_stages.py)
            traffic = list(result.trace.traffic.values())
            if result.test is not None:
                traffic.append(result.test.traffic)
            emit({"bench": "lossy_wire", "scheme": name, "steps": args.steps,
                  "wall_s": round(best, 3), "wire": wire,
                  "data_tx": sum(t.data_tx for t in traffic),
                  "ack_tx": sum(t.ack_tx for t in traffic),
                  "delivered": sum(t.delivered for t in traffic),
                  "load": loadavg()})  # fmt: skip
            walls[name], copies[name] = best, wire.get("copies_sent", 0)
    summary(
        "lossy_wire",
        wall_rtx_over_none=round(walls["rtx"] / walls["none"], 3),
        wall_ack_over_none=round(walls["ack"] / walls["none"], 3),
        copies_rtx_over_none=round(copies["rtx"] / max(copies["none"], 1), 3),
        copies_ack_over_none=round(copies["ack"] / max(copies["none"], 1), 3),
        load=loadavg(),
    )


if __name__ == "__main__":
    main()
