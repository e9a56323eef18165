"""Eco-FL's plan of a pipeline client's MLP over its home's devices (pure)."""

from __future__ import annotations

import pytest

from zpipe._errors import ConfigError
from zpipe.federated.home_plan import (
    home_devices,
    home_period_s,
    mlp_profile,
    plan_home,
)
from zpipe.federated.model import MLPShape

DEEP = MLPShape(64, 32, 10, (32, 32))


def test_the_profile_counts_each_layers_multiply_accumulates() -> None:
    profile = mlp_profile(DEEP, [1, 5], s_per_mac=1.0)
    assert profile.num_units == 4 and profile.batch_sizes == (1, 5)
    assert profile.times(5) == [64 * 32 * 5, 32 * 32 * 5, 32 * 32 * 5, 32 * 10 * 5]
    assert profile.backward_times(1) == [2 * 64 * 32, 2 * 32 * 32, 2 * 32 * 32, 2 * 32 * 10]
    assert profile.output_bytes(5) == [4 * 32 * 5, 4 * 32 * 5, 4 * 32 * 5, 4 * 10 * 5]


def test_home_devices_are_named_by_class_and_scaled_by_its_speed() -> None:
    devices = home_devices(["nano", "nx", "nano"])
    assert [d.name for d in devices] == ["nano0", "nx0", "nano1"]
    assert devices[0].speed == pytest.approx(1 / 3) and devices[1].speed == 1.0
    with pytest.raises(ConfigError, match="unknown device class"):
        home_devices(["tpu"])


def test_a_heterogeneous_home_gets_an_uneven_partition_fastest_devices_heaviest() -> None:
    plan = plan_home(DEEP, home_devices(["nano", "tx2", "nx"]), 10)
    assert plan.schedule == "1f1b" and plan.num_stages == 3
    assert plan.microbatch_size * plan.num_microbatches == 10
    spans = {s.devices[0]: s.end - s.start for s in plan.stages}
    assert sorted(spans.values()) == [1, 1, 2]  # not even: 4 units on 3 devices
    assert spans["nano0"] == 1  # the slowest device holds one unit, never two
    assert [s.start for s in plan.stages] == [0, *[s.end for s in plan.stages[:-1]]]
    # 1F1B-Sync: warm-ups that never grow along the pipeline
    warmups = [s.warmup for s in plan.stages]
    assert warmups == sorted(warmups, reverse=True) and warmups[-1] >= 1


def test_more_devices_shorten_the_period_and_slow_ones_lengthen_it() -> None:
    nx = home_period_s(DEEP, ["nx"], 10)
    nano = home_period_s(DEEP, ["nano"], 10)
    assert nano == pytest.approx(3 * nx)
    three = home_period_s(DEEP, ["nx", "tx2", "nano"], 10)
    assert three <= home_period_s(DEEP, ["nx", "tx2"], 10) < nx
    # the first layer (64 x 32) bounds a home's period: 2 nx split 2048 | 2368 MACs,
    # 3 nx 2048 | 1024 | 1344
    assert home_period_s(DEEP, ["nx"] * 3, 10) < home_period_s(DEEP, ["nx"] * 2, 10)
    # the order is the planner's: any listing of one mix is one period
    assert home_period_s(DEEP, ["nano", "nx", "tx2"], 10) == three


def test_a_plan_needs_a_usable_batch_and_a_matching_profile() -> None:
    with pytest.raises(ConfigError, match="batch_size"):
        plan_home(DEEP, home_devices(["nx"]), 0)
    with pytest.raises(ConfigError, match="units"):
        plan_home(DEEP, home_devices(["nx"]), 4, profile=mlp_profile(MLPShape(64, 32, 10), [4]))


def test_the_micro_batch_sizes_tried_can_be_narrowed() -> None:
    devices = home_devices(["nx", "tx2", "nano"])
    # the analytic profile has no per-micro-batch overhead: small micro-batches win
    assert plan_home(DEEP, devices, 16).microbatch_size < 4
    narrowed = plan_home(DEEP, devices, 16, microbatch_sizes=[4, 8, 16])
    assert narrowed.microbatch_size == 4 and narrowed.num_microbatches == 4
    with pytest.raises(ConfigError, match="divides"):
        plan_home(DEEP, devices, 16, microbatch_sizes=[3, 5])
