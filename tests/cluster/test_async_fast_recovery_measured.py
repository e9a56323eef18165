"""FTPipeHD's fast recovery re-cuts the survivors over what the run measured (real
stages): an ``async-1f1b`` run with ``live_copies`` and a live re-partition that
looks every 2 mini-batches (and never moves: its gain threshold is out of reach)
loses its middle stage once b's chain copy is at c. The recovery's eq. 5 takes the
capacities the looks measured (the plan's ``eq5`` says so, and from which look);
the run finishes on the survivors, every mini-batch trained once. Waits are for
log events, each with a generous deadline.
"""

from __future__ import annotations

import threading
import time

from tests._support.async_training import ADAM, SPEC, make_batches
from tests._support.training_recovery import _events
from zpipe.cluster import DeviceSpec, LocalCluster

NAMES = ["a", "b", "c"]
PARTITION = [[0, 1], [1, 3], [3, 4]]
DEADLINE_S = 180.0
KILL_AFTER = 7


def test_the_survivors_are_recut_over_the_capacities_the_looks_measured(
    async_recovery_cluster: LocalCluster,
) -> None:
    cluster = async_recovery_cluster
    batches = make_batches(16, 5, seed=41)
    since = {n: len(cluster.logs(n)) for n in ["coordinator", *NAMES]}
    steps: list[int] = []
    killed: list[str] = []

    def ready_to_kill() -> bool:
        logs = cluster.logs("coordinator")[since["coordinator"] :]
        copies = _events(logs, "async_copy_kept")
        looks = [e for e in _events(logs, "repartition_considered") if e.get("measured")]
        chain = any(e["owner"] == "b" and e["holder"] == "c" for e in copies)
        return chain and bool(looks)

    def on_step(step: int, _loss: float) -> None:
        steps.append(step)
        if step >= KILL_AFTER and not killed:
            deadline = time.monotonic() + DEADLINE_S
            while not ready_to_kill():  # b's chain copy at c, a look that measured
                assert time.monotonic() < deadline, "no chain copy of b at c, or no look"
                threading.Event().wait(0.1)
            killed.append("b")
            cluster.kill("b")

    try:
        report = cluster.fit(
            SPEC, batches, optimizer=ADAM, num_microbatches=1, schedule="async-1f1b",
            progress=False, partition=PARTITION, stage_names=NAMES, recover=True,
            live_copies=True, chain_every=2, global_every=4, consistency="fast",
            repartition={"first": 2, "every": 2, "gain": 0.99}, on_step=on_step,
        )  # fmt: skip
    finally:
        for name in killed:
            cluster.start_stage(DeviceSpec(name))
        cluster.wait_for_stages(len(NAMES), timeout_s=120)
    assert killed == ["b"]
    assert report.steps == 16 and steps == list(range(16))
    logs = cluster.logs("coordinator")[since["coordinator"] :]
    (fast,) = _events(logs, "async_fast_recovery")
    eq5 = fast["eq5"]
    # the capacities the looks measured, of the two survivors, cut them
    assert isinstance(eq5, dict) and set(eq5["capacities"]) == {"a", "c"}, eq5
    assert all(c > 0 for c in eq5["capacities"].values())
    assert "after mini-batch" in eq5["capacities_from"]
    (recovery,) = report.recoveries
    assert recovery["eq5"]["capacities"] == eq5["capacities"]
    assert report.unit_sources[1] == "chain@c" and report.unit_sources[2] == "chain@c"
