"""A stage killed during a lossy run on ordinary stages (EdgePipe's device malfunction).

Its own cluster (the test kills one of its stages): the coordinator declares the
stage dead by its heartbeats, tells the survivors (``lossy_dead``), they null-fill
its partials from then on, and the run ends with the survivors' results and a
report of who died and from which mini-batch.
"""

from __future__ import annotations

import asyncio
import signal
import time

import numpy as np
import pytest

from zpipe.client.lossy_run import StagesLossyResult, run_lossy
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.coordinator.commands import AwaitReplies, Send
from zpipe.coordinator.flows import Flow, FlowRunner
from zpipe.lossy.data import Dataset
from zpipe.lossy.death_sim import train_with_death
from zpipe.lossy.shard import Topology
from zpipe.lossy.simulate import RunConfig, prepare_run
from zpipe.lossy.trace import same_run
from zpipe.transport.codec import Message

pytestmark = pytest.mark.timeout(240)

# Detection floors of several seconds (as tests/test_failures.py): a live stage starved
# of CPU must not die of it.
INTERVAL = 0.5
SUSPECT_AFTER = 6
PROBE_INTERVALS = 4
# seconds of passes on two loaded cores, far more than the kill takes to land
N_DATA = 800


def _data() -> Dataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 12))
    y = rng.integers(0, 5, size=200)
    y[0] = 4
    return Dataset("random", x, y, x[:10], y[:10])


def test_a_stage_killed_mid_run_is_null_filled_and_the_run_goes_on() -> None:
    data = _data()
    cfg = RunConfig(allocation="hybrid", n_devices=3, region_m=20.0, seed=1, hidden=(8, 6),
                    lr=0.1, batch_size=5, n_data=N_DATA, mapping="exhaustive",
                    lossless=True)  # fmt: skip
    prepared = prepare_run(cfg, data)
    devices = [DeviceSpec("a"), DeviceSpec("b"), DeviceSpec("c")]
    with LocalCluster(
        devices,
        heartbeat_interval_s=INTERVAL,
        suspect_after=SUSPECT_AFTER,
        probe_intervals=PROBE_INTERVALS,
    ) as cluster:

        def kill_b_once_it_runs() -> None:
            # b logs lossy_started when it takes lossy_go; the run has seconds of passes
            # left. The survivors then wait for b's partials (wait_s: longer than the
            # detection) until the coordinator says b is dead, so the run cannot end
            # before they hear it, however late that is.
            deadline = time.monotonic() + 120
            while "lossy_started" not in cluster.logs("b") and time.monotonic() < deadline:
                time.sleep(0.05)
            cluster.kill("b", signal.SIGKILL)

        async def go() -> StagesLossyResult:
            async with cluster.client() as client:
                killer = asyncio.create_task(asyncio.to_thread(kill_b_once_it_runs))
                result = await run_lossy(
                    client, prepared, data, stage_names=["a", "b", "c"], wait_s=120.0
                )
                await asyncio.wait_for(killer, 30)
                return result

        result = asyncio.run(go())
        assert "lossy_peer_dead" in cluster.logs("a") + cluster.logs("c")
    assert set(result.dead) == {1}  # device k is the k-th stage: b is device 1
    stage, first = result.dead[1]
    assert stage == "b" and first is not None and 1 <= first < N_DATA
    assert set(result.device_wall_s) == {0, 2}  # the survivors finished the run
    # b's slices come back null (zeros): what the survivors computed with in their place
    for layer, (w, bias) in enumerate(result.trace.params, 1):
        for d, sl in result.alloc.owners(layer):
            rows = (w[sl.start : sl.stop], bias[sl.start : sl.stop])
            assert (d == 1) == (not rows[0].any() and not rows[1].any())
    # the last mini-batch ran after the death: each of its passes that reads from b ran
    # without b's partial, null-filled
    topo = Topology(result.alloc)
    read_b = 0
    for (data_id, kind, key_layer, d), senders in result.trace.arrivals.items():
        sending_layer = key_layer + 1 if kind == "B" else key_layer
        if data_id == N_DATA and any(src == 1 for src, _ in topo.owners[sending_layer]):
            read_b += 1
            assert 1 not in senders
            assert [data_id, kind, key_layer] in [w[:3] for w in result.waits[d]]
    assert read_b > 0
    # and the run is its simulation with b dying where its streams were cut
    # (zpipe.lossy.death_sim): the same drops, losses and weights
    death = result.death(N_DATA)
    assert death is not None and death.switch_at is None
    assert same_run(result.trace, train_with_death(prepared, data, death), rtol=1e-10)


def test_a_wait_tells_the_others_when_a_stage_it_waits_on_is_lost() -> None:
    # The flow side, pure: a partial wait carries its on_lost commands out when a stage
    # it waits on dies, and goes on with the replies of the others.
    notice = Send(b"a", Message("lossy_dead", {"run": 1, "device": 1}), "a")
    got: list[dict[str, Message]] = []

    def flow() -> Flow:
        replies = yield AwaitReplies(("a", "b"), "lossy_result", 60.0, "lossy_result",
                                     run=1, partial=True, on_lost=(("b", (notice,)),))  # fmt: skip
        got.append(replies)

    runner = FlowRunner()
    runner.start(flow(), now=0.0)
    assert runner.stage_lost("b", RuntimeError("dead"), now=1.0) == [notice]
    assert runner.reply("a", Message("lossy_result", {"run": 1}), now=2.0) == []
    assert list(got[0]) == ["a"]
