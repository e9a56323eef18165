"""bench/lossy_sweeps.py: Fig. 6's M_layers sweep follows Theorem 1's timeslot counts,
and Fig. 10(a)'s depth sweep reuses the grid's rows instead of rerunning them."""

from __future__ import annotations

from typing import Any

import numpy as np

from bench.lossy_sweeps import depth_sweep, m_layers_sweep
from zpipe.lossy.data import Dataset
from zpipe.lossy.schedule import theorem1_timeslots
from zpipe.lossy.simulate import RunConfig


def _blobs() -> Dataset:
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(10, 12)) * 2
    y = rng.integers(0, 10, size=360)
    x = centers[y] + rng.normal(size=(360, 12))
    return Dataset("blobs", x[:300], y[:300], x[300:], y[300:])


def test_m_layers_sweep_counts_theorem_1_timeslots() -> None:
    rows: list[dict[str, Any]] = []
    out = m_layers_sweep(
        _blobs(), [3.0], n_devices=6, region_m=50.0, test_repeats=1, emit=rows.append
    )
    n_layers = len(RunConfig(n_data=1).hidden) + 2
    assert sorted(int(m) for m in out["m_layers_acc"]) == list(range(1, n_layers + 1))
    n_data = 20 * (300 // 100)  # 20 epochs of 3 mini-batches
    for m in range(1, n_layers + 1):
        want = theorem1_timeslots(n_layers, m, n_data, horizontal=m == n_layers)
        assert out["m_layers_timeslots_20_epochs"][str(m)] == want
    tx = out["m_layers_tx_per_s_per_device"]
    assert tx["1"] < tx[str(n_layers)]  # horizontal crosses the most links
    assert out["m_layers_best"] in range(1, n_layers + 1)
    assert [r["m_layers"] for r in rows] == list(range(1, n_layers + 1))


def _row(layers: int, seed: int, hybrid: float, vertical: float) -> dict[str, Any]:
    return {
        "dataset": "digits",
        "devices": 6,
        "budget": "full",
        "layers": layers,
        "seed": seed,
        "acc_hybrid": hybrid,
        "acc_vertical": vertical,
        "acc_horizontal": 0.1,
    }


def test_depth_sweep_reuses_grid_rows_it_has() -> None:
    def no_budget(cfg: RunConfig, data: Dataset) -> tuple[float, int, bool]:
        raise AssertionError("every cell was in the grid; nothing should run")

    grid = [_row(4, 0, 0.9, 0.8), _row(8, 0, 0.7, 0.75), {**_row(8, 0, 0, 0), "budget": "half"}]
    out = depth_sweep((4, 8), 1, no_budget, lambda row: None, grid_rows=grid)
    assert out["depth_acc"]["4"]["hybrid"] == 0.9
    assert out["depth_acc"]["8"]["vertical"] == 0.75
    assert out["depth_hybrid_wins_share_vertical"] == 0.5
    assert out["depth_hybrid_wins_share_vertical_beyond_6"] == 0.0
    assert out["depth_runs"] == 2
