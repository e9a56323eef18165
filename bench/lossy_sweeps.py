"""EdgePipe's Fig. 6 (the ``M_layers`` sweep) and Fig. 10(a) (the depth sweep)
for ``bench/lossy.py``, simulated.

Fig. 6: the 6-layer network on 6 devices, partitioned into groups of exactly
``M`` layers from the output end (:func:`zpipe.lossy.partition.partition_layers`:
``M = 1`` is vertical, ``M = 6`` horizontal, ``M = 2`` Algorithm 1's hybrid),
all lossy, at the main section's per-seed budget (naive's loss < 0.5). Per
``M``: (a) the timeslots and simulated time to train 20 epochs (Theorem 1's
count times the timeslot; lossless, one send per message), (b) test accuracy
and transmission cost (data and ACK transmissions per simulated second per
device) at the budget, (c) the worst seed's accuracy beside the mean (the
paper's distribution over test runs). Paper: ``M = 2`` best, 18.05 points above
vertical and 67.25 above horizontal.

Fig. 10(a): 6 devices, depths ``L`` from 4 to 10 neuron layers (2 to 8 hidden
layers of 128, Table I), hybrid, vertical and horizontal, lossy, each at its
depth's naive budget; the cells are the robustness grid's (``digits``, 6
devices, the whole budget), reusing the grid's rows where it already ran them.
Paper: hybrid keeps high accuracy and beats vertical "in most cases" beyond six
layers, where vertical gives whole layers to single devices.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from bench.lossy_grid import GRID_ALLOCATIONS, BudgetRule, GridSpec, run_grid
from zpipe.lossy.data import Dataset
from zpipe.lossy.simulate import RunConfig, run_training

FIG6_EPOCHS = 20
FULL_DEPTHS = (4, 5, 6, 7, 8, 9, 10)
QUICK_DEPTHS = (4, 6, 8)
DEPTH_DEVICES = 6

Emit = Callable[[dict[str, Any]], None]


def _transmissions(run: dict[str, Any]) -> int:
    return sum(
        int(run["traffic"][k]["data_tx"]) + int(run["traffic"][k]["ack_tx"])
        for k in ("forward", "backward", "share")
        if k in run["traffic"]
    )


def m_layers_sweep(
    data: Dataset,
    budgets: Sequence[float],
    *,
    n_devices: int,
    region_m: float,
    test_repeats: int,
    emit: Emit,
) -> dict[str, Any]:
    """Fig. 6: accuracy, cost and 20-epoch time per ``M_layers``, one run per seed."""
    defaults = RunConfig(n_data=1)  # Table I's network and batch
    n_layers = len(defaults.hidden) + 2
    per_epoch = max(1, len(data.x_train) // defaults.batch_size)
    epochs_data = FIG6_EPOCHS * per_epoch
    by_m: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for seed, budget in enumerate(budgets):
        base = RunConfig(
            allocation="hybrid",
            n_devices=n_devices,
            region_m=region_m,
            seed=seed,
            budget_s=budget,
            eval_points=2,
            test_repeats=test_repeats,
        )
        for m in range(1, n_layers + 1):
            if -(-n_layers // m) > n_devices:  # more groups than devices
                continue
            run = run_training(replace(base, max_layers=m), data)
            period = run["pipeline_period"]
            slots_20 = (epochs_data - 1) * period + 2 * n_layers - 1
            row = {
                "bench": "lossy",
                "kind": "m_layers",
                "m_layers": m,
                "seed": seed,
                "budget_s": budget,
                "acc": run["final_test_acc"],
                "mini_batches": run["n_data"],
                "pipeline_period": period,
                "timeslot_ms": run["timeslot_ms"],
                "timeslots_20_epochs": slots_20,
                "time_20_epochs_s": slots_20 * run["timeslot_ms"] / 1000.0,
                "tx_per_s_per_device": _transmissions(run) / run["train_time_s"] / n_devices,
            }
            emit(row)
            by_m[m].append(row)
    if not by_m:
        return {}
    table = {
        str(m): {
            "seeds": len(rows),
            "acc_mean": statistics.fmean(r["acc"] for r in rows),
            "acc_std": statistics.pstdev(r["acc"] for r in rows),
            "acc_min": min(r["acc"] for r in rows),
            "mini_batches_mean": statistics.fmean(r["mini_batches"] for r in rows),
            "timeslots_20_epochs": rows[0]["timeslots_20_epochs"],
            "time_20_epochs_s": rows[0]["time_20_epochs_s"],
            "tx_per_s_per_device": statistics.fmean(r["tx_per_s_per_device"] for r in rows),
        }
        for m, rows in sorted(by_m.items())
    }
    acc = {m: row["acc_mean"] for m, row in table.items()}
    best = max(acc, key=lambda m: acc[m])
    first, last = min(by_m), max(by_m)
    return {
        "m_layers_acc": acc,
        "m_layers_acc_min": {m: row["acc_min"] for m, row in table.items()},
        "m_layers_timeslots_20_epochs": {m: row["timeslots_20_epochs"] for m, row in table.items()},
        "m_layers_time_20_epochs_s": {m: row["time_20_epochs_s"] for m, row in table.items()},
        "m_layers_tx_per_s_per_device": {m: row["tx_per_s_per_device"] for m, row in table.items()},
        "m_layers_best": int(best),
        "m_layers_2_minus_vertical": acc.get("2", float("nan")) - acc[str(first)],
        "m_layers_2_minus_horizontal": acc.get("2", float("nan")) - acc[str(last)],
        "m_layers_seeds": len(budgets),
        "m_layers_table": table,
    }


def depth_sweep(
    depths: Sequence[int],
    seeds: int,
    budget_rule: BudgetRule,
    emit: Emit,
    *,
    grid_rows: Sequence[dict[str, Any]] = (),
    test_repeats: int = 10,
) -> dict[str, Any]:
    """Fig. 10(a): the three allocations on 6 devices per depth, at the whole budget."""

    def ours(r: dict[str, Any]) -> bool:
        return (
            r["dataset"] == "digits"
            and r["devices"] == DEPTH_DEVICES
            and r["budget"] == "full"
            and r["layers"] in depths
            and r["seed"] < seeds
        )

    rows = [r for r in grid_rows if ours(r)]
    have = {(r["layers"], r["seed"]) for r in rows}
    missing = [d for d in depths if any((d, s) not in have for s in range(seeds))]
    if missing:
        spec = GridSpec(("digits",), tuple(missing), (DEPTH_DEVICES,), seeds, test_repeats)
        new = run_grid(spec, budget_rule, lambda row: emit({**row, "kind": "depth"}))
        rows += [r for r in new if ours(r) and (r["layers"], r["seed"]) not in have]
    if not rows:
        return {}
    by_depth: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_depth[r["layers"]].append(r)
    acc = {
        str(d): {k: statistics.fmean(r[f"acc_{k}"] for r in group) for k in GRID_ALLOCATIONS}
        for d, group in sorted(by_depth.items())
    }
    wins_v = sum(r["acc_hybrid"] > r["acc_vertical"] for r in rows)
    wins_h = sum(r["acc_hybrid"] > r["acc_horizontal"] for r in rows)
    deep = [r for r in rows if r["layers"] > DEPTH_DEVICES]
    return {
        "depth_acc": acc,
        "depth_hybrid_wins_share_vertical": wins_v / len(rows),
        "depth_hybrid_wins_share_horizontal": wins_h / len(rows),
        "depth_hybrid_wins_share_vertical_beyond_6": (
            sum(r["acc_hybrid"] > r["acc_vertical"] for r in deep) / len(deep) if deep else None
        ),
        "depth_runs": len(rows),
        "depth_seeds": seeds,
    }
