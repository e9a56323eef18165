"""The coordinator's planning step and the plan command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zpipe._errors import ConfigError
from zpipe.coordinator.membership import Member
from zpipe.coordinator.planning import choose_plan, cluster_from_members, merge_alike_profiles
from zpipe.planner import CLIENT
from zpipe.planner.memory import COMPUTE_RUNTIME_BYTES, DEFAULT_STAGE_BASE_BYTES
from zpipe.planner.profile import ModelProfile, synthetic_profile


def member(
    name: str, slowdown: float = 1.0, bandwidth: float | None = None, memory_mb: float | None = None
) -> Member:
    info = {
        "slowdown": slowdown,
        "memory_mb": memory_mb,
        "cores": 2,
        "threads": 1,
        "torch": "x",
        "link": {"bandwidth_mbps": bandwidth, "latency_ms": 1.0},
    }
    return Member(
        name=name,
        routing_id=name.encode(),
        data_endpoint="tcp://h:1",
        info=info,
        public_key=None,
        joined_at=0.0,
        last_seen=0.0,
    )


def profile_of(scale: float) -> ModelProfile:
    return synthetic_profile([scale] * 4, [1000] * 4, param_bytes=[10] * 4, input_bytes=100)


def test_links_are_the_senders_outgoing_link_and_memory_is_in_mib() -> None:
    members = [member("a", bandwidth=8.0, memory_mb=2.0), member("b", bandwidth=None)]
    cluster = cluster_from_members(members, margin=0.0)
    assert cluster.bandwidth_bps("a", "b") == 8e6
    assert cluster.bandwidth_bps("a", CLIENT) == 8e6
    assert cluster.bandwidth_bps("b", "a") == float("inf")
    assert cluster.latency_s("a", "b") == pytest.approx(0.001)
    # 2 MiB hold less than a stage process's default base: nothing is left for a model
    assert cluster.device("a").memory_bytes == 1
    assert cluster.device("b").memory_bytes is None


def test_a_device_is_its_budget_less_the_margin_and_its_reported_base() -> None:
    reported = member("a", memory_mb=1024.0)
    reported.info["base_bytes"] = 100 * 2**20  # what Register.base_bytes carried
    silent = member("b", memory_mb=1024.0, slowdown=2.0)  # an older stage reports none
    cluster = cluster_from_members([reported, silent], margin=0.25)
    room = int(1024 * 2**20 / 1.25) - COMPUTE_RUNTIME_BYTES
    assert cluster.device("a").memory_bytes == room - 100 * 2**20
    assert cluster.device("b").memory_bytes == room - DEFAULT_STAGE_BASE_BYTES


def test_without_own_profiles_speed_is_one_over_slowdown() -> None:
    cluster = cluster_from_members([member("a", slowdown=4.0)])
    assert cluster.device("a").speed == pytest.approx(0.25)
    assert cluster.device("a").profile is None


def test_alike_devices_share_one_profile_and_different_ones_do_not() -> None:
    members = [member("a"), member("b"), member("c"), member("slow", slowdown=4.0)]
    profiles = {
        "a": profile_of(1.0),
        "b": profile_of(1.1),
        "c": profile_of(2.0),
        "slow": profile_of(1.05),
    }
    merged = merge_alike_profiles(members, profiles)
    # a and b are the same hardware within tolerance: one profile, the median of the group
    assert merged["a"] is merged["b"] is profiles["b"]
    assert merged["c"] is profiles["c"]  # same declared hardware but measured far apart
    assert merged["slow"] is profiles["slow"]  # declared differently


def test_choose_plan_picks_the_faster_devices_and_reports_the_even_baseline() -> None:
    members = [member("fast"), member("slow", slowdown=4.0)]
    prof = profile_of(1.0)
    cluster = cluster_from_members(members, {"fast": prof, "slow": profile_of(4.0)})
    plan, baseline = choose_plan(
        algo="pipeedge",
        num_units=4,
        names=["fast", "slow"],
        partition=None,
        profile=prof,
        cluster=cluster,
        batch_size=1,
    )
    assert baseline is not None and baseline.algo == "even"
    assert (
        plan.predicted["throughput_samples_per_s"] > baseline.predicted["throughput_samples_per_s"]
    )
    with pytest.raises(ConfigError, match="unknown planner 'best'"):
        choose_plan(
            algo="best",
            num_units=4,
            names=["fast"],
            partition=None,
            profile=prof,
            cluster=cluster,
            batch_size=1,
        )
    with pytest.raises(ConfigError, match="describes 4 units but the model has 5"):
        choose_plan(
            algo="pipeedge",
            num_units=5,
            names=["fast"],
            partition=None,
            profile=prof,
            cluster=cluster,
            batch_size=1,
        )
    explicit, none = choose_plan(
        algo="pipeedge",
        num_units=4,
        names=["slow", "fast"],
        partition=[[0, 1], [1, 4]],
        profile=None,
        cluster=None,
        batch_size=1,
    )
    assert explicit.algo == "explicit" and none is None


def test_plan_command_prints_a_table_and_json(tmp_path: Path) -> None:
    profile_path = tmp_path / "p.json"
    profile_of(0.01).save(profile_path)
    cluster_path = tmp_path / "c.json"
    cluster_path.write_text(
        json.dumps(
            {
                "format": "zpipe-cluster/1",
                "devices": [
                    {"name": "fast", "speed": 1.0},
                    {"name": "slow", "count": 2, "speed": 0.25},
                ],
            }
        )
    )
    out = tmp_path / "plan.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "zpipe",
            "plan",
            "--profiles",
            str(profile_path),
            "--cluster",
            str(cluster_path),
            "--compare",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "pipeedge:" in result.stdout and "even:" in result.stdout
    assert "predicted throughput" in result.stdout
    plan = json.loads(out.read_text())
    assert plan["algo"] == "pipeedge" and plan["stages"][0][0] == "fast"
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "zpipe",
            "plan",
            "--profiles",
            str(cluster_path),
            "--cluster",
            str(cluster_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and "format must be 'zpipe-profile/1'" in bad.stderr
