"""FTPipeHD's fast recovery when a stage dies during a live re-partition's move (real
stages).

The session's a, b, c (tests/cluster/test_async_recovery*.py): an ``async-1f1b`` run
with ``live_copies`` (chain every 2, global every 4) and a re-partition forced at
mini-batch 8 (a takes b's first unit). b is SIGKILLed as soon as the coordinator
starts the move's fetches (once b's chain copy is at c): the move fails (or, if b
answered the commit before it died, completes), the run recovers fast on a and c
from what they hold (their committed units, or the move's if the commit reached
them first) and b's units from its copy, and finishes with every mini-batch
trained once. Waits are for log events, with generous deadlines.
"""

from __future__ import annotations

import threading

from tests._support.async_fast_recovery import FastRecoveryRun

MOVE_AT = 8


def test_a_death_during_a_live_move_recovers_fast(fast_recovery: FastRecoveryRun) -> None:
    run = fast_recovery
    stop = threading.Event()

    def on_step(step: int) -> None:
        if step == MOVE_AT - 2:
            # b's chain copy at c before the move (an event, not a timing)
            run.wait_for("no chain copy of b at c", lambda: run.copy_kept("b", holder="c"), 0.05)

    def kill_during_the_move() -> None:
        while not stop.is_set():
            if run.events("coordinator", "repartition_fetching"):
                run.kill("b")
                return
            stop.wait(0.02)

    def stop_watching() -> None:  # before the killed stage starts again
        stop.set()
        watcher.join(timeout=5)

    watcher = threading.Thread(target=kill_during_the_move, daemon=True)
    watcher.start()
    report = run.fit(
        seed=43, on_step=on_step, on_end=stop_watching,
        repartition={"first": MOVE_AT, "every": 1000, "gain": 0.0, "bounds": [0, 2, 3, 4]},
    )  # fmt: skip
    assert run.killed == ["b"]
    assert report.steps == 16 and run.steps == list(range(16))
    assert report.training_plan is not None
    assert [s.devices[0] for s in report.training_plan.stages] == ["a", "c"]
    (recovery,) = report.recoveries
    # resumed where the client's acknowledged losses end: at the move (or just past
    # it, had b answered the commit and a mini-batch gone through before it died)
    assert recovery["consistency"] == "fast" and recovery["resumed_at"] >= MOVE_AT
    (fast,) = run.events("coordinator", "async_fast_recovery")
    assert fast["dead"] == ["b"] and fast["resume_at"] == recovery["resumed_at"]
    # what a and c held came along (committed, or switched to the move's cuts); b's
    # units that no survivor held came from b's copies. Where the kill lands decides
    # which: before the commit reached anyone, after it reached a only, or after b
    # answered it too (the coordinator committed the move: b died on the new cuts)
    committed = any(e["run"] == fast["run"] for e in run.events("coordinator", "repartitioned"))
    assert fast["abandoned_move"] is (not committed)
    sources = report.unit_sources
    assert sources[0] == "kept" and sources[3] == "kept"
    assert sources[2] in ("chain@c", "global")
    if committed or fast["switched"] == ["a"]:  # a had taken unit 1: alive, kept
        assert sources[1] in ("kept", "peer")
    else:
        assert fast["switched"] == [] and sources[1] in ("chain@c", "global")
