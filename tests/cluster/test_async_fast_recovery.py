"""FTPipeHD's fast recovery of a real asynchronous pipeline (``consistency="fast"``).

Real stage processes on loopback (the session's a, b, c of
tests/cluster/test_async_recovery*.py): an ``async-1f1b`` run with ``live_copies``
(chain every 2 mini-batches, global every 4) whose middle stage is SIGKILLed once
its chain copy is held by the next stage. The run finishes; it resumed at the
first mini-batch whose loss had not come back (no mini-batch is trained twice or
skipped); every unit the survivors kept starts the resumed run with the weights
and optimizer state the survivor had when it stopped, bit for bit (the digests
the survivor logs when it stops and the resumed stage logs when it starts); and
the dead stage's units came from its chain copy at the next stage, peer to peer
(the new holder fetched it from there, or the holder loaded it in place). Waits
are for log events, each with a generous deadline.
"""

from __future__ import annotations

from typing import Any

from tests._support.async_fast_recovery import FastRecoveryRun

KILL_AFTER = 7  # b dies once this mini-batch's loss came back (and its chain copy is at c)


def test_a_killed_middle_stage_recovers_fast_from_its_chain_copy(
    fast_recovery: FastRecoveryRun,
) -> None:
    run = fast_recovery
    # b's chain copy at c (this run's) before the kill: an event, not a timing
    kill = run.kill_after(
        KILL_AFTER,
        "b",
        ready=lambda: run.copy_kept("b", "chain", "c"),
        what="no chain copy of b at c",
    )
    report = run.fit(seed=31, on_step=kill)
    assert run.killed == ["b"]

    # the run finished on the two survivors, every mini-batch trained once
    assert report.steps == 16 and run.steps == list(range(16))
    assert not run.events("coordinator", "replica_kept")  # no flush replica at all
    assert report.training_plan is not None
    assert [s.devices[0] for s in report.training_plan.stages] == ["a", "c"]
    (recovery,) = report.recoveries
    resumed_at = recovery["resumed_at"]
    assert recovery["dead"] == "b" and recovery["consistency"] == "fast"
    # resumed at the first mini-batch whose loss had not come back when b died: the
    # client counted its acknowledged losses, the coordinator resumed there, the
    # stages' weight versions go on from there
    assert KILL_AFTER < resumed_at <= 16 and recovery["resumed_from"] == resumed_at
    (fast,) = run.events("coordinator", "async_fast_recovery")
    assert fast["resume_at"] == resumed_at and fast["dead"] == ["b"]
    resumed = {n: run.events(n, "async_state_resumed") for n in ("a", "c")}
    assert all(len(r) == 1 and r[0]["updates"] == resumed_at for r in resumed.values())

    # the dead stage's units came from its chain copy at c, which c confirmed it held;
    # never through the coordinator: a fetched unit 1 from c (peer to peer, granted),
    # c loaded unit 2 in place
    assert {u: report.unit_sources[u] for u in (1, 2)} == {1: "chain@c", 2: "chain@c"}
    (confirmed,) = run.events("coordinator", "chain_copies_confirmed")
    assert confirmed["holders"] == ["c"]
    assert fast["bounds"] == [0, 2, 4], fast  # one capacity each: two units a survivor
    planned = run.fast_restore_planned()
    assert (planned["from_peers"], planned["from_coordinator"]) == (1, 0), planned
    served = run.events("c", "units_served")
    assert [(e["owner"], e["start"], e["end"]) for e in served] == [("b", 1, 2)], served
    assert recovery["progress_lost"] == report.progress_lost >= 1

    # the survivors' units: the state each had when it stopped, bit for bit
    stopped: dict[Any, Any] = {}
    updates: dict[str, int] = {}
    for name in ("a", "c"):
        (sent,) = run.events(name, "latest_state_sent")
        updates[name] = int(sent["updates"])
        stopped.update({(name, u): d for u, d in sent["digests"].items()})
    started = {u: d for r in resumed.values() for u, d in r[0]["digests"].items()}
    kept = [u for u, src in report.unit_sources.items() if src in ("kept", "peer")]
    assert sorted(kept) == [0, 3]
    owner = {0: "a", 3: "c"}
    for unit in kept:
        assert started[str(unit)] == stopped[(owner[unit], str(unit))], unit
        # a survivor behind the acknowledged count (the first stage updates last) loses
        # the updates it had not applied yet: the report says how many
        lost = max(0, resumed_at - updates[owner[unit]])
        assert recovery["lost_per_unit"].get(unit, 0) == lost, unit
