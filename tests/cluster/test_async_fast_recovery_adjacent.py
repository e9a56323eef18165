"""FTPipeHD's fast recovery when a chain copy's holder dies with its owner (real stages).

The session's a, b, c (tests/cluster/test_async_recovery*.py): an ``async-1f1b`` run
with ``live_copies`` (chain every 2 mini-batches, global every 4) whose last two
stages are SIGKILLed together once the coordinator holds b's global copy and c's
chain copy. b's chain copies were at c: they died with it, so b's units come from
the coordinator's global copy (FTPipeHD's fallback for adjacent deaths) and c's
from its own chain copy at the coordinator. The run finishes on a alone, every
mini-batch trained once. Waits are for log events, each with a generous deadline.
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


def _wait_for(what: str, until: object) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not until():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        threading.Event().wait(0.1)


def test_two_adjacent_deaths_restore_the_first_from_the_global_copy(
    async_recovery_cluster: LocalCluster,
) -> None:
    cluster = async_recovery_cluster
    batches = make_batches(16, 5, seed=37)
    since = {n: len(cluster.logs(n)) for n in ["coordinator", *NAMES]}
    steps: list[int] = []
    killed: list[str] = []

    def kept(owner: str, kind: str) -> bool:
        copies = _events(cluster.logs("coordinator")[since["coordinator"] :], "async_copy_kept")
        return any(e["owner"] == owner and e["kind"] == kind for e in copies)

    def dead() -> set[object]:
        logged = _events(cluster.logs("coordinator")[since["coordinator"] :], "stage_dead")
        return {e["stage"] for e in logged}

    def on_step(step: int, _loss: float) -> None:
        steps.append(step)
        if step >= KILL_AFTER and not killed:
            # events, not timings: b's global copy and c's chain copy are here
            _wait_for("no global copy of b", lambda: kept("b", "global"))
            _wait_for("no chain copy of c", lambda: kept("c", "chain"))
            killed.extend(["b", "c"])
            cluster.kill("b")
            cluster.kill("c")
            # both seen dead before the client goes on, so that one resume names both
            _wait_for("b and c not seen dead", lambda: {"b", "c"} <= dead())

    try:
        report = cluster.fit(
            SPEC, batches, optimizer=ADAM, num_microbatches=1, schedule="async-1f1b",
            progress=False, partition=PARTITION, stage_names=NAMES, recover=True,
            live_copies=True, chain_every=2, global_every=4, consistency="fast",
            on_step=on_step,
        )  # fmt: skip
    finally:
        for name in killed:
            cluster.start_stage(DeviceSpec(name))
        cluster.wait_for_stages(len(NAMES), timeout_s=120)
    assert killed == ["b", "c"]
    logs = cluster.logs("coordinator")[since["coordinator"] :]

    assert report.steps == 16 and steps == list(range(16))
    assert report.training_plan is not None
    assert [s.devices[0] for s in report.training_plan.stages] == ["a"]
    fast = _events(logs, "async_fast_recovery")
    assert fast and sorted(fast[-1]["dead"]) == ["b", "c"]  # type: ignore[arg-type]
    # b's chain copy died with c: the coordinator's global copy; c's own chain copy
    # is the coordinator's (the last stage's)
    assert report.unit_sources[0] == "kept"
    assert {u: report.unit_sources[u] for u in (1, 2)} == {1: "global", 2: "global"}
    assert report.unit_sources[3] in ("chain@coordinator", "global")
    assert not _events(logs, "chain_copies_confirmed")  # nothing was asked of a stage
    assert report.progress_lost >= 1
