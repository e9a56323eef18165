"""The robustness grid and Fig. 7 for ``bench/lossy.py``.

Grid: every cell is a data set (digits, and the seeded 8-class ``generated``
set), a depth ``L`` (neuron layers, input and output included; hidden layers
of 128), a device count and a seed. Per cell and seed the budget is the
paper's rule (the simulated time at which *naive*'s epoch-averaged training
loss first drops below 0.5), and hybrid, vertical and horizontal (all lossy,
genetic mapping, 50 x 50 m) train for it; each is tested at half the budget
and at the whole budget (two budgets from one run: a pipelined run tested at
time B/2 is the paper's accuracy-over-time curve). A win is a strictly
higher lossy test accuracy at the same simulated time. Where hybrid and
vertical are the same allocation (``floor(N / 2)`` groups of one layer with
two devices each, e.g. 8 devices on 4 layers) they tie exactly; the shares
count ties as no win, and ``..._distinct`` leaves those cells out.

Fig. 7: hybrid pipelined (EdgePipe) against the same allocation without
pipelining (*Model*: one mini-batch at a time, no staleness) and against
GPipe with vertical allocation (as many micro-batches as devices, a flush per
mini-batch, :mod:`zpipe.lossy.gpipe`), all lossy, over a longer budget, each
run's test accuracy sampled along the way; the time each first reaches 80 %
and the ratios to EdgePipe (paper: 2.47 for *Model*; for GPipe it gives no
number, only that it behaves like vertical and is less stable than hybrid).
A ratio averages over the seeds where both runs reached 80 %.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from zpipe.lossy.data import Dataset, load_dataset
from zpipe.lossy.simulate import RunConfig, run_training

GRID_ALLOCATIONS = ("hybrid", "vertical", "horizontal")
FIG7_TARGET = 0.80

#: ``(base config, data) -> (budget_s, naive mini-batches, reached)``
BudgetRule = Callable[[RunConfig, Dataset], tuple[float, int, bool]]


@dataclass(frozen=True)
class GridSpec:
    datasets: tuple[str, ...]
    depths: tuple[int, ...]
    devices: tuple[int, ...]
    seeds: int
    #: lossy test passes averaged per accuracy (vertical's vary most from pass to pass)
    test_repeats: int = 10


FULL_GRID = GridSpec(("digits", "generated"), (4, 5, 6, 7), (4, 6, 8), seeds=10)
QUICK_GRID = GridSpec(("digits", "generated"), (4, 6), (4, 8), seeds=1)


def run_grid(
    spec: GridSpec, budget_rule: BudgetRule, emit: Callable[[dict[str, Any]], None]
) -> list[dict[str, Any]]:
    """One row per cell, seed and budget: the three allocations' accuracies."""
    rows: list[dict[str, Any]] = []
    for name in spec.datasets:
        data = load_dataset(name)
        for depth in spec.depths:
            for n_devices in spec.devices:
                for seed in range(spec.seeds):
                    rows += _cell(data, depth, n_devices, seed, spec, budget_rule, emit)
    return rows


def _cell(
    data: Dataset,
    depth: int,
    n_devices: int,
    seed: int,
    spec: GridSpec,
    budget_rule: BudgetRule,
    emit: Callable[[dict[str, Any]], None],
) -> list[dict[str, Any]]:
    base = RunConfig(
        n_devices=n_devices,
        seed=seed,
        hidden=(128,) * (depth - 2),
        n_data=1,
        eval_points=2,
        test_repeats=spec.test_repeats,
        curve_test_repeats=spec.test_repeats,
    )
    budget, _, _ = budget_rule(base, data)
    runs = {
        kind: run_training(replace(base, allocation=kind, n_data=None, budget_s=budget), data)
        for kind in GRID_ALLOCATIONS
    }
    rows = []
    for label, index in (("half", 0), ("full", -1)):
        row: dict[str, Any] = {
            "bench": "lossy",
            "kind": "grid",
            "dataset": data.name,
            "layers": depth,
            "devices": n_devices,
            "seed": seed,
            "budget": label,
            "budget_s": budget if label == "full" else budget / 2,
        }
        for kind, run in runs.items():
            row[f"acc_{kind}"] = run["curve"]["test_acc"][index]
            row[f"steps_{kind}"] = run["curve"]["data_done"][index]
        row["same_as_vertical"] = (
            runs["hybrid"]["allocation"]["groups"] == runs["vertical"]["allocation"]["groups"]
            and runs["hybrid"]["allocation"]["super_neurons"]
            == runs["vertical"]["allocation"]["super_neurons"]
        )
        emit(row)
        rows.append(row)
    return rows


