"""A look given a stage's own speed verdict measures that device at its new speed, even
when its window holds 0-1 of the slow forwards (pure; see
:func:`zpipe.training.repartition_window.verdict_time`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import pytest

from zpipe.training.repartition import (
    RepartitionController,
    RepartitionDecision,
    RepartitionSettings,
)
from zpipe.training.repartition_window import SpeedVerdict, verdict_time, window_time

DEVICES = ["a", "b", "c", "d"]
EVEN = [0, 6, 12, 18, 24]
SETTINGS = RepartitionSettings(first=10, every=10, gain=0.1)

Speeds = Callable[[int, str], float]  # (mini-batch, device) -> seconds per unit
Verdicts = Callable[[RepartitionController], Mapping[str, SpeedVerdict]]


def _verdict(ratio: float, baseline_s: float, plan_epoch: int = 0) -> SpeedVerdict:
    return SpeedVerdict(step=19, ratio=ratio, baseline_s=baseline_s,
                        now_s=baseline_s * ratio, plan_epoch=plan_epoch)  # fmt: skip


def test_a_verdict_places_a_change_its_window_cannot_show() -> None:
    old = [1.0, 1.1, 0.9, 1.0, 1.0, 1.05]
    verdict = _verdict(5.0, 1.0)
    # one slow forward at the end: window_time sees no change and measures the old speed
    assert window_time(6.0 * 2, 6.0, 7, [*old, 5.0], limit=2.0).seconds == pytest.approx(2.0)
    # the verdict: the old forwards' median times its ratio (times compute over forwards)
    one = verdict_time(6.0 * 2, 6.0, 7, [*old, 5.0], verdict)
    assert one.seconds == pytest.approx(2 * 1.0 * 5.0) and one.changed
    # no slow forward in the window yet: the same
    assert verdict_time(12.0, 6.0, 6, old, verdict).seconds == pytest.approx(10.0)
    # MIN_SIDE slow forwards at its end: measured on them, not scaled again
    two = verdict_time(12.0, 6.0, 8, [*old, 5.2, 4.8], verdict)
    assert two.seconds == pytest.approx(2 * 5.0) and two.kept == 2
    # a window all after the change (its start past the onset): measured on it as it is
    assert verdict_time(12.0, 6.0, 3, [5.0, 5.5, 4.5], verdict).seconds == pytest.approx(10.0)
    # an old forward that waited for a core before a normal one is not the change
    hiccup = verdict_time(12.0, 6.0, 7, [1.0, 1.0, 6.0, 1.0, 1.0, 1.0, 5.0], verdict)
    assert hiccup.seconds == pytest.approx(10.0) and hiccup.kept == 6
    # a device that turned faster: the same, on the other side
    faster = verdict_time(12.0, 6.0, 5, [5.0, 5.0, 5.0, 5.0, 1.0], _verdict(0.2, 5.0))
    assert faster.seconds == pytest.approx(2 * 5.0 * 0.2)


@dataclass
class _Pipeline:
    """Four stages over 24 equal units: each mini-batch costs each device its units
    times ``speeds(mb, device)``, half of it the forward; the looks see cumulative
    counters and the forwards one by one, as a stage's profile reply gives them."""

    speeds: Speeds
    controller: RepartitionController = field(
        default_factory=lambda: RepartitionController(
            SETTINGS, devices=DEVICES, bounds=EVEN, reference_unit_s=[1.0] * 24
        )
    )
    mb: int = 0
    total: dict[str, float] = field(default_factory=lambda: dict.fromkeys(DEVICES, 0.0))
    forwards: dict[str, list[list[float]]] = field(default_factory=lambda: {d: [] for d in DEVICES})

    def look(self, at: int, verdicts: Verdicts | None = None) -> RepartitionDecision:
        c = self.controller
        for mb in range(self.mb, at):
            for i, d in enumerate(DEVICES):
                seconds = self.speeds(mb, d) * (c.bounds[i + 1] - c.bounds[i])
                self.total[d] += seconds
                self.forwards[d].append([mb, seconds / 2])
        self.mb = at
        counters = {d: {"forward_s": self.total[d] / 2, "backward_s": self.total[d] / 2,
                        "step_s": 0.0, "microbatches": at, "recent": self.forwards[d][-32:]}
                    for d in DEVICES}  # fmt: skip
        decision = c.look(at, counters, verdicts=None if verdicts is None else verdicts(c))
        if decision.moves:
            c.committed(decision)
        return decision


SLOWER = 5.0
BASE = {"a": 1.0, "b": 2.0, "c": 4.0, "d": 4.0}


