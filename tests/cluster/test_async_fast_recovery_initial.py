"""FTPipeHD's fast recovery of a stage that died before its first copy (real stages).

The session's a, b, c (tests/cluster/test_async_recovery*.py): an ``async-1f1b``
run with ``live_copies`` whose first copies are due only after mini-batch 1,000,
over a 0-1 | b 1-3 | c 3-4. b is SIGKILLed after mini-batch 5: no copy of its
units exists anywhere (bench/ftpipehd.py --quick met this when its kill landed
before b's first chain copy reached c, and the fit failed with "no live holder has
units ... at any version"). The recovery restarts b's units from their initial
weights, built by their new holders from the model spec (nothing travels), bit
for bit the weights a fresh build has; the report names them ``initial`` with the
progress they lost, and the run finishes with every mini-batch trained once.
"""

from __future__ import annotations

from tests._support.async_fast_recovery import FastRecoveryRun
from tests._support.async_training import SPEC
from zpipe.training.async_fast_state import initial_state, unit_digests

KILL_AFTER = 5
NEVER = 1000  # the copies' period: none is made in this run


def test_a_stage_dead_before_any_copy_restarts_its_units_from_the_initial_weights(
    fast_recovery: FastRecoveryRun,
) -> None:
    run = fast_recovery
    report = run.fit(
        seed=41, on_step=run.kill_after(KILL_AFTER, "b"), chain_every=NEVER, global_every=NEVER
    )
    assert run.killed == ["b"]

    assert report.steps == 16 and run.steps == list(range(16))
    assert report.training_plan is not None
    assert [s.devices[0] for s in report.training_plan.stages] == ["a", "c"]
    assert not run.events("coordinator", "async_copy_kept")  # truly no copy
    (fast,) = run.events("coordinator", "async_fast_recovery")
    assert fast["bounds"] == [0, 2, 4], fast  # one capacity each: two units a survivor
    assert report.unit_sources == {0: "kept", 1: "initial", 2: "initial", 3: "kept"}
    resume_at = fast["resume_at"]
    assert fast["copies_used"] == {"initial": [1, 2]}
    (recovery,) = report.recoveries
    # b's units lose every acknowledged mini-batch (a survivor behind the count
    # loses the updates it had not applied: FTPipeHD's own inconsistency)
    lost = recovery["lost_per_unit"]
    assert (lost[1], lost[2]) == (resume_at, resume_at) and resume_at >= KILL_AFTER
    (warned,) = run.events("coordinator", "fast_initial_weights")
    assert warned["units"] == [1, 2] and warned["progress_lost"] == resume_at
    # nothing of b's travelled: each new holder built its unit itself
    planned = run.fast_restore_planned()
    assert (planned["from_peers"], planned["from_coordinator"]) == (0, 0)
    for name, unit in (("a", 1), ("c", 2)):
        (built,) = run.events(name, "initial_units_built")
        assert (built["start"], built["end"], built["owner"]) == (unit, unit + 1, "b")
        # bit for bit a fresh build's weights (no optimizer state yet), at the
        # acknowledged version with the units the survivor kept
        (resumed,) = run.events(name, "async_state_resumed")
        fresh = unit_digests(initial_state(SPEC, unit, unit + 1))
        assert resumed["digests"][str(unit)] == fresh[str(unit)]
        assert resumed["updates"] == resume_at
