"""A stage killed during a lossy run on ordinary stages (EdgePipe's device malfunction).

Its own cluster (its tests kill stages): the coordinator declares a stage dead by its
heartbeats, tells the survivors (``lossy_dead``), they null-fill its partials from
then on, and the run ends with the survivors' results and a report of who died and
from which mini-batch.

- Under ACK on lossy links, with a wait longer than the detection: the run, its test
  passes after training included, equals its simulation (zpipe.lossy.death_sim).
- Under ACK with a wait far shorter than the detection: a survivor does not wait for
  every acknowledgement the dead stage never sends until the verdict, only for the
  first (zpipe.lossy.ack_patience). Such a run is not compared with its simulation:
  a wait that short may also run out on a live peer.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from zpipe.client.runs.lossy import StagesLossyResult, run_lossy
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.coordinator.commands import AwaitReplies, Send
from zpipe.coordinator.flows import Flow, FlowRunner
from zpipe.lossy.data import Dataset
from zpipe.lossy.death_sim import evaluate_after, train_with_death
from zpipe.lossy.links import Recovery
from zpipe.lossy.shard import Topology
from zpipe.lossy.simulate import PreparedRun, RunConfig, prepare_run
from zpipe.lossy.trace import same_run
from zpipe.protocol.lossy import LossyDead, LossyResult

pytestmark = pytest.mark.timeout(240)

# Detection floors of several seconds (as tests/cluster/test_failures.py): a live stage starved
# of CPU must not die of it.
INTERVAL = 0.5
SUSPECT_AFTER = 6
PROBE_INTERVALS = 4
# seconds of passes on two loaded cores (every copy waits for its acknowledgement; 5 s
# for three stages at load 9), far more than the kill takes to land
N_DATA = 300
ACK = Recovery("ack", max_attempts=3)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    devices = [DeviceSpec("a"), DeviceSpec("b"), DeviceSpec("c")]
    with LocalCluster(
        devices,
        heartbeat_interval_s=INTERVAL,
        suspect_after=SUSPECT_AFTER,
        probe_intervals=PROBE_INTERVALS,
    ) as running:
        yield running


def _data() -> Dataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 12))
    y = rng.integers(0, 5, size=200)
    y[0] = 4
    return Dataset("random", x, y, x[:10], y[:10])


def _prepared(data: Dataset, n_devices: int, n_data: int = N_DATA) -> PreparedRun:
    # 40 m: lossy links between some devices (reception 0.67-0.79), so ACK resends
    cfg = RunConfig(allocation="hybrid", n_devices=n_devices, region_m=40.0, seed=1,
                    hidden=(8, 6), lr=0.1, batch_size=5, n_data=n_data, mapping="exhaustive",
                    recovery=ACK)  # fmt: skip
    return prepare_run(cfg, data)


def _run_killing(
    cluster: LocalCluster,
    prepared: PreparedRun,
    data: Dataset,
    names: list[str],
    victim: str,
    *,
    after_s: float = 0.0,
    **options: Any,
) -> StagesLossyResult:
    def kill_once_it_runs(before: int) -> None:
        # the victim logs lossy_started when it takes lossy_go; the run has seconds of
        # passes left, and the survivors cannot finish without its partials until the
        # coordinator says it is dead (every partial wait ends by its verdict or wait_s)
        deadline = time.monotonic() + 120
        while cluster.logs(victim).count("lossy_started") == before:
            if time.monotonic() > deadline:
                raise AssertionError(f"{victim} never started the lossy run")
            time.sleep(0.05)
        time.sleep(after_s)
        cluster.kill(victim, signal.SIGKILL)

    async def go() -> StagesLossyResult:
        # counted before the run starts, not in the thread: one that starts late on a
        # loaded machine would count the very start it waits for
        before = cluster.logs(victim).count("lossy_started")
        async with cluster.client() as client:
            killer = asyncio.create_task(asyncio.to_thread(kill_once_it_runs, before))
            result = await run_lossy(client, prepared, data, stage_names=names, **options)
            await asyncio.wait_for(killer, 30)
            return result

    return asyncio.run(go())


def test_a_stage_killed_mid_run_is_null_filled_and_the_run_goes_on(
    cluster: LocalCluster,
) -> None:
    data = _data()
    prepared = _prepared(data, 3)
    # wait_s far longer than the detection: no wait on a live peer runs out, so the run
    # is its simulation
    result = _run_killing(cluster, prepared, data, ["a", "b", "c"], "b", wait_s=120.0)
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
    # (zpipe.lossy.death_sim): the same drops, retransmissions, losses and weights
    assert result.trace.traffic["forward"].data_tx > result.trace.traffic["forward"].messages
    death = result.death(N_DATA)
    assert death is not None and death.switch_at is None
    simulated = train_with_death(prepared, data, death)
    assert same_run(result.trace, simulated, rtol=1e-10)
    # so are its test passes after training: b sends nothing and predicts nothing
    assert result.test is not None
    want = evaluate_after(prepared, simulated.params, data.x_test, result.test.spec, death)
    assert result.test.same_as(want)
    assert result.test_acc == want.accuracy(data.y_test)
    # a survivor's wait for one of b's acknowledgements ended by the verdict, never at
    # wait_s: none overdue, so b never went silent
    for sender in (0, 2):
        assert result.ack_waits[sender][1]["overdue"] == 0


def test_a_survivor_waits_for_one_acknowledgement_of_a_stage_killed_unannounced(
    cluster: LocalCluster,
) -> None:
    # a and c (b died in the test above, if it ran): c is killed; a's waits are 0.3 s,
    # the coordinator's verdict takes several seconds (heartbeats) in which a keeps
    # sending c copies whose acknowledgements the seeded decision promises
    names = [n for n in ("a", "b", "c") if cluster.processes[n].poll() is None][-2:]
    assert len(names) == 2
    data = _data()
    # (killed a little after it started: acknowledgements crossed before)
    # (many mini-batches: the kill lands long before the end, and those after the verdict
    # cost little, the survivor alone runs them)
    prepared = _prepared(data, 2, n_data=1000)
    result = _run_killing(cluster, prepared, data, names, names[1], after_s=0.2, wait_s=0.3,
                          test_repeats=None)  # fmt: skip
    assert set(result.dead) == {1} and set(result.device_wall_s) == {0}
    waits = result.ack_waits[0][1]  # the survivor's, about the killed stage's
    # A wait for an acknowledgement of the dead stage ran out at most once for each time
    # the survivor heard from it again (only a message it sent before it died can say
    # so); every other promised acknowledgement until the verdict was not awaited.
    assert waits["overdue"] <= 1 + waits["heard_again"]
    assert waits["unawaited"] >= 1
    assert result.on_wire[0]["acks_overdue"] == waits["overdue"]


def test_a_wait_tells_the_others_when_a_stage_it_waits_on_is_lost() -> None:
    # The flow side, pure: a partial wait carries its on_lost commands out when a stage
    # it waits on dies, and goes on with the replies of the others.
    notice = Send(b"a", LossyDead(run=1, device=1), "a")
    got: list[dict[str, LossyResult]] = []

    def flow() -> Flow:
        replies = yield AwaitReplies(("a", "b"), LossyResult, 60.0, "lossy_result",
                                     run=1, partial=True, on_lost=(("b", (notice,)),))  # fmt: skip
        got.append(replies)

    runner = FlowRunner()
    runner.start(flow(), now=0.0)
    assert runner.stage_lost("b", RuntimeError("dead"), now=1.0) == [notice]
    result = LossyResult(
        run=1, device=0, error="", layers=[], losses=[], propagation={}, traffic={},
        arrivals=[], waits=[], late=0, protocol_errors=0, wall_s=0.0,
    )  # fmt: skip
    assert runner.reply("a", result, now=2.0) == []
    assert list(got[0]) == ["a"]
