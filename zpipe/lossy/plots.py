"""PNG plots of lossy-link experiments (EdgePipe Figs. 5 and 9).

matplotlib is optional (the ``lossy`` extra); :func:`require_matplotlib`
raises a :class:`~zpipe._errors.ConfigError` that says how to install it.
"""

from __future__ import annotations

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


def plot_training(runs: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Fig. 5: (a) training loss and (b) test accuracy against training time, the
    mean over seeds per configuration, and (c) the propagation rate per configuration."""
    plt = require_matplotlib()
    by_label: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        by_label[run["config"]["label"]].append(run)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for label, group in by_label.items():
        for ax, key in ((axes[0], "train_loss"), (axes[1], "test_acc")):
            # seeds of one configuration share their evaluation times up to the budget
            n = min(len(r["curve"][key]) for r in group)
            t = np.mean([r["curve"]["time_s"][:n] for r in group], axis=0) / 60.0
            y = np.mean([r["curve"][key][:n] for r in group], axis=0)
            ax.plot(t, y, marker=".", label=label)
    axes[0].set(xlabel="training time (min)", ylabel="training loss", title="(a) training loss")
    axes[1].set(xlabel="training time (min)", ylabel="test accuracy", title="(b) test accuracy")
    labels = list(by_label)
    fwd = [np.mean([r["forward_rate"] for r in by_label[k]]) for k in labels]
    bwd = [np.mean([r["backward_rate"] for r in by_label[k]]) for k in labels]
    x = np.arange(len(labels))
    axes[2].bar(x - 0.2, fwd, width=0.4, label="forward")
    axes[2].bar(x + 0.2, bwd, width=0.4, label="backward")
    axes[2].set_xticks(x, labels, rotation=30, ha="right")
    axes[2].set(ylabel="successful propagation rate", ylim=(0, 1.05), title="(c) propagation")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "training.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def plot_sweep(runs: list[dict[str, Any]], sweep: str, out_dir: Path) -> list[Path]:
    """Fig. 9: final test accuracy against the swept quantity, one line per configuration."""
    plt = require_matplotlib()
    table: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    prr: dict[float, list[float]] = defaultdict(list)
    for run in runs:
        value = float(run["sweep_value"])
        table[run["config"]["label"]][value].append(run["final_test_acc"])
        prr[value].append(run["mean_prr"])
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for label, points in table.items():
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
    ax.set(xlabel=f"{sweep} (mean PRR)", ylabel="final test accuracy", title=f"sweep: {sweep}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / f"sweep_{sweep}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
