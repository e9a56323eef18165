"""The timeslot pipeline: equation 2, Theorem 1 and the timeslot length of Table III."""

from __future__ import annotations

import pytest

from zpipe._errors import ConfigError
from zpipe.lossy.partition import partition, partition_hybrid, partition_layers
from zpipe.lossy.schedule import (
    data_within,
    device_schedule,
    events,
    max_message_values,
    pipeline_period,
    theorem1_timeslots,
    timeslot_ms,
    total_timeslots,
)

PAPER = [10, 8, 8, 8, 8, 10]
FMNIST = [784, 128, 128, 128, 128, 10]


def test_device_4_runs_the_papers_sequence() -> None:
    # Section V-A: Device 4 (SN[2, 2]) runs [stall, stall, FW3^1, FW4^1, BW4^0 (stall),
    # BW3^0 (stall), FW3^2, FW4^2, BW4^1, BW3^1, ...]
    rows = device_schedule(partition_hybrid(PAPER, 6), 3)
    assert rows[3][:10] == [".", ".", "F3:1", "F4:1", ".", ".", "F3:2", "F4:2", "B4:1", "B3:1"]
    # the output group answers its own forward pass at once (BW6^i after FW6^i)
    assert rows[5][:8] == [".", ".", ".", ".", "F5:1", "F6:1", "B6:1", "B5:1"]
    # the input group's last backward is a stall: it only runs B2
    assert rows[0][8:12] == ["F1:3", "F2:3", "B2:1", "."]


@pytest.mark.parametrize("kind", ["vertical", "hybrid", "horizontal", "naive"])
@pytest.mark.parametrize("n_data", [1, 2, 7, 50])
def test_theorem_1_timeslot_count(kind: str, n_data: int) -> None:
    alloc = partition(kind, PAPER, 6)
    horizontal = kind in ("horizontal", "naive")  # one group: no pipelining
    expected = theorem1_timeslots(6, alloc.max_layers_per_device, n_data, horizontal=horizontal)
    assert total_timeslots(alloc, n_data) == expected
    assert len(device_schedule(alloc, n_data)[0]) == expected


@pytest.mark.parametrize("n_layers", [3, 6, 8, 9])
@pytest.mark.parametrize("n_devices", [4, 6, 8])
def test_theorem_1_for_equal_groups(n_layers: int, n_devices: int) -> None:
    for m in range(1, n_layers + 1):
        if n_layers % m or n_layers // m > n_devices:
            continue
        alloc = partition_layers([16] * n_layers, n_devices, m)
        assert pipeline_period(alloc) == (2 * m if m < n_layers else 2 * n_layers - 1)
        assert total_timeslots(alloc, 9) == theorem1_timeslots(
            n_layers, m, 9, horizontal=m == n_layers
        )


def test_no_device_runs_two_passes_at_once_even_with_unequal_groups() -> None:
    alloc = partition_hybrid([16] * 6, 8)  # groups of 1, 1, 2, 2 layers
    assert alloc.allocated_layer == [[1], [2], [3, 4], [5, 6]]
    device_schedule(alloc, 20)  # raises if two passes collide


def test_every_pass_reads_what_was_sent_one_timeslot_before() -> None:
    # The receiver's deadline is the end of the sender's timeslot: it never waits longer.
    alloc = partition_hybrid(PAPER, 6)
    when = {(e.kind, e.layer, e.data): e.timeslot for e in events(alloc, 12)}
    for (kind, layer, data), t in when.items():
        if kind == "F" and layer > 0:
            assert when[("F", layer - 1, data)] == t - 1
        if kind == "B":
            before = ("F", layer, data) if layer == 5 else ("B", layer + 1, data)
            assert when[before] == t - 1


def test_timeslot_length_matches_table_iii() -> None:
    # Table III: Vertical 541.77 ms, Naive 441.42 ms exactly (the compute rate is
    # calibrated on Table II's 341.42 ms); Hybrid 311.33 and Horizontal 172.86 ms use
    # measured compute times our MAC-count model approximates within 3.5 %.
    lengths = {
        kind: timeslot_ms(partition(kind, FMNIST, 6))
        for kind in ("vertical", "hybrid", "horizontal", "naive")
    }
    assert lengths["vertical"] == pytest.approx(541.77, abs=0.01)
    assert lengths["naive"] == pytest.approx(441.42, abs=0.01)
    assert lengths["hybrid"] == pytest.approx(311.33, rel=0.035)
    assert lengths["horizontal"] == pytest.approx(172.86, rel=0.035)
    # equation 4's M_pkt: 784, 392, 131 for Vertical, Hybrid, Horizontal
    assert [
        max_message_values(partition(k, FMNIST, 6)) for k in ("vertical", "hybrid", "horizontal")
    ] == [784, 392, 131]


def test_data_within_a_budget() -> None:
    alloc = partition_hybrid(PAPER, 6)
    slot = 0.3
    for n in (1, 5, 40):
        budget = total_timeslots(alloc, n) * slot
        assert data_within(alloc, slot, budget + 1e-9) == n
        assert data_within(alloc, slot, budget + slot * (pipeline_period(alloc) - 1)) == n
    assert data_within(alloc, slot, 0.1) == 1
    with pytest.raises(ConfigError):
        total_timeslots(alloc, 0)
