"""A lossy run on ordinary stages through a coordinator restart and a stage's death.

One cluster for both (process start-up and ``import torch`` cost seconds each): first
its coordinator is SIGKILLed mid-run and started again, then one of its stages is.

- Coordinator restart: the coordinator keeps a lossy run's progress in memory only (its
  flow: holds, remaps, results). What survives is the client's request, which fixes the
  whole run (its seed decides every drop): the client sends it again when its connection
  to the coordinator is made again, and the restarted coordinator runs it from the
  start; the stages drop the old run at the new one's set-up. The run ends normally
  and equals its simulation.
- A stage's death with ``on_death="remap"``: the coordinator declares the stage dead by
  its heartbeats, the survivors hold at the last mini-batch they started, the
  coordinator places the dead device's super neurons on survivors (Algorithm 2's
  objective, zpipe.lossy.remap) and they run the rest on the new allocation, the
  taken-over neurons from the dead stage's latest replica. The run equals its
  simulation (zpipe.lossy.death_sim) exactly: same drops, losses and weights.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zpipe.client.runs.lossy import StagesLossyResult, run_lossy
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.lossy.data import Dataset
from zpipe.lossy.death_sim import evaluate_after, train_with_death
from zpipe.lossy.simulate import PreparedRun, RunConfig, prepare_run
from zpipe.lossy.trace import same_run, train_in_process

pytestmark = pytest.mark.timeout(300)

NAMES = ["a", "b", "c", "d"]
# seconds of passes on two loaded cores, far more than a kill takes to land
N_DATA = 600
# b sends the coordinator its slices every this many mini-batches: its neurons resume
# from the latest one it sent
REPLICA_EVERY = 20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # detection floors of several seconds (as tests/cluster/test_failures.py): a live stage
    # starved of CPU must not die of it; a state directory, as a coordinator that may
    # restart needs
    with LocalCluster(
        [DeviceSpec(n) for n in NAMES],
        heartbeat_interval_s=0.5,
        suspect_after=6,
        probe_intervals=4,
        state_dir=Path(tmp_path_factory.mktemp("lossy")) / "state",
    ) as cluster:
        yield cluster


def _prepared() -> tuple[PreparedRun, Dataset]:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(200, 12))
    y = rng.integers(0, 5, size=200)
    data = Dataset("random", x, y, x[:10], y[:10])
    cfg = RunConfig(
        allocation="hybrid",
        n_devices=4,
        region_m=30.0,
        seed=2,
        hidden=(8, 6),
        lr=0.1,
        batch_size=5,
        n_data=N_DATA,
        mapping="exhaustive",
    )
    return prepare_run(cfg, data), data


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


def _run_and(
    cluster: LocalCluster,
    prepared: PreparedRun,
    data: Dataset,
    act: Callable[[], None],
    *,
    once: str,
    after_s: float,
    **options: Any,
) -> StagesLossyResult:
    """Run the lossy run; once stage ``once`` starts its passes (and ``after_s`` more
    seconds), ``act``."""

    def watch(before: int) -> None:
        deadline = time.monotonic() + 120
        while len(_events(cluster.logs(once), "lossy_started")) == before:
            if time.monotonic() > deadline:
                raise AssertionError(f"{once} never started the lossy run")
            time.sleep(0.05)
        time.sleep(after_s)
        act()

    async def go() -> StagesLossyResult:
        # counted before the run starts: counted in the watching thread, which a loaded
        # machine may start after the stage's passes began, it missed the start it
        # waits for (seen: the run ended untouched and the watch waited on)
        before = len(_events(cluster.logs(once), "lossy_started"))
        async with cluster.client() as client:
            acting = asyncio.create_task(asyncio.to_thread(watch, before))
            result = await run_lossy(client, prepared, data, stage_names=NAMES, **options)
            await asyncio.wait_for(acting, 30)
            return result

    return asyncio.run(go())


def test_a_lossy_run_survives_a_coordinator_restart_and_equals_its_simulation(
    cluster: LocalCluster,
) -> None:
    def restart() -> None:
        cluster.kill("coordinator")
        cluster.restart_coordinator()

    prepared, data = _prepared()
    planned_before = len(_events(cluster.logs("coordinator"), "lossy_run_planned"))
    setups_before = len(_events(cluster.logs("a"), "lossy_setup"))
    result = _run_and(
        cluster, prepared, data, restart, once="a", after_s=0.0, wait_s=60.0, test_repeats=None
    )
    log = cluster.logs("coordinator")
    planned = _events(log, "lossy_run_planned")[planned_before:]
    # planned by the first coordinator, and again by the restarted one (another run id)
    assert len(planned) == 2 and planned[0]["run"] != planned[1]["run"]
    assert len(_events(cluster.logs("a"), "lossy_setup")) - setups_before == 2
    done = _events(log, "lossy_run_done")
    assert done and done[-1]["run"] == planned[1]["run"]
    assert not result.dead and sorted(result.device_wall_s) == [0, 1, 2, 3]
    # the run-end counters of every stage, as other runs report them
    assert sorted(result.stage_metrics) == NAMES
    assert all("error" not in m for m in result.stage_metrics.values())
    assert same_run(result.trace, train_in_process(prepared, data), rtol=1e-10)


def test_a_stage_killed_mid_run_is_remapped_and_the_run_equals_its_simulation(
    cluster: LocalCluster,
) -> None:
    prepared, data = _prepared()
    # Let b run some passes first, so that the kill cuts its outgoing streams mid-run.
    # Whenever it lands, the survivors cannot finish training without b's partials
    # until the coordinator declares it dead (wait_s is longer).
    result = _run_and(
        cluster,
        prepared,
        data,
        lambda: cluster.kill("b", signal.SIGKILL),
        once="b",
        after_s=0.5,
        wait_s=120.0,
        on_death="remap",
        test_repeats=1,
        replica_every=REPLICA_EVERY,
    )
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
    want = evaluate_after(prepared, simulated.params, data.x_test, result.test.spec, death)
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
