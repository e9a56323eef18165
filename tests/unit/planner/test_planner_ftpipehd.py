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
