"""A look's window measured mini-batch by mini-batch: a change of speed inside it, and
a median that load does not drag (pure; see :mod:`zpipe.training.repartition_window`)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from zpipe.training.repartition import RepartitionController, RepartitionSettings
from zpipe.training.repartition_window import change_point, window_time

DEVICES = ["a", "b", "c", "d"]
LIMIT = 2.0
FACTOR = 5.0  # how much slower b turns in _looks
EVEN = [0, 6, 12, 18, 24]


def test_a_change_of_speed_is_found_where_it_happened() -> None:
    assert change_point([1.0, 1.1, 0.9, 1.0, 10.0, 9.5, 10.2], LIMIT) == 4
    assert change_point([10.0, 9.0, 11.0, 1.0, 1.1], LIMIT) == 3  # faster again
    # the change at the window's end still has MIN_SIDE mini-batches after it
    assert change_point([1.0, 1.0, 1.0, 1.0, 1.0, 10.0, 10.0], LIMIT) == 5


@pytest.mark.parametrize(
    "series",
    [
        [1.0, 1.2, 0.9, 1.1, 1.3, 0.8],  # noise
        [1.0, 1.0, 1.0, 9.0, 1.0, 1.0],  # one mini-batch waited for a core
        [1.0, 1.0, 1.0, 1.0, 1.0, 9.0],  # the same at the end: one after is not a change
        [1.0, 1.0, 1.0, 1.0, 1.5, 1.8],  # slower, but less than the limit
        [1.0, 1.0, 1.0, 10.0, 1.0, 10.0, 1.0],  # back on the old side after it: load
        [1.0, 10.0, 1.0],  # too short to split
    ],
)
def test_noise_spikes_and_small_drifts_are_no_change(series: Sequence[float]) -> None:
    assert change_point(series, LIMIT) is None


def test_a_window_that_holds_a_change_is_measured_after_it() -> None:
    series = [1.0] * 6 + [10.0] * 4
    mixed = window_time(sum(series) * 1.1, sum(series), 10, series, limit=LIMIT)
    assert mixed.changed and mixed.kept == 4
    # the step (a tenth of the spans here) scales with the rest
    assert mixed.seconds == pytest.approx(11.0)
    assert sum(series) * 1.1 / 10 == pytest.approx(5.06)  # what the counters' mean says


def test_a_window_without_a_change_is_its_median_not_its_mean() -> None:
    series = [1.0, 1.0, 1.0, 6.0, 1.0, 1.0, 1.0, 1.0]  # one mini-batch waited for a core
    found = window_time(sum(series), sum(series), 8, series, limit=LIMIT)
    assert not found.changed and found.seconds == pytest.approx(1.0)


def test_without_mini_batches_one_by_one_the_counters_mean_stands() -> None:
    assert window_time(8.0, 6.0, 4, None, limit=LIMIT).seconds == 2.0
    assert window_time(8.0, 6.0, 4, [1.5, 1.5], limit=LIMIT).seconds == 2.0  # too few
    assert window_time(8.0, 0.0, 4, [1.5] * 4, limit=LIMIT).seconds == 2.0  # no spans
    # only the window's last mini-batches count
    assert window_time(4.0, 4.0, 4, [9.0] * 10 + [1.0] * 4, limit=LIMIT).seconds == 1.0
    with pytest.raises(ValueError):
        window_time(0.0, 0.0, 4, None, limit=LIMIT)


def _looks(recent: bool) -> tuple[RepartitionController, tuple[int, ...] | None]:
    """Four stages over 24 equal units at capacities 1, 2, 4, 4; b turns 5x slower
    after the 4th of the second window's ten mini-batches. The second look's
    decision, with or without the mini-batches one by one."""
    controller = RepartitionController(
        RepartitionSettings(first=10, every=10, gain=0.1),
        devices=DEVICES,
        bounds=EVEN,
        reference_unit_s=[1.0] * 24,
    )
    caps = {"a": 1.0, "b": 2.0, "c": 4.0, "d": 4.0}
    total = dict.fromkeys(DEVICES, 0.0)
    series: dict[str, list[list[float]]] = {d: [] for d in DEVICES}

    def run(first: int, count: int, slow_after: int | None) -> None:
        b = controller.bounds
        for mb in range(first, first + count):
            for i, d in enumerate(DEVICES):
                cap = caps[d]
                if d == "b" and slow_after is not None and mb - first >= slow_after:
                    cap *= FACTOR
                seconds = cap * (b[i + 1] - b[i])
                total[d] += seconds
                series[d].append([mb, seconds / 2])  # its forward: half

    def counters(at: int) -> dict[str, dict[str, object]]:
        out: dict[str, dict[str, object]] = {}
        for d in DEVICES:
            c: dict[str, object] = {"forward_s": total[d] / 2, "backward_s": total[d] / 2,
                                    "step_s": 0.0, "microbatches": at}  # fmt: skip
            if recent:
                c["recent"] = series[d][-32:]
            out[d] = c
        return out

    run(0, 10, None)
    first = controller.look(10, counters(10))
    if first.moves:
        controller.committed(first)
    run(10, 10, 4)
    second = controller.look(20, counters(20))
    return controller, second.bounds


def test_a_look_whose_window_holds_the_change_moves_in_one_step_to_the_right_cuts() -> None:
    controller, moved = _looks(recent=True)
    assert controller.changed_in_window == ["b"]
    # what a look over the slowed speeds alone picks
    settled = RepartitionController(
        RepartitionSettings(first=10, every=10, gain=0.1),
        devices=DEVICES,
        bounds=EVEN,
        reference_unit_s=[1.0] * 24,
    )
    best = settled.look(
        10,
        {d: {"forward_s": c * 6 * 10, "backward_s": 0.0, "step_s": 0.0, "microbatches": 10}
         for d, c in zip(DEVICES, [1.0, 10.0, 4.0, 4.0], strict=True)},
    )  # fmt: skip
    assert moved is not None and moved == best.bounds
    assert controller.decisions[-1].capacities["b"] == pytest.approx(10.0)
    # the counters' mean alone (an older stage) mixes the speeds: b keeps more units,
    # and the pipeline runs slower than on the cuts of one step
    mixed_controller, mixed = _looks(recent=False)
    assert mixed_controller.decisions[-1].capacities["b"] < 7.5
    assert mixed is not None and mixed[2] - mixed[1] > moved[2] - moved[1]
    slowed = [1.0, 10.0, 4.0, 4.0]
    assert _period(mixed, slowed) > _period(moved, slowed)


def _period(bounds: Sequence[int], caps: Sequence[float]) -> float:
    return max(c * (bounds[i + 1] - bounds[i]) for i, c in enumerate(caps))
