"""A stage killed during a lossy run that re-maps its super neurons (``on_death="remap"``).

Its own cluster (the test kills one of its stages): the coordinator declares the
stage dead by its heartbeats, the survivors hold at the last mini-batch they started,
the coordinator places the dead device's super neurons on survivors (Algorithm 2's
objective, zpipe.lossy.remap) and they run the rest of the run on the new allocation.
The run then equals its simulation (zpipe.lossy.death_sim) exactly: same drops,
losses and weights.
"""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import replace

import numpy as np
import pytest

from zpipe.client.lossy_run import StagesLossyResult, run_lossy
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.lossy.data import Dataset
from zpipe.lossy.death_sim import train_with_death
from zpipe.lossy.simulate import RunConfig, prepare_run
from zpipe.lossy.trace import evaluate_in_process, same_run

pytestmark = pytest.mark.timeout(240)

# Detection floors of several seconds (as tests/test_failures.py): a live stage starved
# of CPU must not die of it.
INTERVAL = 0.5
SUSPECT_AFTER = 6
PROBE_INTERVALS = 4
# seconds of passes on two loaded cores, far more than the kill takes to land
N_DATA = 600
# b sends the coordinator its slices every this many mini-batches: its neurons resume
# from the latest one it sent
REPLICA_EVERY = 20


def _data() -> Dataset:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(200, 12))
    y = rng.integers(0, 5, size=200)
    return Dataset("random", x, y, x[:10], y[:10])


def test_a_stage_killed_mid_run_is_remapped_and_the_run_equals_its_simulation() -> None:
    data = _data()
    cfg = RunConfig(allocation="hybrid", n_devices=4, region_m=30.0, seed=2, hidden=(8, 6),
                    lr=0.1, batch_size=5, n_data=N_DATA, mapping="exhaustive")  # fmt: skip
    prepared = prepare_run(cfg, data)
    names = ["a", "b", "c", "d"]
    with LocalCluster(
        [DeviceSpec(n) for n in names],
        heartbeat_interval_s=INTERVAL,
        suspect_after=SUSPECT_AFTER,
        probe_intervals=PROBE_INTERVALS,
    ) as cluster:

        def kill_b_once_it_runs() -> None:
            deadline = time.monotonic() + 120
            while "lossy_started" not in cluster.logs("b") and time.monotonic() < deadline:
                time.sleep(0.05)
            # Let b run some passes first, so that the kill cuts its outgoing streams
            # mid-run. Whenever it lands, the survivors cannot finish training without
            # b's partials until the coordinator declares it dead (wait_s is longer).
            time.sleep(0.5)
            cluster.kill("b", signal.SIGKILL)

        async def go() -> StagesLossyResult:
            async with cluster.client() as client:
                killer = asyncio.create_task(asyncio.to_thread(kill_b_once_it_runs))
                result = await run_lossy(
                    client,
                    prepared,
                    data,
                    stage_names=names,
                    wait_s=120.0,
                    on_death="remap",
                    test_repeats=1,
                    replica_every=REPLICA_EVERY,
                )
                await asyncio.wait_for(killer, 30)
                return result

        result = asyncio.run(go())
        survivor_logs = "".join(cluster.logs(n) for n in ("a", "c", "d"))
    assert set(result.dead) == {1}  # device k is the k-th stage: b is device 1
    assert len(result.remaps) == 1
    device, stage, switch_at, after, replica_step = result.remaps[0]
    assert (device, stage) == (1, "b") and 1 < switch_at <= N_DATA
    assert replica_step is None or (replica_step % REPLICA_EVERY == 0 and replica_step < switch_at)
    assert 1 not in after.device_of and set(after.device_of) == {0, 2, 3}
    assert "lossy_switched" in survivor_logs
    assert set(result.device_wall_s) == {0, 2, 3}
    # every mini-batch has a loss: the output layer always had a live owner
    assert sorted(result.trace.losses) == list(range(1, N_DATA + 1))
    death = result.death(prepared.n_data)
    assert death is not None and death.switch_at == switch_at
    assert death.replica_step == replica_step
    simulated = train_with_death(prepared, data, death)
    assert same_run(result.trace, simulated, rtol=1e-10)
    # the test passes under loss after training ran on the allocation switched to
    assert result.test is not None
    tested = replace(prepared, alloc=after, period=0)
    want = evaluate_in_process(tested, simulated.params, data.x_test, result.test.spec)
    assert result.test.same_as(want)
    # the comparison sees the cut: a switch one mini-batch later is another run
    if switch_at < N_DATA:
        later = replace(death, switch_at=switch_at + 1)
        assert not same_run(result.trace, train_with_death(prepared, data, later), rtol=1e-10)
    # and so does where the taken-over neurons' weights came from
    other = None if replica_step is not None else REPLICA_EVERY
    if other is None or other < switch_at:
        moved = replace(death, replica_step=other)
        assert not same_run(result.trace, train_with_death(prepared, data, moved), rtol=1e-10)
    print("switch_at", switch_at, "replica", replica_step, "heard", dict(death.heard))
