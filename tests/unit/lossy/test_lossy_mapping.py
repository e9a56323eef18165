"""Neuron-to-device mapping: EdgePipe section IV-B and Algorithm 2."""

from __future__ import annotations

import numpy as np
import pytest

from zpipe._errors import ConfigError
from zpipe.lossy.mapping import (
    connectivity,
    map_devices,
    map_exhaustive,
    map_genetic,
    map_random,
    mapping_score,
    pass_counts,
)
from zpipe.lossy.partition import partition_hybrid, partition_vertical
from zpipe.lossy.radio import make_topology

PAPER = [10, 8, 8, 8, 8, 10]


def test_pass_counts_match_the_paper_example() -> None:
    counts = pass_counts(partition_hybrid(PAPER, 6))
    # "from Device 3 to Device 4 is 2; one forward pass and one backward pass"
    assert counts[2, 3] == 2
    # "the maximum ... is three, at Device 5-to-Device 6 and Device 6-to-Device 5"
    assert counts[4, 5] == counts[5, 4] == 3
    assert counts.max() == 3
    # the input layer computes nothing in backward: 1 -> 2 forward only
    assert counts[0, 1] == counts[1, 0] == 1
    # adjacent groups: forward 2 -> 3 one way, backward 3 -> 2 the other
    assert counts[0, 2] == counts[2, 0] == 1
    assert counts[0, 4] == 0 and np.all(np.diag(counts) == 0)
    snn = connectivity(partition_hybrid(PAPER, 6))
    assert snn.max() == 1.0 and snn[2, 3] == pytest.approx(2 / 3)


def test_vertical_graph_is_a_chain() -> None:
    counts = pass_counts(partition_vertical(PAPER, 6))
    for k in range(5):
        assert counts[k, k + 1] == 1  # forward
        assert counts[k + 1, k] == (1 if k >= 1 else 0)  # backward, none into the input


def test_score_is_hadamard_sum_under_reordering() -> None:
    rng = np.random.default_rng(0)
    snn, prr = rng.random((4, 4)), rng.random((4, 4))
    order = [2, 0, 3, 1]
    manual = sum(snn[i, j] * prr[order[i], order[j]] for i in range(4) for j in range(4))
    assert mapping_score(snn, prr, order) == pytest.approx(manual)


@pytest.mark.parametrize("n_devices", [4, 5, 6])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_genetic_reaches_the_exhaustive_optimum(n_devices: int, seed: int) -> None:
    alloc = partition_hybrid([12] * 6, n_devices)
    snn = connectivity(alloc)
    prr = make_topology(n_devices, 50.0, seed=seed).prr_measured
    best = mapping_score(snn, prr, map_exhaustive(snn, prr))
    found = mapping_score(snn, prr, map_genetic(snn, prr, seed=seed))
    assert found == pytest.approx(best)
    assert mapping_score(snn, prr, map_random(n_devices, seed=seed)) <= best + 1e-12


def test_exhaustive_beats_every_permutation_and_refuses_big_inputs() -> None:
    rng = np.random.default_rng(3)
    snn, prr = rng.random((5, 5)), rng.random((5, 5))
    best = mapping_score(snn, prr, map_exhaustive(snn, prr))
    for _ in range(50):
        assert mapping_score(snn, prr, rng.permutation(5)) <= best + 1e-12
    with pytest.raises(ConfigError, match="genetic"):
        map_exhaustive(np.zeros((9, 9)), np.zeros((9, 9)))


def test_mappings_are_seeded_permutations() -> None:
    rng = np.random.default_rng(1)
    snn, prr = rng.random((6, 6)), rng.random((6, 6))
    a = map_genetic(snn, prr, seed=7, generations=50)
    assert a == map_genetic(snn, prr, seed=7, generations=50)
    assert sorted(a) == list(range(6))
    assert sorted(map_random(6, seed=2)) == list(range(6))
    assert map_genetic(snn, prr, generations=0) == tuple(range(6))


def test_map_devices_places_super_neurons() -> None:
    alloc = partition_hybrid(PAPER, 6)
    topo = make_topology(6, 50.0, seed=4)
    mapped = map_devices(alloc, topo.prr_measured, method="exhaustive")
    assert sorted(mapped.device_of) == list(range(6))
    assert mapped.super_neurons == alloc.super_neurons
    with pytest.raises(ConfigError, match="unknown mapping"):
        map_devices(alloc, topo.prr_measured, method="annealing")
    with pytest.raises(ConfigError, match="link matrix"):
        map_devices(alloc, np.ones((4, 4)))
    with pytest.raises(ConfigError, match="shape"):
        map_genetic(np.ones((3, 3)), np.ones((4, 4)))
