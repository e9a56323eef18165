"""PNG plots of federated simulations (Eco-FL Figs. 7-9)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from zpipe.lossy.plots import require_matplotlib


def plot_accuracy(runs: list[dict[str, Any]], path: Path, *, title: str) -> Path:
    """Figs. 7 and 8: test accuracy against simulated time, mean over seeds per method."""
    plt = require_matplotlib()
    by_method: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        by_method[run["method"]].append(run)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for method, group in by_method.items():
        n = min(len(r["curve"]["test_acc"]) for r in group)
        t = np.asarray(group[0]["curve"]["time_s"][:n])
        y = np.mean([r["curve"]["test_acc"][:n] for r in group], axis=0)
        ax.plot(t, y, label=f"{method} ({len(group)} seeds)")
    ax.set(xlabel="simulated time (s)", ylabel="test accuracy", title=title, ylim=(0, 1))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_lambda(sweep: list[dict[str, Any]], path: Path) -> Path:
    """Fig. 9: mean JS divergence, mean group latency and accuracy against lambda."""
    plt = require_matplotlib()
    values = sorted({float(r["lam"]) for r in sweep})
    labels = ["inf" if np.isinf(v) else f"{v:g}" for v in values]
    panels = (
        ("mean_js", "mean JS divergence of groups"),
        ("mean_group_latency_s", "mean group latency (s)"),
        ("tail_acc", "test accuracy at the budget"),
    )
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    x = np.arange(len(values))
    for ax, (key, name) in zip(axes, panels, strict=True):
        means = [np.mean([r[key] for r in sweep if float(r["lam"]) == v]) for v in values]
        stds = [np.std([r[key] for r in sweep if float(r["lam"]) == v]) for v in values]
        ax.errorbar(x, means, yerr=stds, marker="o", capsize=3)
        ax.set_xticks(x, labels)
        ax.set(xlabel="lambda", ylabel=name)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
