"""bench/lossy_cnn.py (Fig. 10(c)): every configuration at each seed's equal simulated
time, with its summary keys, on a tiny CNN."""

from __future__ import annotations

from typing import Any

import pytest

import bench.lossy_cnn as lossy_cnn
from zpipe.devices import single_threaded_blas
from zpipe.lossy.data import load_dataset


def test_cnn_section_compares_allocations_at_equal_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lossy_cnn, "CNN_PROBE_CAP", 6)
    data = load_dataset("digits").limit(n_train=300, n_test=60)
    rows: list[dict[str, Any]] = []
    with single_threaded_blas():
        out = lossy_cnn.cnn_section(data, 1, n_devices=6, test_repeats=1, channels=(2, 3, 3),
                                    hidden=(8, 8, 8), emit=rows.append)  # fmt: skip
    budget = rows[0]
    assert budget["kind"] == "cnn_budget" and budget["budget_s"] > 0
    runs = [r for r in rows if r["kind"] == "cnn"]
    assert len(runs) == 2 * len(lossy_cnn.CNN_CONFIGS)
    # equal time: the pipelined allocations fit more mini-batches than no pipelining,
    # horizontal's longer period fewer than hybrid's
    by = {(r["conv_devices"], r["config"]): r for r in runs}
    assert by[("auto", "hybrid")]["mini_batches"] > by[("auto", "hybrid_model")]["mini_batches"]
    assert by[("auto", "horizontal")]["mini_batches"] < by[("auto", "hybrid")]["mini_batches"]
    # convolutions all on one device: no link inside the convolution stack
    assert by[(1, "hybrid")]["groups"][0] == [0, 1, 2, 3]
    for prefix in ("cnn_", "cnn_conv1dev_"):
        for name in lossy_cnn.CNN_CONFIGS:
            assert 0.0 <= out[f"{prefix}acc_{name}"] <= 1.0
        assert out[f"{prefix}hybrid_wins_vertical_seeds"] in (0, 1)
    assert out["cnn_acc_hybrid_lossless"] == out["cnn_acc_lossless_inference_hybrid_lossless"]
