"""Cluster spec files: format, link rules, and errors that name the bad entry."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zpipe._errors import ConfigError
from zpipe.planner import (
    CLIENT,
    ClusterDevice,
    ClusterLink,
    ClusterSpec,
    load_cluster,
    plan_pipeedge,
)
from zpipe.planner import cluster as cluster_module
from zpipe.planner.cluster import MAX_CLUSTER_DEVICES, MAX_JSON_DEPTH
from zpipe.planner.profile import synthetic_profile

EXAMPLE: dict[str, Any] = {
    "format": "zpipe-cluster/1",
    "devices": [
        {
            "name": "rcc",
            "count": 3,
            "memory_mb": 8192,
            "speed": 1.0,
            "bandwidth_mbps": 1000,
            "latency_ms": 0.5,
        },
        {"name": "minnow", "count": 2, "memory_mb": 2048, "speed": 0.5, "bandwidth_mbps": 100},
        {"name": "laptop"},
    ],
    "links": [
        {"a": "rcc0", "b": "minnow1", "bandwidth_mbps": 40, "latency_ms": 2.0},
        {"a": "laptop", "b": "rcc2", "bandwidth_mbps": 5, "directed": True},
    ],
    "client": {"bandwidth_mbps": 1000, "latency_ms": 0.5},
}


def _doc(**changes: Any) -> dict[str, Any]:
    doc = json.loads(json.dumps(EXAMPLE))
    doc.update(changes)
    return doc


def test_count_expands_names_and_defaults_apply() -> None:
    spec = ClusterSpec.from_dict(EXAMPLE)
    assert spec.names == ["rcc0", "rcc1", "rcc2", "minnow0", "minnow1", "laptop"]
    assert spec.device("rcc1").memory_bytes == 8192 << 20
    laptop = spec.device("laptop")
    assert (laptop.memory_bytes, laptop.speed, laptop.bandwidth_mbps, laptop.latency_ms) == (
        None,
        1.0,
        None,
        0.0,
    )


def test_link_rules() -> None:
    spec = ClusterSpec.from_dict(EXAMPLE)
    # Default: the narrower access link, the latencies added.
    assert spec.bandwidth_bps("rcc0", "minnow0") == 100e6
    assert spec.latency_s("rcc0", "rcc1") == pytest.approx(0.001)
    # An explicit entry, both ways.
    assert spec.bandwidth_bps("minnow1", "rcc0") == 40e6
    assert spec.latency_s("rcc0", "minnow1") == pytest.approx(0.002)
    # A directed entry sets one way; its missing latency falls back to the rule.
    assert spec.bandwidth_bps("laptop", "rcc2") == 5e6
    assert spec.bandwidth_bps("rcc2", "laptop") == 1000e6
    assert spec.latency_s("laptop", "rcc2") == pytest.approx(0.0005)
    # Unlimited on both ends costs latency only.
    assert spec.bandwidth_bps("laptop", CLIENT) == 1000e6
    # A period pays serialisation only: latency overlaps with micro-batches in flight.
    assert spec.comm_time_s("rcc0", "rcc1", 1_000_000) == pytest.approx(0.008)
    bare = ClusterSpec((ClusterDevice("x"), ClusterDevice("y")))
    assert bare.bandwidth_bps("x", "y") == math.inf
    assert bare.comm_time_s("x", "y", 10**9) == 0.0


def test_round_trip_through_json() -> None:
    spec = ClusterSpec.from_dict(EXAMPLE)
    again = ClusterSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec
    assert again.to_dict() == spec.to_dict()


def test_round_trip_keeps_an_inline_profile_and_a_client_link(tmp_path: Path) -> None:
    prof = synthetic_profile([1.0, 2.0], [10, 20])
    spec = ClusterSpec(
        (ClusterDevice("a", 3 << 20, 0.5, 10.0, 1.0, prof), ClusterDevice("b", 1234567)),
        links={("a", CLIENT): ClusterLink(latency_ms=4.0)},
        client=ClusterLink(bandwidth_mbps=7.0),
    )
    path = tmp_path / "c.json"
    path.write_text(json.dumps(spec.to_dict()))
    assert load_cluster(path) == spec


def test_relative_profile_paths(tmp_path: Path) -> None:
    folder = tmp_path / "site"
    (folder / "profiles").mkdir(parents=True)
    prof = synthetic_profile([2.0, 2.0], [0, 0])
    prof.save(folder / "profiles" / "minnow.json")
    doc = _doc(devices=[{"name": "m", "count": 2, "profile": "profiles/minnow.json"}], links=[])
    (folder / "cluster.json").write_text(json.dumps(doc))
    spec = load_cluster(folder / "cluster.json")
    assert spec.device("m1").profile == prof
    plan = plan_pipeedge(synthetic_profile([1.0, 1.0], [0, 0]), spec, batch_size=1)
    assert plan.predicted["bottleneck_s"] == pytest.approx(2.0)  # the own profile's times


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"format": "zpipe-cluster/0"}, "format must be 'zpipe-cluster/1'"),
        ({"extra": 1}, r"unknown key\(s\) \['extra'\]"),
        ({"devices": []}, "'devices' must be a non-empty list"),
        ({"devices": [{"name": "a", "colour": "red"}]}, r"devices\[0\] \(a\): unknown key"),
        ({"devices": [{"name": ""}]}, r"devices\[0\]: 'name' must be"),
        ({"devices": [{"name": "a", "memory_mb": 0}]}, r"devices\[0\] \(a\): memory_mb must be"),
        ({"devices": [{"name": "a", "memory_mb": -5}]}, r"devices\[0\] \(a\): memory_mb"),
        ({"devices": [{"name": "a", "speed": 0}]}, r"devices\[0\] \(a\): .*speed must be"),
        ({"devices": [{"name": "a", "speed": -1}]}, r"devices\[0\] \(a\): .*speed"),
        ({"devices": [{"name": "a", "bandwidth_mbps": 0}]}, r"\(a\): .*bandwidth_mbps must be"),
        ({"devices": [{"name": "a", "latency_ms": -1}]}, r"\(a\): .*latency_ms must be"),
        ({"devices": [{"name": "a", "speed": "fast"}]}, r"\(a\): speed must be a number"),
        ({"devices": [{"name": "a", "count": 0}]}, r"\(a\): count must be an integer >= 1"),
        ({"devices": [{"name": "client"}]}, "reserved"),
        (
            {"devices": [{"name": "rcc", "count": 2}, {"name": "rcc1"}], "links": []},
            r"devices\[1\] makes a device named 'rcc1', which devices\[0\] already made",
        ),
        ({"links": [{"a": "rcc0", "b": "nope", "bandwidth_mbps": 1}]}, r"links\[0\]: 'b' names"),
        ({"links": [{"a": "rcc0", "b": "rcc0", "bandwidth_mbps": 1}]}, r"links\[0\].*itself|two"),
        ({"links": [{"a": "rcc0", "b": "rcc1"}]}, r"links\[0\] \(rcc0 - rcc1\): give"),
        ({"links": [{"a": "rcc0", "b": "rcc1", "bandwidth_mbps": -2}]}, r"links\[0\].*must be"),
        ({"links": [{"a": "rcc0", "b": "rcc1", "mtu": 9000}]}, r"links\[0\]: unknown key"),
        (
            {
                "links": [
                    {"a": "rcc0", "b": "rcc1", "bandwidth_mbps": 1},
                    {"a": "rcc1", "b": "rcc0", "bandwidth_mbps": 2, "directed": True},
                ]
            },
            r"links\[1\] sets link 'rcc1' -> 'rcc0' a second time",
        ),
        ({"client": {"bandwidth_mbps": 0}}, r"client: .*bandwidth_mbps must be"),
        ({"client": {"speed": 1}}, r"client: unknown key"),
        ({"devices": [{"name": "a", "profile": 3}], "links": []}, r"\(a\): profile must be"),
    ],
)
def test_validation_errors_name_the_entry(change: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        ClusterSpec.from_dict(_doc(**change), source="c.json")


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "zpipe-cluster/1", "devices": [')
    with pytest.raises(ConfigError, match=r"cluster file .*bad.json is not valid JSON"):
        load_cluster(bad)
    with pytest.raises(ConfigError, match=r"cannot read cluster file .*missing.json"):
        load_cluster(tmp_path / "missing.json")
    doc = _doc(devices=[{"name": "m", "profile": "nope.json"}], links=[])
    (tmp_path / "c.json").write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=r"c.json: devices\[0\] \(m\): profile: cannot read"):
        load_cluster(tmp_path / "c.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ConfigError, match=r"list\.json: must hold a JSON object"):
        load_cluster(tmp_path / "list.json")


def test_programmatic_specs_are_validated_too() -> None:
    with pytest.raises(ConfigError, match="appears more than once"):
        ClusterSpec((ClusterDevice("a"), ClusterDevice("a")))
    with pytest.raises(ConfigError, match="unknown device 'zz'"):
        ClusterSpec((ClusterDevice("a"),), links={("a", "zz"): ClusterLink(1.0)})
    with pytest.raises(ConfigError, match="at least one device"):
        ClusterSpec(())
    with pytest.raises(ConfigError, match="memory must be positive"):
        ClusterDevice("a", memory_bytes=0)


# -- hostile files: every malformed document is a ConfigError, nothing else -----------------

_JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-3, 50)
    | st.sampled_from([MAX_CLUSTER_DEVICES + 1, 10**9, 2**63, -(2**63)])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from(["", "a", "client", "rcc0", "zpipe-cluster/1", "zpipe-profile/1"])
)
_KEYS = st.sampled_from(
    sorted(
        {"format", "devices", "links", "client", "name", "count", "memory_mb", "speed"}
        | {"bandwidth_mbps", "latency_ms", "profile", "a", "b", "directed", "units"}
        | {"batch_sizes", "input_bytes", "time_s", "output_bytes", "param_bytes", "x"}
    )
)
_JSON = st.recursive(
    _JSON_LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_KEYS, inner, max_size=5),
    max_leaves=25,
)


@settings(max_examples=100, deadline=None)
@given(
    top=st.dictionaries(_KEYS, _JSON, max_size=4),
    devices=st.lists(st.dictionaries(_KEYS, _JSON, max_size=6), max_size=3),
)
def test_any_document_is_a_spec_or_a_config_error(
    top: dict[str, Any], devices: list[dict[str, Any]]
) -> None:
    doc = {"format": "zpipe-cluster/1", **top}
    if "devices" not in top:
        doc["devices"] = devices
    try:
        spec = ClusterSpec.from_dict(doc, source="fuzz.json")
    except ConfigError:
        return
    assert 1 <= len(spec.devices) <= MAX_CLUSTER_DEVICES


def test_counts_are_capped_at_a_documented_maximum() -> None:
    at_cap = _doc(devices=[{"name": "d", "count": MAX_CLUSTER_DEVICES}], links=[])
    assert len(ClusterSpec.from_dict(at_cap).devices) == MAX_CLUSTER_DEVICES
    with pytest.raises(ConfigError, match=r"unknown device 'e'; known: \['d0', .* and 4084 more"):
        ClusterSpec.from_dict({**at_cap, "links": [{"a": "d0", "b": "e", "latency_ms": 1}]})
    with pytest.raises(ConfigError, match=rf"count {10**9} is above {MAX_CLUSTER_DEVICES}"):
        ClusterSpec.from_dict(_doc(devices=[{"name": "d", "count": 10**9}], links=[]))
    two_halves = [{"name": n, "count": MAX_CLUSTER_DEVICES // 2 + 1} for n in ("p", "q")]
    with pytest.raises(ConfigError, match=r"devices\[1\] takes the cluster past"):
        ClusterSpec.from_dict(_doc(devices=two_halves, links=[]))


def test_deep_large_or_binary_files_are_config_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 50_000 + "]" * 50_000)
    with pytest.raises(ConfigError, match="nests too deep"):
        load_cluster(deep)
    nested = tmp_path / "nested.json"
    nested.write_text('{"format": "zpipe-cluster/1", "x": ' + "[" * 40 + "]" * 40 + "}")
    with pytest.raises(ConfigError, match=rf"nests 41 deep; .* at most {MAX_JSON_DEPTH}"):
        load_cluster(nested)
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_cluster(binary)
    monkeypatch.setattr(cluster_module, "MAX_FILE_BYTES", 100)
    large = tmp_path / "large.json"
    large.write_text(json.dumps(_doc()))
    with pytest.raises(ConfigError, match="is larger than"):
        load_cluster(large)


@pytest.mark.parametrize("units", [[1, 2, 3], "abc", [[]], [{"name": "u", "time_s": 5}]], ids=repr)
def test_inline_profiles_that_are_malformed_are_config_errors(units: Any) -> None:
    profile = {"format": "zpipe-profile/1", "batch_sizes": [1], "input_bytes": [0], "units": units}
    with pytest.raises(ConfigError, match=r"devices\[0\] \(a\): profile"):
        ClusterSpec.from_dict(_doc(devices=[{"name": "a", "profile": profile}], links=[]))