def grid_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Win shares over every cell, seed and budget, and the table per cell."""
    n = len(rows)
    wins_v = sum(r["acc_hybrid"] > r["acc_vertical"] for r in rows)
    distinct = [r for r in rows if not r["same_as_vertical"]]
    wins_h = sum(r["acc_hybrid"] > r["acc_horizontal"] for r in rows)
    cells: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        cells[(r["dataset"], r["layers"], r["devices"], r["budget"])].append(r)
    table = []
    for (dataset, layers, devices, budget), group in sorted(cells.items()):
        table.append(
            {
                "dataset": dataset,
                "layers": layers,
                "devices": devices,
                "budget": budget,
                "seeds": len(group),
                **{
                    f"acc_{kind}": round(statistics.fmean(r[f"acc_{kind}"] for r in group), 4)
                    for kind in GRID_ALLOCATIONS
                },
                **{
                    f"steps_{kind}": round(statistics.fmean(r[f"steps_{kind}"] for r in group))
                    for kind in GRID_ALLOCATIONS
                },
                "hybrid_wins_vertical": sum(r["acc_hybrid"] > r["acc_vertical"] for r in group),
                "hybrid_wins_horizontal": sum(r["acc_hybrid"] > r["acc_horizontal"] for r in group),
            }
        )
    # hybrid's win share over vertical per value of each axis (distinct allocations)
    by: dict[str, dict[Any, float]] = {}
    for key in ("dataset", "layers", "devices", "budget"):
        groups: dict[Any, list[bool]] = defaultdict(list)
        for r in distinct:
            groups[r[key]].append(r["acc_hybrid"] > r["acc_vertical"])
        by[key] = {str(k): round(sum(v) / len(v), 3) for k, v in sorted(groups.items())}
    return {
        "grid_runs": n,
        "hybrid_wins_share_vertical": wins_v / n if n else None,
        "hybrid_wins_share_horizontal": wins_h / n if n else None,
        "hybrid_wins_share_vertical_distinct": (
            sum(r["acc_hybrid"] > r["acc_vertical"] for r in distinct) / len(distinct)
            if distinct
            else None
        ),
        "grid_runs_same_as_vertical": n - len(distinct),
        "hybrid_wins_share_vertical_by": by,
        "grid_table": table,
    }


def time_to(run: dict[str, Any], target: float) -> float | None:
    """Simulated seconds until the run's test accuracy first reaches ``target``."""
    for t, acc in zip(run["curve"]["time_s"], run["curve"]["test_acc"], strict=True):
        if acc >= target:
            return float(t)
    return None


def fig7(
    data: Dataset,
    budgets: Sequence[float],
    *,
    n_devices: int,
    region_m: float,
    factor: float,
    eval_points: int,
    emit: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """Time to 80 % test accuracy: hybrid pipelined against hybrid without pipelining
    and against GPipe on a vertical allocation."""
    times: dict[str, list[float | None]] = {"edgepipe": [], "model": [], "gpipe": []}
    finals: dict[str, list[float]] = {name: [] for name in times}
    for seed, budget in enumerate(budgets):
        base = RunConfig(
            allocation="hybrid",
            n_devices=n_devices,
            region_m=region_m,
            seed=seed,
            budget_s=budget * factor,
            eval_points=eval_points,
            test_repeats=1,
        )
        variants = (
            ("edgepipe", base),
            ("model", replace(base, pipelined=False)),
            ("gpipe", replace(base, allocation="vertical", gpipe=True)),
        )
        for name, cfg in variants:
            run = run_training(cfg, data)
            reached = time_to(run, FIG7_TARGET)
            times[name].append(reached)
            finals[name].append(run["final_test_acc"])
            emit(
                {
                    "bench": "lossy",
                    "kind": "fig7",
                    "config": name,
                    "seed": seed,
                    "budget_s": cfg.budget_s,
                    "mini_batches": run["n_data"],
                    "final_test_acc": run["final_test_acc"],
                    "time_to_80pct_s": reached,
                }
            )
    model_ratio, model_n = _time_ratio(times["model"], times["edgepipe"])
    gpipe_ratio, gpipe_n = _time_ratio(times["gpipe"], times["edgepipe"])
    return {
        "time_to_80pct_model_over_edgepipe": model_ratio,
        "time_to_80pct_gpipe_over_edgepipe": gpipe_ratio,
        "time_to_80pct_s": {
            name: statistics.fmean(t for t in ts if t is not None) if any(ts) else None
            for name, ts in times.items()
        },
        "time_to_80pct_seeds_reached": model_n,
        "time_to_80pct_seeds_reached_gpipe": gpipe_n,
        "time_to_80pct_reached_by": {
            name: sum(t is not None for t in ts) for name, ts in times.items()
        },
        "fig7_final_acc": {name: statistics.fmean(a) for name, a in finals.items() if a},
    }


def _time_ratio(
    other: Sequence[float | None], edgepipe: Sequence[float | None]
) -> tuple[float | None, int]:
    """Mean time of ``other`` over mean time of EdgePipe, on seeds where both got there."""
    both = [(o, e) for o, e in zip(other, edgepipe, strict=True) if o is not None and e is not None]
    if not both:
        return None, 0
    return statistics.fmean(o for o, _ in both) / statistics.fmean(e for _, e in both), len(both)
