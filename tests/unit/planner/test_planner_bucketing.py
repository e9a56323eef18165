"""Bucketing measured speeds and bandwidths for PipeEdge's category DP, and its certified
bound against the exact optimum."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

import zpipe.planner.pipeedge as pipeedge
from zpipe._errors import ConfigError
from zpipe.cli.plan import main as plan_main
from zpipe.client.options import InferOptions
from zpipe.client.runs.inference import inference_request
from zpipe.coordinator.planning import bucketing_of
from zpipe.models import ModelSpec
from zpipe.planner import (
    CLIENT,
    ClusterDevice,
    ClusterLink,
    ClusterSpec,
    device_categories,
    load_cluster,
    plan_pipeedge,
    predict_plan,
    solve_pipeedge,
)
from zpipe.planner.bucketing import bucket_cluster, bucket_lows, parse_bucketing
from zpipe.planner.profile import ModelProfile, synthetic_profile
from zpipe.planner.synthetic_cluster import measured_cluster as synthetic_measured_cluster

GIB = 1 << 30


def test_the_option_takes_auto_exact_or_a_tolerance() -> None:
    assert parse_bucketing("auto") == "auto"
    assert parse_bucketing(" EXACT ") == "exact"
    assert parse_bucketing("0.1") == pytest.approx(0.1)
    assert parse_bucketing("5%") == pytest.approx(0.05)
    assert parse_bucketing(0.2) == pytest.approx(0.2)
    for bad in ("fast", "0", "-0.1", "3", "nan", True, None, [0.1]):
        with pytest.raises(ConfigError, match="bucketing must be"):
            parse_bucketing(bad)
    assert bucketing_of(None) == "auto"
    assert float(bucketing_of("10%")) == pytest.approx(0.1)
    with pytest.raises(ConfigError):
        bucketing_of("huge")


def test_buckets_start_at_the_smallest_uncovered_value() -> None:
    lows = bucket_lows([100.0, 96.0, 99.0, 109.0, 50.0, 104.0, 110.0], 0.05)
    assert lows == {
        **{50.0: 50.0, 96.0: 96.0, 99.0: 96.0, 100.0: 96.0},
        **{104.0: 104.0, 109.0: 104.0, 110.0: 110.0},
    }


def _kinds_cluster(speeds: list[float], bandwidths: list[float], per_kind: int) -> ClusterSpec:
    devices = [
        ClusterDevice(f"k{k}_{i}", None, speed, bw, 1.0)
        for k, (speed, bw) in enumerate(zip(speeds, bandwidths, strict=True))
        for i in range(per_kind)
    ]
    return ClusterSpec(tuple(devices), client=ClusterLink(bandwidth_mbps=1000.0))


def test_values_already_on_buckets_plan_exactly_as_without_bucketing() -> None:
    # Kinds far apart: every value is its own bucket's low end, nothing moves.
    profile = synthetic_profile([1.0 + (i % 4) for i in range(16)], [400_000] * 16)
    cluster = _kinds_cluster([1.0, 0.5, 0.25], [1000.0, 100.0, 10.0], per_kind=2)
    exact = plan_pipeedge(profile, cluster, batch_size=1, bucketing="exact")
    bucketed = plan_pipeedge(profile, cluster, batch_size=1, bucketing=0.05)
    assert bucketed.stages == exact.stages
    assert bucketed.predicted["bucketing_max_snap"] == 1.0
    assert bucketed.predicted["bucketing_certified_ratio"] == pytest.approx(1.0)
    assert bucketed.predicted["bottleneck_s"] == exact.predicted["bottleneck_s"]


def _random_instance(rng: random.Random) -> tuple[ModelProfile, ClusterSpec]:
    """Up to 7 units and 5 devices, every speed and link measured (all distinct)."""
    units = rng.randint(2, 7)
    profile = synthetic_profile(
        [rng.uniform(0.5, 3.0) for _ in range(units)],
        [rng.randint(0, 2_000_000) for _ in range(units)],
        param_bytes=[rng.randint(1, 10) for _ in range(units)],
        input_bytes=rng.randint(0, 1_000_000),
    )
    devices = tuple(
        ClusterDevice(
            f"d{i}", rng.choice([None, 25, 40]), rng.uniform(0.3, 1.5), latency_ms=rng.random()
        )
        for i in range(rng.randint(1, 5))
    )
    ends = [d.name for d in devices] + [CLIENT]
    links = {
        (a, b): ClusterLink(bandwidth_mbps=rng.uniform(2.0, 40.0), latency_ms=rng.random())
        for a in ends
        for b in ends
        if a != b
    }
    return profile, ClusterSpec(devices, links)


@pytest.mark.parametrize("tolerance", [0.05, 0.3])
def test_a_bucketed_plan_is_within_its_certified_bound_of_the_exact_optimum(
    tolerance: float,
) -> None:
    rng = random.Random(18)
    checked = 0
    for _ in range(40):
        profile, cluster = _random_instance(rng)
        try:
            _, optimum = solve_pipeedge(profile, cluster, batch_size=1, bucketing="exact")
        except ConfigError:
            continue  # no plan fits memory: nothing to compare
        plan = plan_pipeedge(profile, cluster, batch_size=1, bucketing=tolerance)
        pred = plan.predicted
        real = predict_plan(plan, profile, cluster, 1)
        assert real["memory_violations"] == 0
        assert pred["bottleneck_s"] == pytest.approx(real["bottleneck_s"])
        assert 1.0 <= pred["bucketing_max_snap"] <= 1 + tolerance + 1e-12
        # the exact optimum lies between the certified lower bound and the plan's cost
        assert pred["bucketing_lower_bound_s"] <= optimum * (1 + 1e-9)
        assert optimum <= pred["bottleneck_s"] * (1 + 1e-9)
        assert pred["bottleneck_s"] / optimum <= pred["bucketing_certified_ratio"] * (1 + 1e-9)
        assert pred["bucketing_certified_ratio"] <= pred["bucketing_max_snap"] * (1 + 1e-9)
        checked += 1
    assert checked >= 20


def measured_cluster(n: int, seed: int) -> ClusterSpec:
    """``n`` devices of four kinds as a coordinator sees them: every speed and every link
    (each direction, and to the client) measured, so no two numbers are equal."""
    return synthetic_measured_cluster(
        n, seed, [(1.0, 8, 1000.0), (0.75, 4, 100.0), (0.5, 4, 50.0), (0.6, 2, 200.0)]
    )


@pytest.mark.parametrize("devices", [16, 64])
def test_many_measured_devices_plan_with_bucketing(devices: int) -> None:
    profile = synthetic_profile(
        [0.01 * (1 + i % 3) for i in range(24)],
        [600_000] * 24,
        param_bytes=[200 * 2**20] * 24,
    )
    cluster = measured_cluster(devices, seed=devices)
    assert len(device_categories(cluster)) == devices  # exactly: all distinct
    plan = plan_pipeedge(profile, cluster, batch_size=1)  # "auto"
    pred = plan.predicted
    assert pred["num_categories"] <= 8
    assert pred["bucketing_certified_ratio"] <= 1 + pred["bucketing_tolerance"] + 1e-9
    assert predict_plan(plan, profile, cluster, 1)["memory_violations"] == 0
    assert len(set(plan.devices)) == len(plan.stages) <= devices


def test_identical_devices_group_without_comparing_pairs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Not a timing: the number of pairwise comparisons and link lookups must not grow
    # with the count (it is what made grouping quadratic).
    calls = {"compare": 0, "bandwidth": 0}
    compare, bandwidth = pipeedge._interchangeable, ClusterSpec.bandwidth_bps

    def counted_compare(cluster: ClusterSpec, x: str, y: str) -> bool:
        calls["compare"] += 1
        return compare(cluster, x, y)

    def counted_bandwidth(self: ClusterSpec, u: str, v: str) -> float:
        calls["bandwidth"] += 1
        return bandwidth(self, u, v)

    monkeypatch.setattr(pipeedge, "_interchangeable", counted_compare)
    monkeypatch.setattr(ClusterSpec, "bandwidth_bps", counted_bandwidth)
    profile = synthetic_profile([1.0] * 8, [1000] * 8)
    seen = []
    for count in (500, 1000, 2000):
        spec = {
            "format": "zpipe-cluster/1",
            "devices": [{"name": "d", "count": count, "memory_mb": 64, "bandwidth_mbps": 100}],
        }
        path = tmp_path / f"c{count}.json"
        path.write_text(json.dumps(spec))
        cluster = load_cluster(path)
        calls.update(compare=0, bandwidth=0)
        assert [len(c) for c in device_categories(cluster)] == [count]
        bucketed = bucket_cluster(cluster, 0.05, batch_size=1).cluster
        assert [len(c) for c in device_categories(bucketed)] == [count]
        plan = plan_pipeedge(profile, cluster, batch_size=1)
        assert plan.devices == [f"d{i}" for i in range(8)]
        seen.append(dict(calls))
    assert seen[0] == seen[1] == seen[2]
    assert seen[0]["compare"] == 0


def test_plan_cli_takes_bucketing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = synthetic_profile([0.01 * (1 + i % 3) for i in range(12)], [600_000] * 12)
    (tmp_path / "p.json").write_text(json.dumps(profile.to_dict()))
    cluster = measured_cluster(16, seed=3)
    (tmp_path / "c.json").write_text(json.dumps(cluster.to_dict()))
    args = ["--profile", str(tmp_path / "p.json"), "--cluster", str(tmp_path / "c.json")]
    assert plan_main([*args, "--bucketing", "10%", "--json", "-"]) == 0
    captured = capsys.readouterr()
    assert "bucketed to 10%" in captured.err  # the table; stdout holds the JSON alone
    plan = json.loads(captured.out)
    assert plan["predicted"]["bucketing_tolerance"] == pytest.approx(0.1)
    with pytest.raises(SystemExit) as exit_info:
        plan_main([*args, "--bucketing", "lots"])
    assert exit_info.value.code == 2
    assert "bucketing must be" in capsys.readouterr().err
    assert math.isfinite(plan["predicted"]["bucketing_certified_ratio"])


def test_the_client_asks_for_bucketing_only_when_it_is_not_auto() -> None:
    model = ModelSpec("mlp", {"dims": [4, 4]})
    auto = inference_request(model, InferOptions(), "tcp://127.0.0.1:1").body()
    assert "bucketing" not in auto  # an older coordinator refuses fields it does not know
    exact = inference_request(model, InferOptions(bucketing="exact"), "tcp://127.0.0.1:1").body()
    assert bucketing_of(exact["bucketing"]) == "exact"
    wide = inference_request(model, InferOptions(bucketing=0.1), "tcp://127.0.0.1:1").body()
    assert float(bucketing_of(wide["bucketing"])) == pytest.approx(0.1)
    with pytest.raises(ConfigError, match="bucketing must be"):
        InferOptions(bucketing="coarse")


def test_measured_profiles_share_a_bucket_and_keep_the_bound() -> None:
    # Each device profiled the model itself: unit times within 3 % of its kind's.
    rng = random.Random(5)
    model = synthetic_profile([0.02 * (1 + i % 4) for i in range(10)], [300_000] * 10)
    devices = []
    for i in range(12):
        scale = (1.0, 2.0, 3.5)[i % 3] * rng.uniform(0.985, 1.015)
        own = synthetic_profile([t * scale for t in model.times(1)], [300_000] * 10)
        devices.append(ClusterDevice(f"p{i}", bandwidth_mbps=400.0, profile=own))
    cluster = ClusterSpec(tuple(devices))
    bucketed = bucket_cluster(cluster, 0.05, batch_size=1)
    assert len(device_categories(bucketed.cluster)) == 3
    assert 1.0 < bucketed.max_snap <= 1.05
    _, optimum = solve_pipeedge(model, cluster, batch_size=1, bucketing="exact")
    plan = plan_pipeedge(model, cluster, batch_size=1, bucketing=0.05)
    pred = plan.predicted
    assert (
        pred["bucketing_lower_bound_s"] <= optimum * (1 + 1e-9) <= pred["bottleneck_s"] * (1 + 1e-9)
    )
    assert pred["bucketing_certified_ratio"] <= bucketed.max_snap * (1 + 1e-9)


def test_a_measured_cluster_has_no_two_equal_numbers_and_refuses_nothing_to_build() -> None:
    cluster = measured_cluster(12, seed=5)
    speeds = [d.speed for d in cluster.devices]
    assert len(set(speeds)) == len(speeds) == 12
    bandwidths = [link.bandwidth_mbps for link in cluster.links.values()]
    assert len(set(bandwidths)) == len(bandwidths)
    assert measured_cluster(12, seed=5) == cluster  # seeded: repeatable
    with pytest.raises(ValueError, match="needs devices and kinds"):
        synthetic_measured_cluster(0, 1, [(1.0, 1, 10.0)])
    with pytest.raises(ValueError, match="needs devices and kinds"):
        synthetic_measured_cluster(3, 1, [])
