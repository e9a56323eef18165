"""The planner's file inputs: values out of sane ranges are refused by name, the plan
written is standard JSON, and identical devices group in time linear in their count."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest

from zpipe._errors import ConfigError
from zpipe.cli import plan as plan_cli
from zpipe.planner.cluster import ClusterDevice, ClusterLink, ClusterSpec, load_cluster
from zpipe.planner.pipeedge import device_categories
from zpipe.planner.plan import Plan, plan_json
from zpipe.planner.profile import ModelProfile, synthetic_profile
from zpipe.planner.training_plan import TrainingPlan

GOOD = synthetic_profile(
    [1.0, 2.0, 1.0, 2.0],
    [10, 10, 10, 10],
    param_bytes=[100] * 4,
    backward_times_s=[2.0] * 4,
    activation_bytes=[10] * 4,
    input_bytes=10,
)
TWO = {"format": "zpipe-cluster/1", "devices": [{"name": "d", "count": 2}]}


def write(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data))
    return path


def run_plan(tmp_path: Path, profile: Any, cluster: Any, *extra: str) -> tuple[int, str, str]:
    p = write(tmp_path / "profile.json", profile)
    c = write(tmp_path / "cluster.json", cluster)
    code = plan_cli.main(["--profile", str(p), "--cluster", str(c), *extra])
    return code, str(p), str(c)


def profile_with(edit: Any) -> dict[str, Any]:
    data = GOOD.to_dict()
    edit(data)
    return data


# -- profiles ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda d: d["units"][1].__setitem__("time_s", [1e308]),
            "unit 1 (unit1): time_s must be finite and >= 0 and at most 1e+06 s; entry 0 is 1e+308",
        ),
        (
            lambda d: d["units"][0].__setitem__("backward_time_s", [2e6]),
            "unit 0 (unit0): backward_time_s must be finite and >= 0 and at most 1e+06 s",
        ),
        (
            lambda d: d.__setitem__("input_bytes", [-5]),
            "input_bytes must be between 0 and 2**53 bytes; entry 0 is -5",
        ),
        (
            lambda d: d["units"][2].__setitem__("output_bytes", [10.5]),
            "unit 2 (unit2): output_bytes[0] must be a whole number, got 10.5",
        ),
        (
            lambda d: d["units"][3].__setitem__("activation_bytes", [0.25]),
            "unit 3 (unit3): activation_bytes[0] must be a whole number, got 0.25",
        ),
        (
            lambda d: d["units"][2].__setitem__("param_bytes", 2**64),
            "unit 2 (unit2): param_bytes must be between 0 and 2**53 bytes, got "
            "18446744073709551616",
        ),
        (
            lambda d: d["units"][0].__setitem__("memory_bytes", [2**63]),
            "unit 0 (unit0): memory_bytes must be between 0 and 2**53 bytes",
        ),
        (
            lambda d: d.__setitem__("batch_sizes", [1.5]),
            "batch_sizes[0] must be a whole number, got 1.5",
        ),
        (
            lambda d: d["units"][0].__setitem__("param_bytes", "100"),
            "unit 0 (unit0): param_bytes must be an integer, got '100'",
        ),
    ],
)
def test_a_profile_value_out_of_range_is_refused_by_name(
    edit: Any, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, path, _ = run_plan(tmp_path, profile_with(edit), TWO)
    err = capsys.readouterr().err
    assert code == 1
    assert err == f"python -m zpipe plan: profile {path}: {message}\n" or message in err, err
    assert "Traceback" not in err and "out of memory" not in err


def test_whole_floats_still_read_as_byte_counts() -> None:
    data = GOOD.to_dict()
    data["units"][0]["output_bytes"] = [10.0]
    assert ModelProfile.from_dict(data).output_bytes(1)[0] == 10


def test_a_profile_built_in_code_is_checked_as_strictly() -> None:
    with pytest.raises(ConfigError, match="input_bytes must be between 0 and 2"):
        synthetic_profile([1.0], [10], input_bytes=-1)
    with pytest.raises(ConfigError, match="time_s must be finite and >= 0 and at most"):
        synthetic_profile([1e300], [10])
    many = [2**53] * 1025  # each one in range, together past int64's reach
    with pytest.raises(ConfigError, match=r"add up to .* more than 2\*\*62"):
        synthetic_profile([1.0] * 1025, [0] * 1025, param_bytes=many)


# -- clusters ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("device", "message"),
    [
        (
            {"speed": 1e-320},
            "devices[0] (d): device 'd0': speed must be a positive number between 1e-06 and "
            "1e+06, got 1e-320",
        ),
        ({"speed": 1e300}, "speed must be a positive number between 1e-06 and 1e+06"),
        (
            {"memory_mb": 2.0**50},
            "devices[0] (d): memory_mb must be a positive number of at most 8589934592 "
            "(2**53 bytes)",
        ),
        ({"memory_mb": 1e308}, "memory_mb must be a positive number"),
        ({"bandwidth_mbps": 1e-320}, "bandwidth_mbps must be a positive number between 1e-06"),
        ({"latency_ms": 1e300}, "latency_ms must be a number >= 0 and at most 1e+06"),
    ],
)
def test_a_cluster_value_out_of_range_is_refused_by_name(
    device: dict[str, Any], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = {"format": "zpipe-cluster/1", "devices": [{"name": "d", "count": 2, **device}]}
    code, _, path = run_plan(tmp_path, GOOD.to_dict(), cluster)
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"python -m zpipe plan: --cluster: {path}: ") and message in err, err
    assert "Traceback" not in err


def test_a_device_made_in_code_is_range_checked_too() -> None:
    with pytest.raises(ConfigError, match="memory must be at most 2\\*\\*53 bytes"):
        ClusterDevice("a", memory_bytes=2**63)
    with pytest.raises(ConfigError, match="speed must be a positive number between"):
        ClusterDevice("a", speed=1e-320)
    with pytest.raises(ConfigError, match="bandwidth_mbps must be a positive number between"):
        ClusterLink(bandwidth_mbps=1e10)


# -- standard JSON -----------------------------------------------------------------------------


def test_a_model_of_zero_times_writes_standard_json_with_null_for_no_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    zero = synthetic_profile([0.0] * 4, [10] * 4)
    out = tmp_path / "plan.json"
    code, _, _ = run_plan(tmp_path, zero.to_dict(), TWO, "--json", str(out))
    assert code == 0
    text = out.read_text()
    assert "Infinity" not in text and "NaN" not in text

    def refuse(token: str) -> None:
        raise AssertionError(f"non-standard JSON: {token}")

    data = json.loads(text, parse_constant=refuse)
    assert data["predicted"]["throughput_samples_per_s"] is None
    # the file reads back as a plan whose throughput has no bound
    assert Plan.from_dict(data).predicted["throughput_samples_per_s"] == math.inf


def test_a_training_plan_with_no_bound_writes_null_and_reads_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    zero = synthetic_profile(
        [0.0] * 4, [10] * 4, backward_times_s=[0.0] * 4, activation_bytes=[0] * 4
    )
    out = tmp_path / "plan.json"
    code, _, _ = run_plan(tmp_path, zero.to_dict(), TWO, "--train", "--json", str(out))
    assert code == 0
    data = json.loads(out.read_text())
    assert data["predicted"]["samples_per_s"] is None
    assert TrainingPlan.from_dict(data).predicted["samples_per_s"] == math.inf


def test_plan_json_never_writes_a_non_finite_number() -> None:
    text = plan_json({"predicted": {"a": math.inf, "b": -math.inf, "c": math.nan, "d": 1.5}})
    assert json.loads(text) == {"predicted": {"a": None, "b": None, "c": None, "d": 1.5}}


# -- grouping identical devices ----------------------------------------------------------------


def test_four_thousand_identical_devices_group_at_once_and_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = {
        "format": "zpipe-cluster/1",
        "devices": [{"name": "d", "count": 4096, "memory_mb": 1024, "bandwidth_mbps": 100}],
    }
    spec = load_cluster(write(tmp_path / "many.json", cluster))
    started = time.perf_counter()
    categories = device_categories(spec)
    took = time.perf_counter() - started
    assert [len(c) for c in categories] == [4096]
    assert categories[0][:3] == ["d0", "d1", "d2"]
    # Not a speed assertion: quadratic grouping took minutes here; linear takes
    # milliseconds. The bound is far above either's noise on a loaded machine.
    assert took < 60
    code, _, _ = run_plan(tmp_path, GOOD.to_dict(), cluster)
    assert code == 0


def _reference_categories(cluster: ClusterSpec) -> list[list[str]]:
    """Every device compared with every category, link by link (the old definition)."""
    from zpipe.planner.pipeedge import _interchangeable

    categories: list[list[str]] = []
    for name in cluster.names:
        for members in categories:
            if _interchangeable(cluster, members[0], name):
                members.append(name)
                break
        else:
            categories.append([name])
    return categories


def test_grouping_matches_comparing_every_device_link_by_link() -> None:
    own = synthetic_profile([1.0] * 4, [10] * 4)
    same_values = synthetic_profile([1.0] * 4, [10] * 4)  # equal, not the same object
    devices = (
        ClusterDevice("a0", bandwidth_mbps=100),
        ClusterDevice("b0", bandwidth_mbps=50, memory_bytes=10),
        ClusterDevice("a1", bandwidth_mbps=100),
        ClusterDevice("p0", profile=own),
        ClusterDevice("p1", profile=same_values),
        ClusterDevice("a2", bandwidth_mbps=100),  # named by a link: its own bucket
        ClusterDevice("b1", bandwidth_mbps=50, memory_bytes=10),
        ClusterDevice("x0", bandwidth_mbps=200),
    )
    links = {("a2", "b0"): ClusterLink(bandwidth_mbps=7.0)}
    cluster = ClusterSpec(devices, links=links, client=ClusterLink(bandwidth_mbps=50))
    assert device_categories(cluster) == _reference_categories(cluster)
    categories = device_categories(cluster)
    # a2 and b0 are joined by their own link: neither is like its twin any more
    assert categories == [["a0", "a1"], ["b0"], ["p0", "p1"], ["a2"], ["b1"], ["x0"]]
    # with no link entries at all, devices whose declared uplinks differ above every
    # other device's still group, as the link-by-link definition says
    capped = ClusterSpec(
        (
            ClusterDevice("s", bandwidth_mbps=10),
            ClusterDevice("f1", bandwidth_mbps=100),
            ClusterDevice("f2", bandwidth_mbps=200),
        ),
        client=ClusterLink(bandwidth_mbps=10),
    )
    assert device_categories(capped) == _reference_categories(capped) == [["s"], ["f1", "f2"]]


def test_training_over_a_thousand_identical_devices_is_refused_before_any_table_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The HPP solver's link table alone grows with the fourth power of the devices: its
    # size check now comes first, so this answers at once instead of after hours.
    cluster = {"format": "zpipe-cluster/1", "devices": [{"name": "d", "count": 1000}]}
    code, _, _ = run_plan(tmp_path, GOOD.to_dict(), cluster, "--train")
    assert code == 1
    assert "planning 4 units over 1000 devices exactly examines about" in capsys.readouterr().err
