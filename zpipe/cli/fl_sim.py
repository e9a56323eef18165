"""``python -m zpipe fl-sim``: federated learning methods compared in simulated time.

::

    python -m zpipe fl-sim --methods ecofl fedavg fedasync fedat --seeds 3 \\
        --partition rlg-niid --budget-s 2000 --out results/fl
    python -m zpipe fl-sim --methods ecofl --lambdas 0,1,10,100,inf --seeds 3 --out results/fl-lam

writes ``results.json`` (every run's accuracy curve and server statistics),
``accuracy.png`` (accuracy against simulated time per method) and, with
``--lambdas``, ``lambda.png`` (Eco-FL's mean group JS divergence, mean group
latency and accuracy per lambda, like Fig. 9). One JSON line per method (and
per lambda) goes to stdout.

``--pipeline-latency`` makes every client a home of emulated devices whose
latency is its planned pipeline's period (see :mod:`zpipe.federated.simulate`);
``--hidden 32,32,32`` gives the model the layers to spread over those devices.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from zpipe._errors import ConfigError
from zpipe.cli.common import non_negative_float, non_negative_int, positive_float, positive_int
from zpipe.devices import single_threaded_blas
from zpipe.federated.aggregation import STALENESS_FUNCTIONS
from zpipe.federated.data import PARTITIONS
from zpipe.federated.server import METHODS
from zpipe.federated.simulate import MAX_HOME_DEVICES, SimConfig, run_simulation
from zpipe.lossy.data import load_digits_dataset

MAX_CLIENTS = 100_000
TAIL_EVALS = 5  # accuracy at the budget: the mean of the last evaluations (curves are noisy)


def _lambda(text: str) -> float:
    if text.strip().lower() in ("inf", "+inf", "infinity"):
        return math.inf
    return non_negative_float(text)


def _lambdas(text: str) -> list[float]:
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list of lambdas")
    return [_lambda(t) for t in items]


def _alpha(text: str) -> float:
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text!r} must lie in (0, 1]")
    return value


def _widths(text: str) -> list[int]:
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected comma-separated hidden layer widths")
    return [positive_int(t) for t in items]


def _home_sizes(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    sizes = (positive_int(lo), positive_int(hi if sep else lo))
    if sizes[0] > sizes[1] or sizes[1] > MAX_HOME_DEVICES:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected LO-HI with 1 <= LO <= HI <= {MAX_HOME_DEVICES}"
        )
    return sizes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m zpipe fl-sim",
        description="Simulate Eco-FL and baseline federated learning in simulated time.",
    )
    p.add_argument("--methods", nargs="+", choices=METHODS, default=["ecofl", "fedavg"])
    p.add_argument("--seeds", type=positive_int, default=3, help="seeds 0..N-1 (default 3)")
    p.add_argument("--clients", type=positive_int, default=300, help="clients (default 300)")
    p.add_argument("--groups", type=positive_int, default=5, help="latency groups (default 5)")
    p.add_argument("--concurrent", type=positive_int, default=20, help="K: clients in flight")
    p.add_argument("--lam", type=_lambda, default=10.0, help="eq. 4's lambda, s (inf allowed)")
    p.add_argument("--lambdas", type=_lambdas, help="also sweep Eco-FL over these lambdas")
    p.add_argument("--rt-factor", type=positive_float, default=1.0, help="RT^g / K-means radius")
    p.add_argument("--alpha", type=_alpha, default=0.6, help="FedAsync mixing alpha")
    p.add_argument("--staleness", choices=STALENESS_FUNCTIONS, default="polynomial")
    p.add_argument("--staleness-a", type=non_negative_float, default=0.5)
    p.add_argument("--intra-syncs", type=positive_int, default=1, help="group averages a round")
    p.add_argument("--mu", type=non_negative_float, default=0.05, help="FedProx mu")
    p.add_argument("--local-steps", type=positive_int, default=10, help="e: SGD steps a task")
    p.add_argument("--batch-size", type=positive_int, default=10)
    p.add_argument("--lr", type=positive_float, default=0.1)
    p.add_argument(
        "--hidden",
        type=_widths,
        default=[32],
        help="hidden layer widths, comma-separated (default 32; e.g. 32,32,32 for a "
        "4-layer MLP whose pipeline clients can use 4 devices)",
    )
    p.add_argument(
        "--pipeline-latency",
        action="store_true",
        help="a client's latency is its home's planned pipeline period (homes of NX, TX2 "
        "and Nano devices; a home of one NX takes --delay-mean), not a random draw",
    )
    p.add_argument(
        "--home-devices",
        type=_home_sizes,
        default=(1, 4),
        metavar="LO-HI",
        help="with --pipeline-latency: devices in a home, drawn in LO..HI (default 1-4)",
    )
    p.add_argument("--samples", type=positive_int, default=40, help="samples per client")
    p.add_argument("--partition", choices=PARTITIONS, default="niid")
    p.add_argument("--delay-mean", type=positive_float, default=10.0, help="base delay mean, s")
    p.add_argument("--delay-std", type=non_negative_float, default=3.0)
    p.add_argument("--change-every", type=positive_float, default=100.0, help="s between changes")
    p.add_argument("--change-prob", type=non_negative_float, default=0.1)
    p.add_argument("--budget-s", type=positive_float, default=2000.0, help="simulated time, s")
    p.add_argument("--eval-every", type=positive_float, default=50.0, help="s between evals")
    p.add_argument("--seed-base", type=non_negative_int, default=0)
    p.add_argument("--out", type=Path, required=True, help="directory for results and plots")
    p.add_argument("--no-plots", action="store_true", help="write only results.json")
    return p


def config_from_args(args: argparse.Namespace, method: str, seed: int) -> SimConfig:
    if args.clients > MAX_CLIENTS:
        raise ConfigError(f"--clients is limited to {MAX_CLIENTS}")
    return SimConfig(
        method=method,
        n_clients=args.clients,
        n_groups=args.groups,
        max_concurrent=args.concurrent,
        lam=args.lam,
        rt_factor=args.rt_factor,
        alpha=args.alpha,
        staleness=args.staleness,
        staleness_a=args.staleness_a,
        intra_syncs=args.intra_syncs,
        mu=args.mu,
        local_steps=args.local_steps,
        batch_size=args.batch_size,
        lr=args.lr,
        hidden=args.hidden[0],
        more_hidden=tuple(args.hidden[1:]),
        pipeline_latency=args.pipeline_latency,
        home_sizes=args.home_devices,
        samples_per_client=args.samples,
        partition=args.partition,
        delay_mean_s=args.delay_mean,
        delay_std_s=args.delay_std,
        change_every_s=args.change_every,
        change_prob=args.change_prob,
        budget_s=args.budget_s,
        eval_every_s=args.eval_every,
        seed=seed,
    )


def tail_accuracy(run: dict[str, Any]) -> float:
    return float(np.mean(run["curve"]["test_acc"][-TAIL_EVALS:]))


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def run_methods(args: argparse.Namespace) -> list[dict[str, Any]]:
    dataset = load_digits_dataset()
    runs = []
    for method in args.methods:
        for k in range(args.seeds):
            run = run_simulation(config_from_args(args, method, args.seed_base + k), dataset)
            run["tail_acc"] = tail_accuracy(run)
            runs.append(run)
        accs = [r["tail_acc"] for r in runs if r["method"] == method]
        print(
            json.dumps(
                {
                    "method": method,
                    "mean_acc": round(float(np.mean(accs)), 4),
                    "accs": [round(a, 4) for a in accs],
                }
            ),
            flush=True,
        )
    return runs


def run_lambda_sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    dataset = load_digits_dataset()
    sweep = []
    for lam in args.lambdas:
        for k in range(args.seeds):
            config = replace(config_from_args(args, "ecofl", args.seed_base + k), lam=lam)
            run = run_simulation(config, dataset)
            sweep.append(
                {
                    "lam": lam,
                    "seed": config.seed,
                    "mean_js": run["stats"]["initial_mean_js"],
                    "mean_group_latency_s": run["stats"]["initial_mean_group_latency_s"],
                    "tail_acc": tail_accuracy(run),
                }
            )
        rows = [r for r in sweep if r["lam"] == lam]
        print(
            json.dumps(
                _json_safe(
                    {
                        "lam": lam,
                        **{
                            key: round(float(np.mean([r[key] for r in rows])), 4)
                            for key in ("mean_js", "mean_group_latency_s", "tail_acc")
                        },
                    }
                )
            ),
            flush=True,
        )
    return sweep


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        with single_threaded_blas():
            runs = run_methods(args)
            sweep = run_lambda_sweep(args) if args.lambdas else []
        (args.out / "results.json").write_text(
            json.dumps(_json_safe({"runs": runs, "lambda_sweep": sweep}), indent=1)
        )
        if not args.no_plots:
            from zpipe.federated.plots import plot_accuracy, plot_lambda

            plot_accuracy(runs, args.out / "accuracy.png", title=f"partition {args.partition}")
            if sweep:
                plot_lambda(sweep, args.out / "lambda.png")
    except ConfigError as exc:
        print(f"python -m zpipe fl-sim: {exc}", file=sys.stderr)
        return 2
    return 0
