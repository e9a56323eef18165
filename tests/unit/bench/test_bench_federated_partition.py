"""bench/_federated_partition.py (Eco-FL Fig. 12 in small): the plans it compares and
its section in bench/federated.py, without stage processes."""

from __future__ import annotations

import argparse

import pytest

import bench._federated_partition as part
import bench.federated as fed


def test_the_even_cut_halves_the_work_as_if_the_devices_were_alike() -> None:
    assert part.even_cut([1.0, 8.0, 8.0, 8.0, 0.1]) == 2  # 9 | 16.1, not 17 | 8.1
    assert part.even_cut([1.0, 1.0]) == 1
    assert part.even_cut([5.0, 1.0, 1.0, 1.0, 1.0, 1.0]) == 1


def test_eco_fl_gives_the_faster_device_more_and_is_predicted_ahead() -> None:
    ecofl, even, devices = part.plans(4.0)
    assert [d.name for d in devices] == ["tx20", "nano0"]
    # same devices, order and micro-batches; only the cut differs
    assert [s.devices for s in ecofl.stages] == [s.devices for s in even.stages]
    assert ecofl.num_microbatches == even.num_microbatches
    assert [s.warmup for s in ecofl.stages] == [s.warmup for s in even.stages]
    tx2 = next(s for s in ecofl.stages if s.devices == ("tx20",))
    tx2_even = next(s for s in even.stages if s.devices == ("tx20",))
    assert tx2.num_units > tx2_even.num_units
    assert ecofl.predicted["samples_per_s"] > 1.3 * even.predicted["samples_per_s"]


def test_utilisation_is_compute_over_training_time() -> None:
    stages = {"tx20": {"forward_s": 1.0, "backward_s": 2.0}, "nano0": {"forward_s": 0.5}}
    assert part.utilisation(stages, 4.0) == {"tx20": 0.75, "nano0": 0.125}


@pytest.mark.parametrize(
    "bad", [["--pipeline-partition-steps", "3"], ["--pipeline-partition-scale", "0"]]
)
def test_bad_flags_are_refused(bad: list[str]) -> None:
    p = argparse.ArgumentParser()
    part.add_flags(p)
    with pytest.raises(SystemExit):
        part.check_flags(p, p.parse_args(bad))


def test_bench_federated_runs_the_section_unless_skipped() -> None:
    assert fed.pipeline_partition_section is part.pipeline_partition_section
