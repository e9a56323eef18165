"""A fast recovery's re-cut of the survivors by eq. 5 over what the run measured
(zpipe.recovery.fast_recovery_inputs, fed to zpipe.recovery.fast_recovery): a slow
survivor gets fewer units, a slow link moves a cut, and without measurements the
rule before any look (every capacity 1, links free). Pure: measurements in, plans
out."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from zpipe._errors import ConfigError
from zpipe.planner.ftpipehd import ftpipehd_partition
from zpipe.recovery.fast_recovery import FastRecoveryPlan, plan_fast_recovery
from zpipe.recovery.fast_recovery_inputs import (
    UNMEASURED,
    PipelineMeasurements,
    eq5_inputs,
)
from zpipe.recovery.live_copies import CopyLedger, CopyRecord, chain_holder
from zpipe.recovery.spans import COORDINATOR, StageSpan
from zpipe.training.repartition import RepartitionController, RepartitionSettings

ORDER = ["a", "b", "c", "d"]
# a | b | c | d, three units each
SPANS = [StageSpan((d,), 3 * i, 3 * i + 3) for i, d in enumerate(ORDER)]
UNITS = (1.0,) * 12


def ledger() -> CopyLedger:
    out = CopyLedger()
    for s in SPANS:
        owner = s.devices[0]
        out.record(CopyRecord(owner, "chain", chain_holder(ORDER, owner), 0, 20, s.start, s.end))
        out.record(CopyRecord(owner, "global", COORDINATOR, 0, 20, s.start, s.end))
    return out


def recover(dead: list[str], measured: PipelineMeasurements) -> FastRecoveryPlan:
    survivors = [d for d in ORDER if d not in dead]
    inputs = eq5_inputs(survivors, measured)
    plan = plan_fast_recovery(
        SPANS,
        dead,
        ledger=ledger(),
        updates=dict.fromkeys(survivors, 24),
        acknowledged=24,
        **inputs.kwargs(),
    )
    return replace(plan, inputs=inputs.report)


def test_a_slow_survivor_gets_fewer_units() -> None:
    blind = recover(["b"], PipelineMeasurements(UNITS))
    assert blind.bounds == (0, 4, 8, 12)  # the rule before any look: 1 each
    assert blind.inputs["capacities"] is None and blind.inputs["capacities_from"] == UNMEASURED
    # the looks measured c three times slower than a and d (C_i: seconds per reference s)
    measured = PipelineMeasurements(
        UNITS, {"a": 1.0, "b": 1.0, "c": 3.0, "d": 1.0}, capacity_source="looks"
    )
    plan = recover(["b"], measured)
    assert plan.bounds == ftpipehd_partition(list(UNITS), capacities=[1.0, 3.0, 1.0]).bounds
    per_stage = {s.devices[0]: s.end - s.start for s in plan.spans}
    assert (
        per_stage["c"] < 4 and per_stage["c"] < per_stage["a"] and per_stage["c"] < per_stage["d"]
    )
    assert plan.period_s < blind.period_s * 3  # c at 4 units would take 12 s a batch
    # the report says which capacities cut the survivors, and from where
    summary = json.loads(json.dumps(plan.summary()))
    assert summary["eq5"]["capacities"] == {"a": 1.0, "c": 3.0, "d": 1.0}
    assert summary["eq5"]["capacities_from"] == "looks"
    assert FastRecoveryPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_a_survivors_own_cost_per_batch_comes_with_its_capacity() -> None:
    measured = PipelineMeasurements(
        UNITS, dict.fromkeys(ORDER, 1.0), fixed_s={"a": 0.0, "c": 2.0, "d": 0.0}
    )
    plan = recover(["b"], measured)
    expected = ftpipehd_partition(list(UNITS), capacities=[1.0] * 3, fixed_s=[0.0, 2.0, 0.0])
    assert plan.bounds == expected.bounds != (0, 4, 8, 12)
    assert plan.inputs["fixed_s"] == {"a": 0.0, "c": 2.0, "d": 0.0}


def test_a_survivor_without_a_measured_capacity_falls_back_to_one_each() -> None:
    # a look measures every stage or none; a capacity missing (or absurd) for one
    # survivor must not skew the others': the rule before any look, said so
    for caps in ({"a": 1.0, "c": 3.0}, {"a": 1.0, "c": 3.0, "d": 0.0},
                 {"a": 1.0, "c": math.nan, "d": 1.0}):  # fmt: skip
        plan = recover(["b"], PipelineMeasurements(UNITS, caps, fixed_s={"c": 5.0}))
        assert plan.bounds == (0, 4, 8, 12)
        assert plan.inputs["capacities"] is None
        assert plan.inputs["capacities_from"] == UNMEASURED
        assert "fixed_s" not in plan.inputs
    plan = recover(["b"], PipelineMeasurements(UNITS, {"a": 1.0, "c": 3.0}))
    assert plan.inputs["capacities_unmeasured"] == ["d"]


# unit 3's output crosses the a|c cut if it stays at 4: big, and the a-c link slow
BIG = [1e3, 1e3, 1e3, 4e6] + [1e3] * 8


def test_a_slow_link_between_new_neighbours_moves_the_cut() -> None:
    free = recover(["b"], PipelineMeasurements(UNITS, output_bytes=tuple(BIG)))
    assert free.bounds == (0, 4, 8, 12)  # without a link speed: as compute says
    assert free.inputs["links_mbit_s"] is None and "no bandwidth" in free.inputs["links_from"]
    fast_links = {("a", "c"): 1e9, ("c", "d"): 1e9}
    fast = recover(["b"], PipelineMeasurements(UNITS, output_bytes=tuple(BIG), links=fast_links))
    assert fast.bounds == (0, 4, 8, 12)
    # 2 x 4 MB over 1 MB/s is 8 s a batch at cut 4: the cut moves off unit 3's output
    slow_links = {("c", "a"): 1e6, ("c", "d"): 1e9}  # either direction's entry serves
    slow = recover(
        ["b"],
        PipelineMeasurements(
            UNITS,
            output_bytes=tuple(BIG),
            links=slow_links,
            link_sources={("c", "a"): "declared", ("c", "d"): "measured"},
        ),
    )
    assert slow.bounds[1] != 4 and slow.period_s < 8.0
    assert (
        slow.bounds
        == ftpipehd_partition(
            list(UNITS), num_stages=3, output_bytes=BIG, bandwidths_bps=[1e6, 1e9]
        ).bounds
    )
    assert slow.inputs["links_mbit_s"] == {"a>c": 8.0, "c>d": 8000.0}
    assert slow.inputs["links_from"] == {"a>c": "declared", "c>d": "measured"}


def test_links_are_left_out_when_boundary_sizes_are_unknown() -> None:
    plan = recover(["b"], PipelineMeasurements(UNITS, links={("a", "c"): 1.0}))
    assert plan.bounds == (0, 4, 8, 12)
    assert plan.inputs["links_mbit_s"] is None
    assert plan.inputs["links_from"] == "no boundary sizes: links not costed"


def test_malformed_measurements_are_refused() -> None:
    with pytest.raises(ConfigError, match="at least one survivor"):
        eq5_inputs([], PipelineMeasurements(UNITS))
    with pytest.raises(ConfigError, match="reference unit times"):
        eq5_inputs(["a"], PipelineMeasurements((1.0, 0.0)))
    with pytest.raises(ConfigError, match="2 boundary sizes for 12 units"):
        eq5_inputs(["a", "c"], PipelineMeasurements(UNITS, output_bytes=(1.0, 2.0)))


def counters(per_batch_s: float, batches: int) -> dict[str, float]:
    seconds = per_batch_s * batches
    return {"forward_s": seconds / 3, "backward_s": 2 * seconds / 3, "step_s": 0.0,
            "microbatches": batches}  # fmt: skip


def test_the_controller_gives_what_its_looks_measured() -> None:
    controller = RepartitionController(
        RepartitionSettings(first=1, every=1, gain=0.9),  # never moves: only measures
        devices=ORDER,
        bounds=[0, 3, 6, 9, 12],
        reference_unit_s=list(UNITS),
        output_bytes=BIG,
        bandwidths_bps=[1e9, 2e9, 3e9],
    )
    assert controller.measured() == ({}, {})  # no look yet
    assert controller.links_by_pair() == {("a", "b"): 1e9, ("b", "c"): 2e9, ("c", "d"): 3e9}
    # c takes three times as long for the same three units
    controller.look(10, {d: counters(9.0 if d == "c" else 3.0, 10) for d in ORDER})
    caps, fixed = controller.measured()
    assert set(caps) == set(ORDER)
    assert caps["c"] == pytest.approx(3 * caps["a"]) and caps["a"] == pytest.approx(caps["d"])
    assert fixed == {d: pytest.approx(c * controller.costs.share()) for d, c in caps.items()}
    # b dies: the survivors' eq. 5 from these, c gets the fewest units
    plan = recover(["b"], PipelineMeasurements(UNITS, caps, fixed))
    per_stage = {s.devices[0]: s.end - s.start for s in plan.spans}
    assert per_stage["c"] == min(per_stage.values()) < 4
    blind = RepartitionController(
        RepartitionSettings(), devices=ORDER, bounds=[0, 3, 6, 9, 12], reference_unit_s=UNITS
    )
    assert blind.links_by_pair() == {}
