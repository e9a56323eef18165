"""FTPipeHD's dynamic partition (eqs. 1-7): the DP against brute force, and by hand."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from zpipe._errors import ConfigError
from zpipe.planner.ftpipehd import ftpipehd_partition, repartition_from_measurements


def brute_force_period(
    units: list[float], caps: list[float], sizes: list[float], links: list[float]
) -> float:
    n, total = len(caps), len(units)
    best = math.inf
    for cuts in itertools.combinations(range(1, total), n - 1):
        bounds = [0, *cuts, total]
        stages = [sum(units[bounds[i] : bounds[i + 1]]) * caps[i] for i in range(n)]
        comm = [2 * sizes[bounds[i + 1] - 1] / links[i] for i in range(n - 1)]
        best = min(best, max(stages + comm))
    return best


@pytest.mark.parametrize("seed", range(25))
def test_the_dp_finds_the_brute_force_optimum(seed: int) -> None:
    rng = random.Random(seed)
    total, n = rng.randint(2, 8), rng.randint(1, 4)
    n = min(n, total)
    units = [rng.uniform(0.01, 1.0) for _ in range(total)]
    caps = [rng.choice([1.0, 2.0, 10.0, rng.uniform(0.5, 5)]) for _ in range(n)]
    sizes = [rng.uniform(0, 5e6) for _ in range(total)]
    links = [rng.uniform(1e6, 5e7) for _ in range(n - 1)]
    got = ftpipehd_partition(units, capacities=caps, output_bytes=sizes, bandwidths_bps=links)
    assert got.period_s == pytest.approx(brute_force_period(units, caps, sizes, links))
    assert got.bounds[0] == 0 and got.bounds[-1] == total
    assert all(a < b for a, b in got.ranges)
    assert got.period_s == pytest.approx(max(got.stage_s + got.link_s))


def test_by_hand_equal_workers_split_evenly_and_a_slow_one_takes_less() -> None:
    units = [1.0] * 6
    assert ftpipehd_partition(units, num_stages=3).bounds == (0, 2, 4, 6)
    # worker 1 ten times slower: one unit for it, the rest shared by the others
    slow = ftpipehd_partition(units, capacities=[1.0, 10.0, 1.0])
    assert slow.bounds[2] - slow.bounds[1] == 1
    assert slow.period_s == pytest.approx(10.0)
    # a cut after unit 0 sends 4 MB over 1 MB/s (8 s both ways): avoided
    heavy = ftpipehd_partition(
        [1.0, 1.0, 1.0, 1.0],
        capacities=[1.0, 1.0],
        output_bytes=[4e6, 0, 0, 0],
        bandwidths_bps=[1e6],
    )
    assert heavy.bounds == (0, 2, 4) and heavy.link_s == (0.0,)


def test_repartition_from_measured_times_uses_eqs_1_to_3() -> None:
    # worker b measured 8 s for units [2, 4), which take 2 s on the reference: C = 4
    got = repartition_from_measurements(
        {"a": 2.0, "b": 8.0}, ["a", "b"], [0, 2, 4], [1.0, 1.0, 1.0, 1.0]
    )
    assert got.bounds == (0, 3, 4)
    assert got.stage_s == (3.0, 4.0)
    with pytest.raises(ConfigError, match="no measured time"):
        repartition_from_measurements({"a": 1.0}, ["a", "b"], [0, 2, 4], [1.0] * 4)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"capacities": [1.0, 0.0]}, "capacities"),
        ({"capacities": [1.0] * 5}, "cannot give"),
        ({}, "num_stages"),
        ({"num_stages": 2, "output_bytes": [1.0]}, "one entry per unit"),
        ({"num_stages": 2, "bandwidths_bps": [1.0, 2.0]}, "one entry per link"),
        ({"capacities": [1.0, 2.0], "num_stages": 3}, "2 capacities"),
    ],
)
def test_bad_inputs_are_named(kwargs: dict[str, object], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        ftpipehd_partition([1.0, 1.0, 1.0, 1.0], **kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------- leaving workers out


def brute_force_leave_out(
    units: list[float],
    caps: list[float],
    fixed: list[float],
    sizes: list[float],
    links: list[float],
) -> float:
    """Every ordered subset of workers and every cut over it; a skipped worker's link
    is the slowest hop it replaces."""
    n, total = len(caps), len(units)
    best = math.inf
    for count in range(1, min(n, total) + 1):
        for used in itertools.combinations(range(n), count):
            for cuts in itertools.combinations(range(1, total), count - 1):
                bounds = [0, *cuts, total]
                stages = [
                    fixed[w] + sum(units[bounds[i] : bounds[i + 1]]) * caps[w]
                    for i, w in enumerate(used)
                ]
                comm = [
                    2 * sizes[bounds[i + 1] - 1] / min(links[a:b])
                    for i, (a, b) in enumerate(itertools.pairwise(used))
                ]
                best = min(best, max(stages + comm))
    return best


@pytest.mark.parametrize("seed", range(25))
def test_leaving_out_finds_the_brute_force_optimum_over_workers_and_cuts(seed: int) -> None:
    rng = random.Random(seed)
    total, n = rng.randint(2, 7), rng.randint(2, 4)
    units = [rng.uniform(0.01, 1.0) for _ in range(total)]
    caps = [rng.choice([1.0, 2.0, 30.0, rng.uniform(0.5, 5)]) for _ in range(n)]
    fixed = [rng.choice([0.0, rng.uniform(0, 2)]) * c for c in caps]
    sizes = [rng.uniform(0, 5e6) for _ in range(total)]
    links = [rng.uniform(1e6, 5e7) for _ in range(n - 1)]
    n = min(n, total)
    caps, fixed, links = caps[:n], fixed[:n], links[: n - 1]
    kwargs = {"capacities": caps, "fixed_s": fixed, "output_bytes": sizes, "bandwidths_bps": links}
    everyone = ftpipehd_partition(units, **kwargs)  # type: ignore[arg-type]
    got = ftpipehd_partition(units, leave_out=True, **kwargs)  # type: ignore[arg-type]
    optimum = brute_force_leave_out(units, caps, fixed, sizes, links)
    assert got.period_s == pytest.approx(min(everyone.period_s, optimum))
    assert got.period_s <= everyone.period_s
    assert got.bounds[0] == 0 and got.bounds[-1] == total
    assert all(a < b for a, b in got.ranges)
    assert list(got.workers) == sorted(set(got.workers))
    assert got.period_s == pytest.approx(max(got.stage_s + got.link_s))
    if got.workers != tuple(range(n)):
        assert got.period_s < everyone.period_s  # a tie keeps everyone


def test_a_device_too_slow_for_even_one_unit_is_left_out() -> None:
    # worker 1 is 50 times slower and pays its own cost (1 unit's worth) per batch:
    # keeping one unit costs it 50 * (1 + 1) = 100, more than the others' whole share
    units = [1.0] * 8
    caps, fixed = [1.0, 50.0, 1.0], [1.0, 50.0, 1.0]
    kept = ftpipehd_partition(units, capacities=caps, fixed_s=fixed)
    assert kept.workers == (0, 1, 2) and kept.period_s == pytest.approx(100.0)
    left = ftpipehd_partition(units, capacities=caps, fixed_s=fixed, leave_out=True)
    assert left.workers == (0, 2) and left.left_out(3) == (1,)
    assert left.bounds == (0, 4, 8) and left.period_s == pytest.approx(5.0)
    assert left.stage_s == (5.0, 5.0)


def test_the_headline_setup_s_capacities_leave_the_slowed_device_out() -> None:
    # one quiet r24_middle run after d1 slowed tenfold (s per unit), F = 1.18 units
    caps = [0.0019, 0.0418, 0.0188, 0.0261]
    fixed = [c * 1.18 for c in caps]
    kept = ftpipehd_partition([1.0] * 24, capacities=caps, fixed_s=fixed)
    assert kept.bounds == (0, 18, 19, 22, 24)
    left = ftpipehd_partition([1.0] * 24, capacities=caps, fixed_s=fixed, leave_out=True)
    assert 1 not in left.workers
    assert left.period_s < 0.6 * kept.period_s


def test_a_tie_or_a_small_gain_keeps_everyone() -> None:
    # equal workers: leaving one out never helps, everyone stays
    even = ftpipehd_partition([1.0] * 6, capacities=[1.0] * 3, leave_out=True)
    assert even.workers == (0, 1, 2) and even.bounds == (0, 2, 4, 6)
    # one unit on each of two workers, the second 1.5 times slower: everyone gives
    # max(1, 1.5) = 1.5, worker 0 alone 2.0 (no gain), so both stay
    assert ftpipehd_partition([1.0, 1.0], capacities=[1.0, 1.5], leave_out=True).workers == (0, 1)
    # worker 1's one unit costs 2.5 + 2 = 4.5, the others' 4 units 4: leaving it out
    # gains 1 - 4 / 4.5 (11 %), taken at a gain of 0.1, not at 0.2
    units, caps, fixed = [1.0] * 8, [1.0, 2.0, 1.0], [0.0, 2.5, 0.0]
    gained = ftpipehd_partition(
        units, capacities=caps, fixed_s=fixed, leave_out=True, leave_out_gain=0.1
    )
    assert gained.workers == (0, 2) and gained.period_s == pytest.approx(4.0)
    small = ftpipehd_partition(
        units, capacities=caps, fixed_s=fixed, leave_out=True, leave_out_gain=0.2
    )
    assert small.workers == (0, 1, 2)


def test_a_skipped_worker_s_link_is_the_slower_of_the_two_it_replaces() -> None:
    units = [1.0] * 4
    caps, fixed = [1.0, 100.0, 1.0], [0.0, 100.0, 0.0]
    sizes = [1e6] * 4
    # the hops 0-1 and 1-2 at 8 and 2 MB/s: 0-2 costed at 2 MB/s, 2 * 1 MB / 2 MB/s = 1 s
    left = ftpipehd_partition(
        units,
        capacities=caps,
        fixed_s=fixed,
        output_bytes=sizes,
        bandwidths_bps=[8e6, 2e6],
        leave_out=True,
    )
    assert left.workers == (0, 2) and left.link_s == (pytest.approx(1.0),)
    # the pair measured at 0.25 MB/s: 8 s per batch on the link, so one worker alone
    # (4 s of compute, no link) is the shorter
    measured = ftpipehd_partition(
        units,
        capacities=caps,
        fixed_s=fixed,
        output_bytes=sizes,
        bandwidths_bps=[8e6, 2e6],
        leave_out=True,
        pair_bandwidths_bps={(0, 2): 0.25e6},
    )
    assert measured.workers in ((0,), (2,)) and measured.period_s == pytest.approx(4.0)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"leave_out_gain": 1.0}, "leave_out_gain"),
        ({"leave_out_gain": -0.1}, "leave_out_gain"),
        ({"pair_bandwidths_bps": {(1, 0): 1e6}}, "pair_bandwidths_bps"),
        ({"pair_bandwidths_bps": {(0, 2): 0.0}}, "pair_bandwidths_bps"),
        ({"pair_bandwidths_bps": {(0, 3): 1e6}}, "pair_bandwidths_bps"),
    ],
)
def test_bad_leave_out_settings_are_refused(kwargs: dict[str, object], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        ftpipehd_partition([1.0] * 4, capacities=[1.0] * 3, leave_out=True, **kwargs)  # type: ignore[arg-type]


def test_kept_ends_leave_out_middle_workers_only() -> None:
    # the headline's capacities: free to choose, eq. 5 keeps d0 and d2 (d3, the last,
    # out too); with the ends kept (the client's feed and sink) d1 alone is left out
    caps = [0.0019, 0.0418, 0.0188, 0.0261]
    fixed = [c * 1.18 for c in caps]
    free = ftpipehd_partition([1.0] * 24, capacities=caps, fixed_s=fixed, leave_out=True)
    assert free.workers == (0, 2)
    ends = ftpipehd_partition(
        [1.0] * 24, capacities=caps, fixed_s=fixed, leave_out=True, keep_ends=True
    )
    assert ends.workers == (0, 2, 3) and ends.bounds == (0, 22, 23, 24)
    assert ends.period_s == pytest.approx(0.0569, abs=1e-4)
    # a slow first worker is never left out with the ends kept
    slow_first = ftpipehd_partition(
        [1.0] * 6, capacities=[50.0, 1.0, 1.0], fixed_s=[50.0, 1.0, 1.0], leave_out=True,
        keep_ends=True,
    )  # fmt: skip
    assert slow_first.workers == (0, 1, 2)
    assert ftpipehd_partition(
        [1.0] * 6, capacities=[50.0, 1.0, 1.0], fixed_s=[50.0, 1.0, 1.0], leave_out=True
    ).workers == (1, 2)
