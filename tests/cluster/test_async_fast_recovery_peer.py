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

from tests._support.async_fast_recovery import FastRecoveryRun

KILL_AFTER = 7


def test_a_unit_the_recut_moves_goes_from_survivor_to_survivor(
    fast_recovery: FastRecoveryRun,
) -> None:
    run = fast_recovery
    # an event, not a timing: c's chain copy is at the coordinator
    kill = run.kill_after(
        KILL_AFTER, "c", ready=lambda: run.copy_kept("c", "chain"),
        what="no chain copy of c at the coordinator",
    )  # fmt: skip
    report = run.fit(seed=37, on_step=kill)
    assert run.killed == ["c"]

    assert report.steps == 16 and run.steps == list(range(16))
    assert report.training_plan is not None
    assert [s.devices[0] for s in report.training_plan.stages] == ["a", "b"]
    (fast,) = run.events("coordinator", "async_fast_recovery")
    assert fast["bounds"] == [0, 2, 4], fast  # one capacity each: two units a survivor
    sources = report.unit_sources
    assert sources == {0: "kept", 1: "peer", 2: "kept", 3: "chain@coordinator"}, sources

    # the survivors kept their state (only the keys went to the coordinator); the
    # coordinator carried c's unit 3 alone: a loads unit 0 and b units 2 from their
    # own snapshots, a fetches unit 1 from b
    sent = {n: run.events(n, "latest_state_sent") for n in ("a", "b")}
    assert all(len(s) == 1 and s[0]["kept"] is True for s in sent.values()), sent
    planned = run.fast_restore_planned()
    assert (planned["local"], planned["from_peers"], planned["from_coordinator"]) == (2, 1, 1)
    served = run.events("b", "units_served")
    assert [(e["owner"], e["start"], e["end"]) for e in served] == [("b", 1, 2)], served

    # unit 1 reached a bit for bit: the digest b logged when it stopped is the one a
    # logged when it resumed
    (resumed,) = run.events("a", "async_state_resumed")
    stopped = sent["b"][0]["digests"]
    started = resumed["digests"]
    assert isinstance(stopped, dict) and isinstance(started, dict)
    assert started["1"] == stopped["1"]
    assert resumed["updates"] == fast["resume_at"]
