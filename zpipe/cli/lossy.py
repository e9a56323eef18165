"""Lossy-link experiments on one machine (EdgePipe Figs. 5 and 9).

::

    python -m zpipe lossy --allocation vertical hybrid horizontal naive \\
        --devices 6 --region 50 --seeds 5 --out results/lossy

runs every allocation on seeds ``0 .. seeds-1`` (a seed fixes placement, links,
initial weights, data order and drops, so allocations are compared on the
same devices) and writes ``results.json`` plus ``training.png`` (Fig. 5:
training loss and test accuracy against simulated training time, propagation
rate). ``--sweep region --sweep-values 25,50,75,100`` (or ``exponent``,
``devices``) repeats that per value and adds ``sweep_<name>.png`` (Fig. 9).

``--multiprocess`` trains each configuration across real processes on this
machine instead: a local cluster of ordinary stages (one ``python -m zpipe.stage``
per device and a coordinator, started for the command), on which the runs go as
with ``--coordinator``; each is checked against the in-process simulation (same
dropped messages, same weights) and the command writes those runs' numbers (no
plots)::

    python -m zpipe lossy --multiprocess --allocation hybrid \
        --devices 6 --seeds 1 --steps 20 --out results/lossy-mp

``--model cnn`` trains Fig. 10(c)'s CNN instead (three convolution layers, each
whole on one device, and four dense layers whose super neurons ``--allocation``
places; :mod:`zpipe.lossy.cnn`), in the simulation only; it needs square
one-channel images (digits; the generated set is a feature vector and is refused).

Training length is either ``--steps`` mini-batches for every configuration or
``--budget-s`` seconds of simulated time, in which each allocation finishes as
many mini-batches as its timeslot and pipeline allow (the paper's comparison);
``--recovery rtx|ack`` copies and acknowledgements are charged on that clock
(:mod:`zpipe.lossy.airtime`), so they fit fewer mini-batches. Counts, seeds
and sizes are bounded (see ``--help``) so a typo is refused, not allocated.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from zpipe._errors import ConfigError, ZpipeError
from zpipe.cli.common import (
    at_most,
    existing_dir,
    non_negative_int,
    positive_float,
    positive_int,
)
from zpipe.devices import single_threaded_blas
from zpipe.lossy.cnn import PAPER_CHANNELS, CnnSpec
from zpipe.lossy.data import Dataset, load_dataset
from zpipe.lossy.linkmodes import WAIT_MODES
from zpipe.lossy.links import RECOVERY_SCHEMES, Recovery
from zpipe.lossy.partition import ALLOCATION_KINDS
from zpipe.lossy.radio import RadioModel
from zpipe.lossy.results_json import dumps_strict, write_results
from zpipe.lossy.simulate import (
    MAX_DATA,
    MAX_DEVICES,
    MAX_EVAL_POINTS,
    MAX_PARAMETERS,
    MODELS,
    RunConfig,
    run_training,
)

SWEEPS = ("exponent", "devices", "region")
# Far above what the experiment is for (EdgePipe's: 6 devices, 128 neurons wide,
# 5 seeds), far below what would exhaust memory or run for days.
MAX_WIDTH = 1 << 16
MAX_HIDDEN_LAYERS = 64
MAX_SEEDS = 10_000
MAX_SEED = (1 << 32) - 1
MAX_REPEATS = 1000
MAX_COPIES = 16
DEFAULT_STEPS = 400
MAX_CHANNELS = 4096
MAX_CONV_LAYERS = 16
#: hidden dense widths when --hidden is not given: the paper's DNN, and its CNN's head
DEFAULT_HIDDEN = {"mlp": [128, 128, 128, 128], "cnn": [128, 128, 128]}


def _list_of(parse: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def parse_list(text: str) -> list[Any]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError("expected a comma-separated list")
        return [parse(item) for item in items]

    return parse_list


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m zpipe lossy",
        description="Simulate EdgePipe lossy-link training; write JSON results and PNG plots.",
    )
    p.add_argument(
        "--allocation",
        nargs="+",
        choices=ALLOCATION_KINDS,
        default=["hybrid"],
        help="allocations to run (several allowed; default: hybrid)",
    )
    p.add_argument(
        "--devices",
        type=at_most(positive_int, MAX_DEVICES, "devices"),
        default=6,
        help="edge devices (default 6)",
    )
    p.add_argument(
        "--region", type=positive_float, default=50.0, help="side of the square region, m"
    )
    p.add_argument(
        "--seeds",
        type=at_most(positive_int, MAX_SEEDS, "seeds"),
        default=5,
        help="seeds 0..N-1 (default 5)",
    )
    p.add_argument(
        "--seed-base",
        type=at_most(non_negative_int, MAX_SEED, "a 32-bit seed"),
        default=0,
        help="first seed (default 0)",
    )
    p.add_argument("--out", type=Path, required=True, help="directory for results and plots")
    length = p.add_mutually_exclusive_group()
    length.add_argument(
        "--steps",
        type=at_most(positive_int, MAX_DATA, "mini-batches"),
        help=f"mini-batches per run (default {DEFAULT_STEPS})",
    )
    length.add_argument(
        "--budget-s",
        type=positive_float,
        help="simulated training time per run, s (each allocation fits what it can)",
    )
    p.add_argument("--lossless", action="store_true", help="deliver every message")
    p.add_argument("--recovery", choices=RECOVERY_SCHEMES, default="none")
    p.add_argument("--rtx-copies", type=at_most(positive_int, MAX_COPIES, "copies"), default=2)
    p.add_argument(
        "--ack-attempts",
        type=at_most(positive_int, MAX_COPIES, "sends"),
        default=4,
        help="ACK deadline in sends",
    )
    p.add_argument("--mapping", choices=("genetic", "exhaustive", "random"), default="genetic")
    p.add_argument("--path-loss-exponent", type=positive_float, default=3.1)
    p.add_argument(
        "--sweep", choices=SWEEPS, help="sweep path-loss exponent, device count or region"
    )
    p.add_argument(
        "--sweep-values", type=_list_of(positive_float), help="comma-separated sweep values"
    )
    p.add_argument(
        "--dataset",
        default="digits",
        help="digits or generated (built in), or a name for --idx-dir",
    )
    p.add_argument(
        "--idx-dir", type=Path, help="directory of MNIST-format IDX files (e.g. Fashion-MNIST)"
    )
    p.add_argument(
        "--limit-train", type=positive_int, help="use only the first N training examples"
    )
    p.add_argument(
        "--hidden",
        type=_list_of(at_most(positive_int, MAX_WIDTH, "neurons per layer")),
        help="hidden dense widths, comma-separated (default: 128,128,128,128; with "
        "--model cnn 128,128,128, the paper's four dense layers with the output)",
    )
    cnn = p.add_argument_group("the CNN (EdgePipe Fig. 10(c))")
    cnn.add_argument(
        "--model",
        choices=MODELS,
        default="mlp",
        help="mlp, or cnn: convolution layers allocated layer-wise (each whole on one "
        "device), the dense head partitioned by --allocation (needs square images: digits)",
    )
    cnn.add_argument(
        "--conv-channels",
        type=_list_of(at_most(positive_int, MAX_CHANNELS, "filters")),
        help="with --model cnn: filters per convolution layer (default 32,64,64)",
    )
    cnn.add_argument(
        "--conv-devices",
        type=at_most(non_negative_int, MAX_DEVICES, "devices"),
        help="with --model cnn: devices for the convolution layers (default 0: one per "
        "layer while the dense head keeps four)",
    )
    p.add_argument("--lr", type=positive_float, default=0.01)
    p.add_argument("--batch-size", type=positive_int, default=100)
    p.add_argument(
        "--eval-points", type=at_most(positive_int, MAX_EVAL_POINTS, "test passes"), default=20
    )
    p.add_argument(
        "--test-repeats", type=at_most(positive_int, MAX_REPEATS, "test passes"), default=5
    )
    p.add_argument("--no-plots", action="store_true", help="write only results.json")
    mp = p.add_argument_group("multi-process runs")
    mp.add_argument(
        "--multiprocess",
        action="store_true",
        help="train on a local cluster of ordinary stages started for the command "
        "(--devices of them) and compare with the simulation",
    )
    mp.add_argument(
        "--wait-mode",
        choices=WAIT_MODES,
        default="emulated",
        help="emulated: receivers know which partials were lost (fast); "
        "deadline: they wait out each timeslot (default emulated)",
    )
    mp.add_argument(
        "--slot-s", type=positive_float, default=0.1, help="deadline mode's timeslot, s"
    )
    st = p.add_argument_group("runs on ordinary stages")
    st.add_argument(
        "--coordinator",
        metavar="EP",
        help="train on the stages of the coordinator at EP (python -m zpipe coordinator and "
        "python -m zpipe.stage) and compare with the simulation; uses --wait-mode, --slot-s",
    )
    st.add_argument(
        "--keys",
        type=existing_dir,
        metavar="DIR",
        help="with --coordinator: the directory of CurveZMQ key pairs (the client's)",
    )
    st.add_argument(
        "--wait-for-stages-s",
        type=at_most(positive_float, 86400.0, "a day"),
        default=30.0,
        help="with --coordinator: how long the coordinator waits for --devices stages",
    )
    st.add_argument(
        "--on-death",
        choices=("null-fill", "remap"),
        default="null-fill",
        help="with --coordinator or --multiprocess: a stage that dies mid-run has its "
        "partials null-filled to the end, or its super neurons re-mapped onto the "
        "survivors (emulated --wait-mode only)",
    )
    st.add_argument(
        "--replica-every",
        type=at_most(positive_int, MAX_DATA, "the most mini-batches"),
        default=None,
        metavar="K",
        help="with --on-death remap: each stage sends the coordinator its slices every K "
        "mini-batches, and a dead stage's neurons resume from its latest (default: from "
        "their initial values)",
    )
    return p


def configs_from_args(args: argparse.Namespace) -> list[tuple[RunConfig, float | None]]:
    """Every (config, sweep value) the arguments ask for."""
    if (args.sweep is None) != (args.sweep_values is None):
        raise ConfigError("--sweep and --sweep-values go together")
    if args.hidden is not None and len(args.hidden) > MAX_HIDDEN_LAYERS:
        raise ConfigError(f"at most {MAX_HIDDEN_LAYERS} hidden layers, got {len(args.hidden)}")
    if args.seed_base + args.seeds - 1 > MAX_SEED:
        raise ConfigError(f"seeds must stay below 2^32: --seed-base + --seeds - 1 > {MAX_SEED}")
    steps = args.steps if args.steps is not None or args.budget_s is not None else DEFAULT_STEPS
    base = RunConfig(
        n_devices=args.devices,
        region_m=args.region,
        hidden=tuple(args.hidden or DEFAULT_HIDDEN[args.model]),
        lr=args.lr,
        batch_size=args.batch_size,
        n_data=steps,
        budget_s=args.budget_s,
        lossless=args.lossless,
        recovery=Recovery(args.recovery, copies=args.rtx_copies, max_attempts=args.ack_attempts),
        mapping=args.mapping,
        radio=RadioModel(path_loss_exponent=args.path_loss_exponent),
        eval_points=args.eval_points,
        test_repeats=args.test_repeats,
        **model_options(args),
    )
    values: Sequence[float | None] = args.sweep_values or [None]
    out = []
    for value in values:
        for kind in args.allocation:
            for seed in range(args.seed_base, args.seed_base + args.seeds):
                cfg = replace(base, allocation=kind, seed=seed)
                if args.sweep == "exponent" and value is not None:
                    cfg = replace(cfg, radio=cfg.radio.with_exponent(value))
                elif args.sweep == "devices" and value is not None:
                    if value != int(value) or not 1 <= value <= MAX_DEVICES:
                        raise ConfigError(
                            f"device counts must be positive integers up to {MAX_DEVICES}, "
                            f"got {value}"
                        )
                    cfg = replace(cfg, n_devices=int(value))
                elif args.sweep == "region" and value is not None:
                    cfg = replace(cfg, region_m=value)
                out.append((cfg, value))
    return out


def model_options(args: argparse.Namespace) -> dict[str, Any]:
    """The RunConfig fields of ``--model`` and its CNN options (refused with an MLP)."""
    if args.model != "cnn":
        if args.conv_channels is not None or args.conv_devices is not None:
            raise ConfigError("--conv-channels and --conv-devices go with --model cnn")
        return {}
    channels = args.conv_channels or list(PAPER_CHANNELS)
    if len(channels) > MAX_CONV_LAYERS:
        raise ConfigError(f"at most {MAX_CONV_LAYERS} convolution layers, got {len(channels)}")
    return {
        "model": "cnn",
        "conv_channels": tuple(channels),
        "conv_devices": args.conv_devices or 0,
    }


def check_model_fits(args: argparse.Namespace, data: Dataset) -> None:
    """A CNN needs square images (digits: 8 x 8) and a network of bounded size."""
    if args.model == "cnn":
        configs = configs_from_args(args)
        cfg = configs[0][0]
        spec = CnnSpec.for_features(
            data.n_features, data.n_classes, channels=cfg.conv_channels, hidden=cfg.hidden
        )
        if spec.n_parameters > MAX_PARAMETERS:
            raise ConfigError(
                f"the CNN holds {spec.n_parameters} weights, more than {MAX_PARAMETERS}; "
                "use fewer filters or narrower layers"
            )


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and spread over seeds per (configuration, sweep value)."""
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        groups[(run["config"]["label"], run.get("sweep_value"))].append(run)
    rows = []
    for (label, value), group in groups.items():
        acc = [r["final_test_acc"] for r in group]
        rows.append(
            {
                "label": label,
                "sweep_value": value,
                "seeds": len(group),
                "test_acc_mean": float(np.mean(acc)),
                "test_acc_std": float(np.std(acc)),
                "test_acc_lossless_mean": float(
                    np.mean([r["final_test_acc_lossless"] for r in group])
                ),
                "train_loss_mean": float(np.mean([r["final_train_loss"] for r in group])),
                "propagation_rate_mean": float(np.mean([r["propagation_rate"] for r in group])),
                "mean_prr": float(np.mean([r["mean_prr"] for r in group])),
                "n_data_mean": float(np.mean([r["n_data"] for r in group])),
                "train_time_s_mean": float(np.mean([r["train_time_s"] for r in group])),
                "tx_factor_mean": float(np.mean([r["tx_factor"] for r in group])),
            }
        )
    return rows


