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
from zpipe.lossy.simulate import RunConfig, prepare_run
from zpipe.lossy.trace import train_in_process
from zpipe.transport.codec import Message

pytestmark = pytest.mark.timeout(240)

# Detection floors of several seconds (as tests/test_failures.py): a live stage starved
# of CPU must not die of it.
INTERVAL = 0.5
SUSPECT_AFTER = 6
PROBE_INTERVALS = 4
N_DATA = 40


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
            # b logs lossy_started when its passes begin; the survivors then wait for
            # its partials (at most wait_s) until the coordinator says it is dead.
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
    assert stage == "b" and first is not None and 1 <= first <= N_DATA
    assert set(result.device_wall_s) == {0, 2}  # the survivors finished the run
    want = train_in_process(prepared, data)  # lossless: every partial arrives
    # before b died the run was the lossless one; from `first` on b's partials are missing
    assert result.trace.propagation.rate("forward", "backward", "share") < 1.0
    for step in range(1, first):
        if step in result.trace.losses:
            assert result.trace.losses[step] == pytest.approx(want.losses[step], rel=1e-10)
    # b's slices come back null (zeros): what the survivors computed with in their place
    for layer, (w, b) in enumerate(result.trace.params, 1):
        owned = [sl for d, sl in result.alloc.owners(layer) if d == 1]
        for sl in owned:
            assert not w[sl.start : sl.stop].any() and not b[sl.start : sl.stop].any()
    null_filled = [w for d in (0, 2) for w in result.waits[d] if w[0] >= first]
    assert null_filled  # passes after the death ran with b's partials missing


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
