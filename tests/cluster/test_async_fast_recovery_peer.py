"""FTPipeHD's fast recovery moves a survivor's unit peer to peer (real stages).

The session's a, b, c (tests/cluster/test_async_recovery*.py): an ``async-1f1b``
run with ``live_copies`` (chain every 2, global every 4) over a 0-1 | b 1-3 | c 3-4.
c, the last stage, is SIGKILLed once its chain copy is at the coordinator. The
survivors are cut again one capacity each (no look measured them): a 0-2 | b 2-4,
so b's unit 1 changes hands. It goes from b's kept state straight to a (b logs it
served to a, the coordinator's restore plan counts it from a peer), bit for bit
(the digest b logs when it stops equals the one a logs when it resumes); the
coordinator carries c's unit 3 alone, from its chain copy. The run finishes with
every mini-batch trained once. Waits are for log events, with generous deadlines.
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


def test_a_unit_the_recut_moves_goes_from_survivor_to_survivor(
    async_recovery_cluster: LocalCluster,
) -> None:
    cluster = async_recovery_cluster
    batches = make_batches(16, 5, seed=37)
    since = {n: len(cluster.logs(n)) for n in ["coordinator", *NAMES]}
    steps: list[int] = []
    killed: list[str] = []

    def copy_of_c_here() -> bool:
        kept = _events(cluster.logs("coordinator")[since["coordinator"] :], "async_copy_kept")
        return any(e["owner"] == "c" and e["kind"] == "chain" for e in kept)

    def on_step(step: int, _loss: float) -> None:
        steps.append(step)
        if step >= KILL_AFTER and not killed:
            # an event, not a timing: c's chain copy is at the coordinator
            deadline = time.monotonic() + DEADLINE_S
            while not copy_of_c_here():
                assert time.monotonic() < deadline, "no chain copy of c at the coordinator"
                threading.Event().wait(0.1)
            killed.append("c")
            cluster.kill("c")

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
    assert killed == ["c"]
    logs = {n: cluster.logs(n)[since[n] :] for n in since}

    assert report.steps == 16 and steps == list(range(16))
    assert report.training_plan is not None
    assert [s.devices[0] for s in report.training_plan.stages] == ["a", "b"]
    (fast,) = _events(logs["coordinator"], "async_fast_recovery")
    assert fast["bounds"] == [0, 2, 4], fast  # one capacity each: two units a survivor
    sources = report.unit_sources
    assert sources == {0: "kept", 1: "peer", 2: "kept", 3: "chain@coordinator"}, sources

    # the survivors kept their state (only the keys went to the coordinator); the
    # coordinator carried c's unit 3 alone: a loads unit 0 and b units 2 from their
    # own snapshots, a fetches unit 1 from b
    sent = {n: _events(logs[n], "latest_state_sent") for n in ("a", "b")}
    assert all(len(s) == 1 and s[0]["kept"] is True for s in sent.values()), sent
    (planned,) = [e for e in _events(logs["coordinator"], "restore_planned")
                  if e["recovery"] == "fast"]  # fmt: skip
    assert (planned["local"], planned["from_peers"], planned["from_coordinator"]) == (2, 1, 1)
    served = _events(logs["b"], "units_served")
    assert [(e["owner"], e["start"], e["end"]) for e in served] == [("b", 1, 2)], served

    # unit 1 reached a bit for bit: the digest b logged when it stopped is the one a
    # logged when it resumed
    (resumed,) = _events(logs["a"], "async_state_resumed")
    stopped = sent["b"][0]["digests"]
    started = resumed["digests"]
    assert isinstance(stopped, dict) and isinstance(started, dict)
    assert started["1"] == stopped["1"]
    assert resumed["updates"] == fast["resume_at"]
