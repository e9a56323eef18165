"""Super-neuron partitioning: EdgePipe Algorithm 1 and equation 1."""

from __future__ import annotations

import itertools

import pytest

from zpipe._errors import ConfigError
from zpipe.lossy.partition import (
    Allocation,
    apportion,
    hybrid_max_layers,
    partition,
    partition_horizontal,
    partition_hybrid,
    partition_layers,
    partition_naive,
    partition_vertical,
    split_range,
)

PAPER = [10, 8, 8, 8, 8, 10]


def test_paper_worked_example() -> None:
    # Section IV-A: L = 6, N = 6, M = floor(6 / floor(6/2)) = 2.
    alloc = partition_hybrid(PAPER, 6)
    assert hybrid_max_layers(6, 6) == 2
    assert alloc.allocated_layer == [[1, 2], [3, 4], [5, 6]]
    assert alloc.allocated_device == [2, 2, 2]
    assert alloc.max_layers_per_device == 2
    # "partition at the level of neurons equal to the number of devices"
    first, second = alloc.super_neurons[0], alloc.super_neurons[1]
    assert [(s.layer, s.start, s.stop) for s in first.slices] == [(0, 0, 5), (1, 0, 4)]
    assert [(s.layer, s.start, s.stop) for s in second.slices] == [(0, 5, 10), (1, 4, 8)]


@pytest.mark.parametrize(
    ("n_layers", "n_devices", "m"),
    [(6, 6, 2), (6, 4, 3), (6, 2, 6), (6, 3, 6), (6, 12, 1), (6, 8, 1), (5, 6, 1), (8, 6, 2)],
)
def test_equation_1(n_layers: int, n_devices: int, m: int) -> None:
    assert hybrid_max_layers(n_layers, n_devices) == m


def test_remaining_layers_go_to_the_output_end() -> None:
    # L = 7, N = 6: three groups of 2, the one extra layer to the last group.
    alloc = partition_hybrid([16] * 7, 6)
    assert alloc.allocated_layer == [[1, 2], [3, 4], [5, 6, 7]]
    assert sum(alloc.allocated_device) == 6


def test_two_or_three_devices_make_hybrid_horizontal() -> None:
    for n in (2, 3):
        alloc = partition_hybrid(PAPER, n)
        assert alloc.allocated_layer == [[1, 2, 3, 4, 5, 6]]
        assert alloc.allocated_device == [n]


def test_vertical_and_horizontal_are_the_special_cases() -> None:
    vertical = partition_vertical(PAPER, 6)
    assert vertical.allocated_layer == [[1], [2], [3], [4], [5], [6]]
    assert vertical.allocated_device == [1] * 6
    assert vertical.max_layers_per_device == 1
    horizontal = partition_horizontal(PAPER, 6)
    assert horizontal.allocated_layer == [[1, 2, 3, 4, 5, 6]]
    assert horizontal.allocated_device == [6]
    assert all(len(sn.slices) == 6 for sn in horizontal.super_neurons)
    naive = partition_naive(PAPER)
    assert naive.n_devices == 1 and naive.allocated_layer == [[1, 2, 3, 4, 5, 6]]
    assert partition("hybrid", PAPER, 6) == partition_hybrid(PAPER, 6)


def test_vertical_with_more_devices_shares_layers_and_with_fewer_groups_them() -> None:
    wide = partition_vertical([8] * 4, 8)
    assert wide.allocated_layer == [[1], [2], [3], [4]]
    assert wide.allocated_device == [2, 2, 2, 2]
    narrow = partition_vertical([8] * 6, 4)
    assert narrow.allocated_layer == [[1], [2], [3, 4], [5, 6]]
    assert narrow.allocated_device == [1, 1, 1, 1]


def test_device_counts_always_sum_to_the_devices() -> None:
    # Algorithm 1's rounding would give 2+2+2+2+3 = 11 here.
    alloc = partition_hybrid([16] * 6, 10)
    assert sum(alloc.allocated_device) == 10
    for n in range(1, 13):
        assert partition_hybrid([16] * 6, n).n_devices == n
    assert apportion([1, 1, 1, 1, 2], 10) == [2, 2, 2, 1, 3]  # largest remainder
    assert apportion([2, 2, 2], 6) == [2, 2, 2]


def test_partition_by_max_layers_groups_from_the_output_end() -> None:
    alloc = partition_layers([16] * 6, 6, 4)
    assert alloc.allocated_layer == [[1, 2], [3, 4, 5, 6]]
    assert partition_layers([16] * 6, 6, 6).allocated_layer == [[1, 2, 3, 4, 5, 6]]
    with pytest.raises(ConfigError, match="max_layers"):
        partition_layers([16] * 6, 6, 7)
    with pytest.raises(ConfigError, match="at least 6 devices"):
        partition_layers([16] * 6, 3, 1)


def test_split_range_is_balanced_and_covers() -> None:
    assert split_range(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert split_range(128, 6)[0] == (0, 22)
    with pytest.raises(ConfigError):
        split_range(2, 3)


def test_every_neuron_owned_once_and_owners_ordered() -> None:
    for kind in ("vertical", "hybrid", "horizontal"):
        alloc = partition(kind, [64, 128, 128, 128, 128, 10], 6)
        for layer, size in enumerate(alloc.layer_sizes):
            owners = alloc.owners(layer)
            assert owners[0][1].start == 0 and owners[-1][1].stop == size
            assert all(a[1].stop == b[1].start for a, b in itertools.pairwise(owners))


@pytest.mark.parametrize(
    ("sizes", "devices", "match"),
    [
        ([10, 8, 8], 0, "at least one device"),
        ([10], 2, "at least 2 layers"),
        ([], 2, "at least 2 layers"),
        ([10, 0, 8], 2, "positive integer"),
        ([10, 2.5, 8], 2, "positive integer"),
        ([4, 4, 3], 4, "without a neuron"),  # horizontal over 4 devices, 3 outputs
    ],
)
def test_bad_input_is_a_config_error(sizes: list[int], devices: int, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        partition("horizontal", sizes, devices)


def test_more_devices_than_neurons() -> None:
    with pytest.raises(ConfigError, match="without a neuron"):
        partition_hybrid([2, 2, 2, 2], 12)
    with pytest.raises(ConfigError, match="unknown allocation"):
        partition("diagonal", PAPER, 6)


def test_allocation_round_trips_through_json() -> None:
    alloc = partition_hybrid(PAPER, 6).with_devices([3, 1, 0, 5, 2, 4])
    again = Allocation.from_json(alloc.to_json())
    assert again == alloc
    assert again.owners(5) == [(2, alloc.owners(5)[0][1]), (4, alloc.owners(5)[1][1])]


def test_malformed_allocations_are_rejected() -> None:
    data = partition_hybrid(PAPER, 6).to_dict()
    with pytest.raises(ConfigError, match="distinct"):
        Allocation.from_dict({**data, "device_of": [0, 0, 1, 2, 3, 4]})
    broken = {**data, "super_neurons": data["super_neurons"][1:], "device_of": [0, 1, 2, 3, 4]}
    with pytest.raises(ConfigError, match="owned by nobody"):
        Allocation.from_dict(broken)
    with pytest.raises(ConfigError, match="malformed"):
        Allocation.from_dict({"kind": "hybrid"})
    with pytest.raises(ConfigError, match="JSON"):
        Allocation.from_json("{not json")
