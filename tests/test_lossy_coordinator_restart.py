"""A lossy run whose coordinator is SIGKILLed mid-run and started again.

The coordinator keeps a lossy run's progress in memory only (its flow: holds,
remaps, results). What survives a restart is the client's request, which fixes the
whole run (its seed decides every drop): the client sends it again when its
connection to the coordinator is made again, and the restarted coordinator runs it
from the start; the stages drop the old run at the new one's set-up. The run ends
normally, and equals its simulation.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
import pytest

from zpipe.client.lossy_run import StagesLossyResult, run_lossy
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.lossy.data import Dataset
from zpipe.lossy.simulate import RunConfig, prepare_run
from zpipe.lossy.trace import same_run, train_in_process

pytestmark = pytest.mark.timeout(240)

# seconds of passes on two loaded cores: the restart lands long before the end
N_DATA = 400


def _events(log: str, event: str) -> list[dict[str, object]]:
    found = []
    for line in log.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == event:
            found.append(record)
    return found


def test_a_lossy_run_survives_a_coordinator_restart_and_equals_its_simulation(
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(4)
    x = rng.normal(size=(150, 10))
    y = rng.integers(0, 4, size=150)
    data = Dataset("random", x, y, x[:10], y[:10])
    cfg = RunConfig(allocation="hybrid", n_devices=3, region_m=30.0, seed=3, hidden=(8,),
                    lr=0.1, batch_size=5, n_data=N_DATA, mapping="exhaustive")  # fmt: skip
    prepared = prepare_run(cfg, data)
    names = ["a", "b", "c"]
    with LocalCluster(
        [DeviceSpec(n) for n in names],
        heartbeat_interval_s=0.5,
        suspect_after=6,
        probe_intervals=4,
        state_dir=tmp_path / "state",
    ) as cluster:

        def restart_once_it_runs() -> None:
            deadline = time.monotonic() + 120
            while "lossy_started" not in cluster.logs("a") and time.monotonic() < deadline:
                time.sleep(0.05)
            cluster.kill("coordinator")
            cluster.restart_coordinator()

        async def go() -> StagesLossyResult:
            async with cluster.client() as client:
                restarter = asyncio.create_task(asyncio.to_thread(restart_once_it_runs))
                result = await run_lossy(
                    client, prepared, data, stage_names=names, wait_s=60.0, test_repeats=None
                )
                await asyncio.wait_for(restarter, 30)
                return result

        result = asyncio.run(go())
        log = cluster.logs("coordinator")
        stage_log = cluster.logs("a")
    planned = _events(log, "lossy_run_planned")
    # planned by the first coordinator, and again by the restarted one (another run id)
    assert len(planned) == 2 and planned[0]["run"] != planned[1]["run"]
    assert len(_events(stage_log, "lossy_setup")) == 2
    done = _events(log, "lossy_run_done")
    assert len(done) == 1 and done[0]["run"] == planned[1]["run"]
    assert not result.dead and sorted(result.device_wall_s) == [0, 1, 2]
    # the run-end counters of every stage, as other runs report them
    assert sorted(result.stage_metrics) == names
    assert all("error" not in m for m in result.stage_metrics.values())
    assert same_run(result.trace, train_in_process(prepared, data), rtol=1e-10)
