"""The re-partition controller's damping across looks: hysteresis and the window
after a move (pure; see :mod:`zpipe.training.repartition`)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from zpipe._errors import ConfigError
from zpipe.training.repartition import (
    RepartitionController,
    RepartitionSettings,
    decide_repartition,
)

DEVICES = ["a", "b", "c", "d"]


def counters(seconds: float, batches: int) -> dict[str, float]:
    return {"forward_s": seconds / 2, "backward_s": seconds / 2, "step_s": 0.0,
            "microbatches": batches}  # fmt: skip


def steady_run(
    settings: RepartitionSettings, capacities: Sequence[Sequence[float]], *, overhead: float = 0.0
) -> list[tuple[int, ...] | None]:
    """Looks every 10 batches of four stages over 12 units; look ``k``'s window runs
    at ``capacities[k]`` (each stage ``overhead + C * units`` per batch, no noise)."""
    controller = RepartitionController(
        settings, devices=DEVICES, bounds=[0, 3, 6, 9, 12], reference_unit_s=[1.0] * 12
    )
    total = dict.fromkeys(DEVICES, 0.0)
    out = []
    for look, caps in enumerate(capacities, start=1):
        b = controller.bounds
        for i, d in enumerate(DEVICES):
            total[d] += 10 * (overhead + caps[i] * (b[i + 1] - b[i]))
        decision = controller.look(10 * look, {d: counters(total[d], 10 * look) for d in DEVICES})
        if decision.moves:
            controller.committed(decision)
        out.append(decision.bounds)
    return out


def test_a_move_back_to_cuts_left_lately_needs_the_larger_gain() -> None:
    fine = dict(devices=["a", "b"], bounds=[0, 10, 20], reference_unit_s=[1.0] * 20)
    measured = {"a": 10.0, "b": 12.0}  # one unit less for b saves 1/12 of the period
    fresh = decide_repartition(RepartitionSettings(gain=0.05), at=3, measured_s=measured, **fine)
    assert fresh.bounds == (0, 11, 20)
    back = decide_repartition(
        RepartitionSettings(gain=0.05), at=3, measured_s=measured, left=[(0, 11, 20)], **fine
    )
    assert not back.moves and "back" in back.reason and "0.3" in back.reason
    # other cuts left lately do not hold this move back; nor does a lower revisit_gain
    elsewhere = decide_repartition(
        RepartitionSettings(gain=0.05), at=3, measured_s=measured, left=[(0, 9, 20)], **fine
    )
    assert elsewhere.bounds == (0, 11, 20)
    low = decide_repartition(
        RepartitionSettings(gain=0.05, revisit_gain=0.05),
        at=3,
        measured_s=measured,
        left=[(0, 11, 20)],
        **fine,
    )
    assert low.bounds == (0, 11, 20)


# capacities 10, 2, 5, 10; then b 5x slower from look 4; then b back from look 8
STEADY = [[10.0, 2.0, 5.0, 10.0]] * 3 + [[10.0, 10.0, 5.0, 10.0]] * 4 + [[10.0, 2.0, 5.0, 10.0]] * 4


@pytest.mark.parametrize("overhead", [0.0, 3.0])
def test_steady_measurements_decide_the_same_with_or_without_hysteresis(overhead: float) -> None:
    plain = RepartitionSettings(first=1, every=1, gain=0.1, revisit_looks=0)
    damped = RepartitionSettings(first=1, every=1, gain=0.1)
    without = steady_run(plain, STEADY, overhead=overhead)
    assert steady_run(damped, STEADY, overhead=overhead) == without
    moves = [m for m in without if m is not None]
    # it moves for b's slowdown and back to the first look's cuts when b recovers:
    # a real recovery promises more than revisit_gain, so the return is not held back
    assert len(moves) >= 3 and moves[-1] == moves[0]
    assert without[3] is not None and any(m is not None for m in without[7:])


def test_the_memory_of_cuts_left_lasts_revisit_looks_looks() -> None:
    # b's time swings 1.6x every other look (load): undamped, the cuts flip each look
    noise = [[1.0, 1.6 if k % 2 else 1.0, 1.0, 1.0] for k in range(10)]
    caps = [10.0, 2.0, 5.0, 10.0]

    def run(looks: int, radius: int = 0) -> list[tuple[int, ...] | None]:
        settings = RepartitionSettings(
            first=1, every=1, gain=0.1, smoothing=0.0, revisit_looks=looks, revisit_radius=radius
        )
        controller = RepartitionController(
            settings, devices=DEVICES, bounds=[0, 3, 6, 9, 12], reference_unit_s=[1.0] * 12
        )
        total = dict.fromkeys(DEVICES, 0.0)
        out = []
        for look, factors in enumerate(noise, start=1):
            b = controller.bounds
            for i, d in enumerate(DEVICES):
                total[d] += 10 * (2.0 + caps[i] * (b[i + 1] - b[i])) * factors[i]
            controller.tried.clear()  # no memory of measured periods: hysteresis alone
            decision = controller.look(
                10 * look, {d: counters(total[d], 10 * look) for d in DEVICES}
            )
            if decision.moves:
                controller.committed(decision)
            out.append(decision.bounds)
        return out

    assert sum(m is not None for m in run(0)) == 10
    assert sum(m is not None for m in run(10)) == 2
    three = run(3)
    # two moves, then the cuts left stay out of reach for three looks, then one return
    first_return = next(i for i, m in enumerate(three) if i > 1 and m is not None)
    assert first_return >= 1 + 3 and three[first_return] == three[0]
    # cuts one unit from cuts left count as a move back too: the second flip is held
    near = run(10, radius=1)
    assert sum(m is not None for m in near) == 1 and near[0] == three[0]


def test_swings_that_read_as_real_changes_do_not_wipe_the_memory_of_cuts_left() -> None:
    # b's time swings 2.5x every other look: beyond 1 + deviation, each swing reads
    # as a real change (capacities taken whole, measured periods forgotten)
    noise = [[1.0, 2.5 if k % 2 else 1.0, 1.0, 1.0] for k in range(10)]
    caps = [10.0, 2.0, 5.0, 10.0]

    def run(looks: int) -> list[tuple[tuple[int, ...] | None, float]]:
        settings = RepartitionSettings(
            first=1, every=1, gain=0.1, revisit_looks=looks, revisit_radius=0
        )
        controller = RepartitionController(
            settings, devices=DEVICES, bounds=[0, 3, 6, 9, 12], reference_unit_s=[1.0] * 12
        )
        total = dict.fromkeys(DEVICES, 0.0)
        out = []
        for look, factors in enumerate(noise, start=1):
            b = controller.bounds
            for i, d in enumerate(DEVICES):
                total[d] += 10 * (2.0 + caps[i] * (b[i + 1] - b[i])) * factors[i]
            decision = controller.look(
                10 * look, {d: counters(total[d], 10 * look) for d in DEVICES}
            )
            if decision.moves:
                controller.committed(decision)
            out.append((decision.bounds, decision.gain))
        return out

    undamped = run(0)
    assert all(m is not None for m, _ in undamped)
    # each return promises about 0.22: above gain, below revisit_gain
    assert all(0.1 < g < 0.3 for m, g in undamped[2::2])
    damped = run(10)
    assert sum(m is not None for m, _ in damped) == 2 and all(m is None for m, _ in damped[2:])


def test_a_move_decided_before_the_flush_counts_its_window_from_the_flush() -> None:
    settings = RepartitionSettings(first=10, every=10, gain=0.1)

    def second_look(rebase: bool) -> tuple[dict[str, float], float]:
        controller = RepartitionController(
            settings, devices=["a", "b"], bounds=[0, 4, 8], reference_unit_s=[1.0] * 8
        )
        # a 4x slower: 16 s per batch on 4 units against b's 4 s
        first = controller.look(10, {"a": counters(160, 10), "b": counters(40, 10)})
        assert first.moves and first.bounds is not None
        # the flush drains 3 more batches on the old cuts before the move
        drained = {"a": counters(160 + 3 * 16, 13), "b": counters(40 + 3 * 4, 13)}
        if rebase:
            controller.rebase(drained)
        controller.committed(first)
        a_units = first.bounds[1]
        b_units = 8 - a_units
        # ten batches on the new cuts (a still 4x slower)
        later = {
            "a": counters(160 + 48 + 10 * 4 * a_units, 23),
            "b": counters(40 + 12 + 10 * 1 * b_units, 23),
        }
        return controller.look(20, later).capacities, controller.costs.share()

    capacities, share = second_look(True)
    assert capacities == pytest.approx({"a": 4.0, "b": 1.0}) and share == 0.0
    # the old cuts' drained batches (more units per batch than the new cuts hold)
    # read as a large fixed cost per batch, which no stage has
    capacities, share = second_look(False)
    assert share > 0.5 and capacities["a"] != pytest.approx(4.0)


def test_the_hysteresis_settings_are_checked_and_round_trip() -> None:
    for bad in (
        {"revisit_gain": 1.0},
        {"revisit_gain": -0.1},
        {"revisit_looks": -1},
        {"revisit_radius": -1},
    ):
        with pytest.raises(ConfigError):
            RepartitionSettings(**bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        RepartitionSettings(revisit_looks=True)
    custom = RepartitionSettings(revisit_gain=0.5, revisit_looks=3, revisit_radius=0)
    assert RepartitionSettings.from_dict(custom.to_dict()) == custom
    # defaults stay off the wire: a coordinator from before refuses keys it does not know
    defaults = set(RepartitionSettings().to_dict())
    assert not {"revisit_gain", "revisit_looks", "revisit_radius"} & defaults


def test_a_look_with_nothing_new_measured_keeps_the_cuts_the_last_capacities_found() -> None:
    """A look right after another look's move (an early look, then the scheduled one
    two batches on) can find a window with no batch of some stage: the capacities
    measured before stand, not eq. 7's every-device-alike cuts."""
    controller = RepartitionController(
        RepartitionSettings(first=10, every=10, gain=0.1),
        devices=DEVICES,
        bounds=[0, 9, 10, 11, 12],
        reference_unit_s=[1.0] * 12,
    )
    caps = [1.0, 1.0, 2.0, 2.0]
    start = [9, 1, 1, 1]
    seen = {d: counters(10 * caps[i] * start[i], 10) for i, d in enumerate(DEVICES)}
    first = controller.look(10, seen)
    assert first.bounds == (0, 4, 8, 10, 12) and first.measured
    controller.committed(first)
    controller.rebase(seen)  # the move's flush: the next window starts here
    # two batches later only the first stages have done one on the new cuts
    b = controller.bounds
    now = dict(seen)
    for i, d in enumerate(DEVICES[:2]):
        now[d] = counters(seen[d]["forward_s"] * 2 + caps[i] * (b[i + 1] - b[i]), 11)
    again = controller.look(12, now)
    # eq. 7 would take the even cuts, neither run nor left lately
    assert not again.moves, again.reason
    assert again.measured and again.capacities == pytest.approx(first.capacities)
