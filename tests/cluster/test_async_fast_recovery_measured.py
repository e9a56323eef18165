"""FTPipeHD's fast recovery re-cuts the survivors over what the run measured (real
stages): an ``async-1f1b`` run with ``live_copies`` and a live re-partition that
looks every 2 mini-batches (and never moves: its gain threshold is out of reach)
loses its middle stage once b's chain copy is at c. The recovery's eq. 5 takes the
capacities the looks measured (the plan's ``eq5`` says so, and from which look);
the run finishes on the survivors, every mini-batch trained once. Waits are for
log events, each with a generous deadline.
"""

from __future__ import annotations

from tests._support.async_fast_recovery import FastRecoveryRun

KILL_AFTER = 7


def test_the_survivors_are_recut_over_the_capacities_the_looks_measured(
    fast_recovery: FastRecoveryRun,
) -> None:
    run = fast_recovery

    def ready_to_kill() -> bool:  # b's chain copy at c, a look that measured
        looks = [
            e for e in run.events("coordinator", "repartition_considered") if e.get("measured")
        ]
        return run.copy_kept("b", holder="c") and bool(looks)

    kill = run.kill_after(
        KILL_AFTER, "b", ready=ready_to_kill, what="no chain copy of b at c, or no look"
    )
    report = run.fit(seed=41, on_step=kill, repartition={"first": 2, "every": 2, "gain": 0.99})
    assert run.killed == ["b"]
    assert report.steps == 16 and run.steps == list(range(16))
    (fast,) = run.events("coordinator", "async_fast_recovery")
    eq5 = fast["eq5"]
    # the capacities the looks measured, of the two survivors, cut them
    assert isinstance(eq5, dict) and set(eq5["capacities"]) == {"a", "c"}, eq5
    assert all(c > 0 for c in eq5["capacities"].values())
    assert "after mini-batch" in eq5["capacities_from"]
    (recovery,) = report.recoveries
    assert recovery["eq5"]["capacities"] == eq5["capacities"]
    assert report.unit_sources[1] == "chain@c" and report.unit_sources[2] == "chain@c"
