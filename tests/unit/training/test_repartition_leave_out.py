"""A live re-partition that leaves a device out (eq. 5's ``l = j``): the settings,
the decision and the controller after such a move (pure; see
:mod:`zpipe.training.repartition` and :mod:`zpipe.training.repartition_settings`)."""

from __future__ import annotations

import pytest

from zpipe._errors import ConfigError
from zpipe.coordinator.current_run import _decision
from zpipe.training.repartition import (
    RepartitionController,
    RepartitionSettings,
    decide_repartition,
)

DEVICES = ("a", "b", "c")
UNITS = [1.0] * 8


def counters(seconds: float, batches: int) -> dict[str, float]:
    return {"forward_s": seconds / 2, "backward_s": seconds / 2, "step_s": 0.0,
            "microbatches": batches}  # fmt: skip


def test_the_setting_is_off_by_default_and_sent_only_when_set() -> None:
    assert RepartitionSettings().leave_out is False
    assert "leave_out" not in RepartitionSettings().to_dict()
    on = RepartitionSettings(leave_out=True)
    assert on.to_dict()["leave_out"] is True
    assert RepartitionSettings.from_dict(on.to_dict()) == on
    # what a peer from before the setting sends still parses
    assert RepartitionSettings.from_dict({"first": 10, "every": 100, "gain": 0.1}) == (
        RepartitionSettings()
    )


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_leave_out_that_is_not_a_flag_is_refused(value: object) -> None:
    with pytest.raises(ConfigError, match="leave_out"):
        RepartitionSettings.from_dict({"leave_out": value})
    with pytest.raises(ConfigError, match="leave_out"):
        RepartitionSettings(leave_out=value)  # type: ignore[arg-type]


def decide(settings: RepartitionSettings, caps: dict[str, float], fixed: dict[str, float]):  # type: ignore[no-untyped-def]
    return decide_repartition(
        settings,
        at=10,
        devices=DEVICES,
        bounds=[0, 3, 6, 8],
        reference_unit_s=UNITS,
        capacities=caps,
        fixed_s=fixed,
    )


def test_a_device_too_slow_for_one_unit_is_left_out_only_when_the_setting_allows() -> None:
    caps, fixed = {"a": 1.0, "b": 50.0, "c": 1.0}, {"a": 1.0, "b": 50.0, "c": 1.0}
    kept = decide(RepartitionSettings(), caps, fixed)
    assert kept.devices is None and kept.bounds is not None and len(kept.bounds) == 4
    assert kept.left_out(DEVICES) == ()
    left = decide(RepartitionSettings(leave_out=True), caps, fixed)
    assert left.devices == ("a", "c") and left.bounds == (0, 4, 8)
    assert left.left_out(DEVICES) == ("b",) and "['b']" in left.reason
    assert left.new_period_s == pytest.approx(5.0)
    # b's units go to a and c, from b itself: the live holder, not a copy
    assert left.redistribution is not None
    moved = {
        (u, t.source, t.dest) for t in left.redistribution.transfers for u in range(t.start, t.end)
    }
    assert {(u, "b", d) for u, d in ((3, "a"), (4, "c"), (5, "c"))} <= moved
    # the decision survives a coordinator restart (the run's pending move)
    again = _decision(left.to_dict())
    assert again.devices == ("a", "c") and again.bounds == (0, 4, 8)


def test_a_small_gain_from_leaving_out_keeps_everyone() -> None:
    # b's one unit costs 2 + 2.5 = 4.5 against the others' 4: 11 % only, under 0.2
    caps, fixed = {"a": 1.0, "b": 2.0, "c": 1.0}, {"a": 0.0, "b": 2.5, "c": 0.0}
    small = decide(RepartitionSettings(leave_out=True, gain=0.2), caps, fixed)
    assert small.devices is None
    taken = decide(RepartitionSettings(leave_out=True, gain=0.1), caps, fixed)
    assert taken.devices == ("a", "c")


def test_the_controller_after_a_leave_out_looks_at_the_devices_kept_only() -> None:
    controller = RepartitionController(
        RepartitionSettings(leave_out=True, first=10, every=10, gain=0.05),
        devices=DEVICES,
        bounds=[0, 3, 6, 8],
        reference_unit_s=UNITS,
        output_bytes=[1e6] * 8,
        bandwidths_bps=[8e6, 2e6],
    )
    seconds = {"a": 3.0, "b": 300.0, "c": 2.0}  # b a hundred times slower per unit
    totals = {d: 10 * s for d, s in seconds.items()}
    decision = controller.look(10, {d: counters(totals[d], 10) for d in DEVICES})
    assert decision.devices == ("a", "c"), decision.reason
    epoch = controller.committed(decision)
    assert epoch == 1 and controller.devices == ("a", "c") and controller.bounds == (0, 4, 8)
    # the link a-c: the slower of a-b and b-c until the next probe
    assert controller.bandwidths_bps == [2e6]
    assert "b" not in controller.capacities
    assert set(controller.measured()[0]) == {"a", "c"}
    # the next look reads a and c alone; b's counters (it stays idle) are not asked for
    totals = {"a": totals["a"] + 10 * 4.0, "c": totals["c"] + 10 * 4.0}
    later = controller.look(20, {d: counters(totals[d], 20) for d in ("a", "c")})
    assert later.current == (0, 4, 8) and set(later.capacities) == {"a", "c"}
    with pytest.raises(ConfigError, match="links"):
        controller.links_measured([1e6, 1e6])