def _slows(mb: int, device: str) -> float:
    """b turns 5x slower at mini-batch 19: the look at 20 holds one slow forward."""
    return BASE[device] * (SLOWER if device == "b" and mb >= 19 else 1.0)


def _b_slowed(c: RepartitionController) -> dict[str, SpeedVerdict]:
    # b's forward before: 2 s per unit over its 6 units, half of it the forward
    return {"b": _verdict(SLOWER, 6.0, c.plan_epoch)}


def _settled_cuts() -> tuple[int, ...] | None:
    """The cuts a look that saw only the slowed speeds picks."""
    settled = RepartitionController(
        SETTINGS, devices=DEVICES, bounds=EVEN, reference_unit_s=[1.0] * 24
    )
    caps = [1.0, 2.0 * SLOWER, 4.0, 4.0]
    best = settled.look(
        10,
        {d: {"forward_s": c * 6 * 10, "backward_s": 0.0, "step_s": 0.0, "microbatches": 10}
         for d, c in zip(DEVICES, caps, strict=True)},
    )  # fmt: skip
    return best.bounds


def test_a_look_right_after_a_verdict_moves_as_it_would_on_the_new_speed() -> None:
    plain = _Pipeline(_slows)
    assert plain.look(10).moves  # the first look: b's 2x known
    kept = plain.look(20)  # one slow forward of b: its old speed measured
    assert not kept.moves and kept.capacities["b"] == pytest.approx(2.0)
    late = plain.look(30)  # the window's change, ten slow mini-batches late
    assert late.moves

    told = _Pipeline(_slows)
    told.look(10)
    early = told.look(20, _b_slowed)
    assert told.controller.verdicts_taken == ["b"]
    assert early.capacities["b"] == pytest.approx(2.0 * SLOWER)
    assert early.bounds == late.bounds == _settled_cuts()
    # a later look is not affected: measured on its own window, b stays at its new
    # speed (not scaled again) and the cuts stay
    after = told.look(30)
    assert told.controller.verdicts_taken == []
    assert not after.moves and after.capacities["b"] == pytest.approx(2.0 * SLOWER)
    assert told.look(40).capacities["b"] == pytest.approx(2.0 * SLOWER)


def test_a_verdict_about_older_cuts_is_ignored() -> None:
    plain, told = _Pipeline(_slows), _Pipeline(_slows)
    for pipeline in (plain, told):
        pipeline.look(10)  # moves: plan epoch 1
    assert told.controller.plan_epoch == 1

    def stale(c: RepartitionController) -> dict[str, SpeedVerdict]:
        return {"b": _verdict(SLOWER, 6.0, c.plan_epoch - 1)}

    ignored = told.look(20, stale)
    assert told.controller.verdicts_taken == []
    assert ignored == plain.look(20)


def test_a_verdict_from_a_device_no_longer_looked_at_is_ignored() -> None:
    told = _Pipeline(_slows)
    told.look(10)
    decision = told.look(20, lambda c: {"e": _verdict(SLOWER, 6.0, c.plan_epoch)})
    assert told.controller.verdicts_taken == [] and not decision.moves


BASE_RECOVERS = {"a": 1.0, "b": 3.0, "c": 1.0, "d": 1.0}


def _recovers(mb: int, device: str) -> float:
    """b starts 3x slow and recovers at mini-batch 29: the look at 30 holds one fast
    forward, and the even cuts it should go back to are the cuts it left."""
    return 1.0 if device == "b" and mb >= 29 else BASE_RECOVERS[device]


def _b_recovered(c: RepartitionController) -> dict[str, SpeedVerdict]:
    # b's forward before: 3 s per unit over its 2 units, half of it the forward
    return {"b": _verdict(1.0 / 3.0, 3.0, c.plan_epoch)}


def test_a_verdict_lifts_the_hysteresis_against_cuts_left_at_the_old_speed() -> None:
    plain = _Pipeline(_recovers)
    assert plain.look(10).moves  # away from the even cuts: b is slow
    assert not plain.look(20).moves
    plain.look(30)
    # the window shows b's recovery at 40, but the even cuts were left lately and
    # promise less than revisit_gain: the pipeline stays on cuts for the old speed
    stuck = plain.look(40)
    assert stuck.capacities["b"] == pytest.approx(1.0)
    assert not stuck.moves and "left lately" in stuck.reason

    told = _Pipeline(_recovers)
    told.look(10)
    told.look(20)
    back = told.look(30, _b_recovered)
    assert back.bounds == tuple(EVEN)
    assert not told.look(40).moves
