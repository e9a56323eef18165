"""bench/inference.py's small section: its model, devices, batches and summary keys
(the timed comparison itself runs only in the bench)."""

from __future__ import annotations

from typing import Any

import pytest

from bench._inference_small import (
    HEADLINE_KEY,
    SMALL_MAX_IN_FLIGHT,
    SMALL_STAGES,
    small_batches,
    small_devices,
    small_keys,
    small_spec,
)
from bench.inference import build_parser
from zpipe.models import load_layer_sequence
from zpipe.planner import even_ranges


def test_the_small_model_splits_evenly_over_three_fast_devices_without_links() -> None:
    spec = small_spec(seed=0)
    units = load_layer_sequence(spec).num_units
    assert units >= SMALL_STAGES  # every stage gets at least one unit
    assert all(end > start for start, end in even_ranges(units, SMALL_STAGES))
    devices = small_devices(threads=1)
    assert [d.slowdown for d in devices] == [1.0] * SMALL_STAGES
    assert all(d.bandwidth_mbps is None and d.latency_ms == 0.0 for d in devices)
    assert all(d.threads == 1 for d in devices)
    assert len({d.name for d in devices}) == SMALL_STAGES


def test_batches_are_seeded_and_fit_the_model() -> None:
    spec = small_spec(seed=0)
    a = small_batches(spec, count=3, batch_size=8, seed=5)
    b = small_batches(spec, count=3, batch_size=8, seed=5)
    c = small_batches(spec, count=3, batch_size=8, seed=6)
    assert all(x[0].equal(y[0]) for x, y in zip(a, b, strict=True))
    assert not a[0][0].equal(c[0][0])
    assert not a[0][0].equal(a[1][0])  # not one batch repeated
    assert a[0][0].shape[0] == 8


def _compared(ratio: float, zpipe: float, ok: bool) -> tuple[dict[str, Any], bool]:
    keys = {
        "ratio_vs_torch_rpc": ratio,
        "zpipe_samples_per_s": zpipe,
        "torch_rpc_samples_per_s": zpipe / ratio,
        "zpipe_cpu_ms_per_sample": 1.0,
        "torch_rpc_cpu_ms_per_sample": 2.0,
        "outputs_match": ok,
        "max_in_flight": 0,
    }
    return keys, ok


def test_summary_keys_name_the_first_bound_and_list_every_bound() -> None:
    results = {4: _compared(1.8, 900.0, True), 12: _compared(1.2, 1000.0, True)}
    keys = small_keys(results, (4, 12))
    assert keys[HEADLINE_KEY] == 1.8
    assert keys["small_zpipe_samples_per_s"] == 900.0
    assert keys["small_torch_rpc_samples_per_s"] == 500.0
    assert keys["small_zpipe_cpu_ms_per_sample"] == 1.0
    assert keys["small_torch_rpc_cpu_ms_per_sample"] == 2.0
    assert keys["small_outputs_match"] is True
    assert "small_ratio_vs_torch_rpc" not in keys  # the headline has its issue's name
    assert keys["small_by_max_in_flight"]["12"]["ratio_vs_torch_rpc"] == 1.2
    assert set(keys["small_by_max_in_flight"]) == {"4", "12"}
    # the other bound first: it gives the headline
    assert small_keys(results, (12, 4))[HEADLINE_KEY] == 1.2


def test_outputs_must_match_at_every_bound() -> None:
    results = {4: _compared(1.8, 900.0, True), 12: _compared(1.2, 1000.0, False)}
    assert small_keys(results, (4, 12))["small_outputs_match"] is False


def test_flags() -> None:
    args = build_parser().parse_args([])
    assert not args.skip_small
    assert tuple(args.small_max_in_flight) == SMALL_MAX_IN_FLIGHT
    args = build_parser().parse_args(["--skip-small", "--small-max-in-flight", "3,8"])
    assert args.skip_small and args.small_max_in_flight == (3, 8)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--small-max-in-flight", "0"])