def _main_on_stages(
    args: argparse.Namespace,
    argv: Sequence[str] | None,
    configs: list[tuple[RunConfig, float | None]],
    data: Dataset,
) -> int:
    from zpipe.cli.lossy_on_stages import run_on_local_cluster, run_stage_configs

    args.out.mkdir(parents=True, exist_ok=True)
    try:
        with single_threaded_blas():
            if args.multiprocess:
                rows = run_on_local_cluster(args, configs, data)
            else:
                rows = run_stage_configs(args, configs, data)
    except ZpipeError as exc:  # a cluster that is not there, a run that failed
        print(f"python -m zpipe lossy: error: {exc}", file=sys.stderr)
        return 1
    results = write_results(
        args.out / "results.json",
        {"argv": list(sys.argv[1:] if argv is None else argv), "runs": rows},
    )
    for row in rows:
        print(dumps_strict({k: v for k, v in row.items() if k not in ("config", "traffic")}))
    print(f"wrote {results}", file=sys.stderr)
    return 0 if all(row["matches_simulation"] for row in rows) else 1


def check_out_dir(out: Path) -> None:
    """``--out`` must be a directory or not exist yet (it is created)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory; name a directory")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_out_dir(args.out)
        configs = configs_from_args(args)
        data = load_dataset(args.dataset, idx_dir=args.idx_dir)
        if args.limit_train is not None:
            data = data.limit(n_train=args.limit_train)
        check_model_fits(args, data)
    except ConfigError as exc:
        parser.error(str(exc))
    if args.coordinator is not None and args.multiprocess:
        parser.error("--coordinator runs on that cluster's stages: it takes no --multiprocess")
    if args.keys is not None and args.coordinator is None:
        parser.error("--keys goes with --coordinator")
    if args.model == "cnn" and args.on_death == "remap":
        parser.error("--on-death remap re-maps dense super neurons: not with --model cnn")
    if args.on_death == "remap" and args.wait_mode != "emulated":
        parser.error("--on-death remap needs --wait-mode emulated (a hold breaks deadlines)")
    if args.replica_every is not None and args.on_death != "remap":
        parser.error("--replica-every goes with --on-death remap")
    if args.on_death != "null-fill" and args.coordinator is None and not args.multiprocess:
        # in one process no stage can die: a remap asked for here would silently do nothing
        parser.error("--on-death remap goes with --coordinator or --multiprocess")
    if args.coordinator is not None or args.multiprocess:
        return _main_on_stages(args, argv, configs, data)
    if not args.no_plots:
        try:
            from zpipe.lossy.plots import require_matplotlib

            require_matplotlib()
        except ConfigError as exc:
            parser.error(str(exc))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.model == "cnn":  # loaded before the runs, so they run it on one thread
        import zpipe.lossy.torch_cnn  # noqa: F401
    runs = []
    for k, (cfg, value) in enumerate(configs, 1):
        try:
            with single_threaded_blas():
                run = run_training(cfg, data)
        except ConfigError as exc:
            parser.error(f"{cfg.label} seed {cfg.seed}: {exc}")
        run["sweep_value"] = value
        runs.append(run)
        print(
            f"[{k}/{len(configs)}] {cfg.label} seed={cfg.seed}"
            + (f" {args.sweep}={value:g}" if value is not None else "")
            + f" acc={run['final_test_acc']:.3f} prop={run['propagation_rate']:.3f}"
            f" prr={run['mean_prr']:.2f} steps={run['n_data']}",
            file=sys.stderr,
        )
    summary = summarize(runs)
    payload = {
        "argv": list(sys.argv[1:] if argv is None else argv),
        "dataset": data.name,
        "sweep": args.sweep,
        "summary": summary,
        "runs": runs,
    }
    written = [write_results(args.out / "results.json", payload, indent=1)]
    if not args.no_plots:
        from zpipe.lossy.plots import plot_sweep, plot_training

        written += plot_training(runs, args.out, sweep=args.sweep)
        if args.sweep is not None:
            written += plot_sweep(runs, args.sweep, args.out)
    for row in summary:
        print(dumps_strict(row))
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
