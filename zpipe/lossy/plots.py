"""PNG plots of lossy-link experiments (EdgePipe Figs. 5 and 9).

matplotlib is optional (the ``lossy`` extra); :func:`require_matplotlib`
raises a :class:`~zpipe._errors.ConfigError` that says how to install it.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from zpipe._errors import ConfigError


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend, or a clear error."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # never open a window; we only write files
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError(
            "plots need matplotlib, which is not installed: pip install 'zpipe[lossy]' "
            "(or pass --no-plots to write only the JSON results)"
        ) from exc
    return plt


def run_label(run: dict[str, Any], sweep: str | None = None) -> str:
    """A configuration's name, with its sweep value when there is one: runs of
    different sweep values are never averaged under one label."""
    label = str(run["config"]["label"])
    value = run.get("sweep_value")
    if value is None:
        return label
    return f"{label} ({sweep or 'sweep'}={value:g})"


def group_runs(
    runs: list[dict[str, Any]], sweep: str | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Runs by :func:`run_label` (the seeds of one configuration and sweep value)."""
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        out[run_label(run, sweep)].append(run)
    return dict(out)


def seeds_text(groups: dict[str, list[dict[str, Any]]]) -> str:
    counts = sorted({len(g) for g in groups.values()})
    n = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return f"{n} seed{'s' if counts[-1] > 1 else ''}"


def plot_training(
    runs: list[dict[str, Any]], out_dir: Path, *, sweep: str | None = None
) -> list[Path]:
    """Fig. 5: (a) training loss and (b) test accuracy against simulated training
    time, the mean over seeds per configuration (and sweep value) with a band of
    one standard deviation, and (c) the propagation rate per configuration."""
    plt = require_matplotlib()
    by_label = group_runs(runs, sweep)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    for label, group in by_label.items():
        for ax, key in ((axes[0], "train_loss"), (axes[1], "test_acc")):
            # seeds of one configuration share their evaluation times up to the budget
            n = min(len(r["curve"][key]) for r in group)
            t = np.mean([r["curve"]["time_s"][:n] for r in group], axis=0) / 60.0
            # a diverged or empty interval is NaN (null in results.json): left out
            ys = np.array([r["curve"][key][:n] for r in group], dtype=np.float64)
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                y, spread = np.nanmean(ys, axis=0), np.nanstd(ys, axis=0)
            (line,) = ax.plot(t, y, marker=".", label=f"{label} [{len(group)}]")
            ax.fill_between(t, y - spread, y + spread, color=line.get_color(), alpha=0.15)
    seeds = seeds_text(by_label)
    axes[0].set(
        xlabel="simulated training time (min)",
        ylabel="training loss",
        title=f"(a) training loss: mean of {seeds}, band ±1 std",
    )
    axes[1].set(
        xlabel="simulated training time (min)",
        ylabel="test accuracy",
        title=f"(b) test accuracy: mean of {seeds}, band ±1 std",
    )
    labels = list(by_label)
    fwd = [np.mean([r["forward_rate"] for r in by_label[k]]) for k in labels]
    bwd = [np.mean([r["backward_rate"] for r in by_label[k]]) for k in labels]
    x = np.arange(len(labels))
    axes[2].bar(x - 0.2, fwd, width=0.4, label="forward")
    axes[2].bar(x + 0.2, bwd, width=0.4, label="backward")
    axes[2].set_xticks(x, labels, rotation=30, ha="right")
    axes[2].set(
        ylabel="successful propagation rate",
        ylim=(0, 1.05),
        title=f"(c) propagation: mean of {seeds}",
    )
    for ax in axes:
        ax.grid(alpha=0.3)
    for ax in axes[:2]:
        ax.legend(fontsize=7, title="configuration [seeds]", title_fontsize=7)
    axes[2].legend(fontsize=7)
    fig.suptitle("time is simulated (timeslots x slot duration), not measured", fontsize=9)
    fig.tight_layout()
    path = out_dir / "training.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def _length_text(runs: list[dict[str, Any]]) -> str:
    budgets = {run["config"].get("budget_s") for run in runs}
    if budgets != {None}:
        shown = ", ".join(f"{b:g}" for b in sorted(b for b in budgets if b is not None))
        return f"after {shown} s of simulated training time"
    steps = sorted({run["config"].get("n_data") for run in runs})
    return f"after {', '.join(str(s) for s in steps)} mini-batches"


def plot_sweep(runs: list[dict[str, Any]], sweep: str, out_dir: Path) -> list[Path]:
    """Fig. 9: final test accuracy against the swept quantity, one line per configuration."""
    plt = require_matplotlib()
    table: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    prr: dict[float, list[float]] = defaultdict(list)
    for run in runs:
        value = float(run["sweep_value"])
        table[run["config"]["label"]][value].append(run["final_test_acc"])
        prr[value].append(run["mean_prr"])
    fig, ax = plt.subplots(figsize=(6.5, 4.4))
    counts: set[int] = set()
    for label, points in table.items():
        counts.update(len(v) for v in points.values())
        xs = sorted(points)
        ax.errorbar(
            xs,
            [np.mean(points[v]) for v in xs],
            yerr=[np.std(points[v]) for v in xs],
            marker="o",
            capsize=3,
            label=label,
        )
    xs = sorted(prr)
    ax.set_xticks(xs, [f"{v:g}\n({100 * np.mean(prr[v]):.0f}%)" for v in xs])
    n = "-".join(str(c) for c in sorted({min(counts), max(counts)}))
    ax.set(
        xlabel=f"{sweep} (mean PRR)",
        ylabel="final test accuracy (lossy inference)",
        title=f"sweep: {sweep}; mean of {n} seeds, error bars ±1 std\n{_length_text(runs)}",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / f"sweep_{sweep}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
