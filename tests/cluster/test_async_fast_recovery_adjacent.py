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

from tests._support.async_fast_recovery import FastRecoveryRun

KILL_AFTER = 7


def test_two_adjacent_deaths_restore_the_first_from_the_global_copy(
    fast_recovery: FastRecoveryRun,
) -> None:
    run = fast_recovery

    def dead() -> set[object]:
        return {e["stage"] for e in run.events("coordinator", "stage_dead")}

    def on_step(step: int) -> None:
        if step >= KILL_AFTER and not run.killed:
            # events, not timings: b's global copy and c's chain copy are here
            run.wait_for("no global copy of b", lambda: run.copy_kept("b", "global"))
            run.wait_for("no chain copy of c", lambda: run.copy_kept("c", "chain"))
            run.kill("b", "c")
            # both seen dead before the client goes on, so that one resume names both
            run.wait_for("b and c not seen dead", lambda: {"b", "c"} <= dead())

    report = run.fit(seed=37, on_step=on_step)
    assert run.killed == ["b", "c"]

    assert report.steps == 16 and run.steps == list(range(16))
    assert report.training_plan is not None
    assert [s.devices[0] for s in report.training_plan.stages] == ["a"]
    fast = run.events("coordinator", "async_fast_recovery")
    assert fast and sorted(fast[-1]["dead"]) == ["b", "c"]
    # b's chain copy died with c: the coordinator's global copy; c's own chain copy
    # is the coordinator's (the last stage's)
    assert report.unit_sources[0] == "kept"
    assert {u: report.unit_sources[u] for u in (1, 2)} == {1: "global", 2: "global"}
    assert report.unit_sources[3] in ("chain@coordinator", "global")
    assert not run.events("coordinator", "chain_copies_confirmed")  # nothing was asked of a stage
    assert report.progress_lost >= 1
