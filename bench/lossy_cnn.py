"""EdgePipe's Fig. 10(c): the CNN, for ``bench/lossy.py`` (simulated).

The network is the paper's: three convolution layers (32, 64 and 64 filters of
3 x 3, 2 x 2 max-pooling after the second and third) allocated layer-wise,
each whole on one device, and four dense layers (128, 128, 128, 10) whose super
neurons the allocation places (:mod:`zpipe.lossy.cnn`), on digits (8 x 8),
``--devices`` devices (default 8: three for the convolutions, five for the
head, so the head's hybrid differs from horizontal), lossy links in 50 x 50 m.

Per seed, every configuration trains for the same simulated time: the time
the naive CNN (one device, no links) needs until its epoch-averaged training
loss drops below 0.5 (Table III's rule, as the main section). Configurations:
hybrid, vertical and horizontal heads under loss; hybrid without loss (the
paper's *w/o Failure*) and hybrid without pipelining (its *Model*). The
convolution layers' compute (Table II's Raspberry Pi rate on their
multiply-accumulates) sizes the timeslot for all of them alike.

Keys (``cnn_`` prefix): ``cnn_acc_<config>`` (lossy test inference, mean over
seeds), ``cnn_acc_lossless_inference_<config>``, ``cnn_mini_batches``,
``cnn_hybrid_wins_vertical_seeds`` / ``..._horizontal_seeds``, ``cnn_seeds``,
``cnn_budget_s_mean``; each configuration's per-seed line is emitted first.
The same keys with ``cnn_conv1dev_`` give the convolution layers all to one
device (``conv_devices=1``: no link inside the convolution stack, a longer
pipeline period). The generated data set is a feature vector, not an image: it has no CNN row.

Standalone: ``.venv/bin/python bench/lossy_cnn.py [--seeds N] [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import zpipe.lossy.torch_cnn  # noqa: F401  (torch loaded: single_threaded_blas limits it)
from zpipe.devices import single_threaded_blas
from zpipe.lossy.cnn import PAPER_CHANNELS, partition_cnn
from zpipe.lossy.data import Dataset
from zpipe.lossy.schedule import sequential_period, timeslot_ms
from zpipe.lossy.simulate import RunConfig, run_network, run_training

Emit = Callable[[dict[str, Any]], None]

CNN_DEVICES = 8
#: the naive probe's cap, in mini-batches (digits' CNN gets there in about 120)
CNN_PROBE_CAP = 600
LOSS_TARGET = 0.5
CNN_CONFIGS: dict[str, dict[str, Any]] = {
    "hybrid": {"allocation": "hybrid"},
    "vertical": {"allocation": "vertical"},
    "horizontal": {"allocation": "horizontal"},
    "hybrid_lossless": {"allocation": "hybrid", "lossless": True},
    "hybrid_model": {"allocation": "hybrid", "pipelined": False},
}


def cnn_budget(base: RunConfig, data: Dataset) -> tuple[float, int, bool]:
    """Simulated seconds until the naive CNN's epoch-averaged training loss < 0.5:
    ``(budget_s, mini_batches, reached)`` (the cap's time when it never gets there)."""
    per_epoch = max(1, len(data.x_train) // base.batch_size)
    probe = run_training(
        replace(
            base,
            allocation="naive",
            n_data=CNN_PROBE_CAP,
            budget_s=None,
            eval_points=CNN_PROBE_CAP // per_epoch,
            test_repeats=1,
        ),
        data,
    )
    n_data, reached = CNN_PROBE_CAP, False
    for done, loss in zip(probe["curve"]["data_done"], probe["curve"]["train_loss"], strict=True):
        if loss < LOSS_TARGET:
            n_data, reached = done, True
            break
    cnn = run_network(base, data)
    assert cnn is not None
    alloc = partition_cnn("naive", cnn, 1)
    slots = (n_data - 1) * sequential_period(alloc) + 2 * alloc.n_layers - 1
    return slots * timeslot_ms(alloc) / 1000.0, n_data, reached


def cnn_section(
    data: Dataset,
    seeds: int,
    *,
    n_devices: int = CNN_DEVICES,
    region_m: float = 50.0,
    test_repeats: int = 10,
    channels: tuple[int, ...] = PAPER_CHANNELS,
    hidden: tuple[int, ...] = (128, 128, 128),
    emit: Emit,
) -> dict[str, Any]:
    """Fig. 10(c): the CNN's allocations at equal simulated time, ``seeds`` seeds, with
    the convolution layers on one device each (the default) and all on one device."""
    template = RunConfig(
        model="cnn",
        conv_channels=channels,
        hidden=hidden,
        n_devices=n_devices,
        region_m=region_m,
        n_data=1,
        eval_points=2,
        test_repeats=test_repeats,
    )
    budgets = []
    for seed in range(seeds):
        budget, probe_steps, reached = cnn_budget(replace(template, seed=seed), data)
        budgets.append(budget)
        emit(
            {
                "bench": "lossy",
                "kind": "cnn_budget",
                "seed": seed,
                "budget_s": budget,
                "naive_mini_batches": probe_steps,
                "loss_target_reached": reached,
            }
        )
    if not budgets:
        return {}
    return (
        _compare(data, budgets, template, prefix="cnn_", emit=emit)
        | _compare(
            data, budgets, replace(template, conv_devices=1), prefix="cnn_conv1dev_", emit=emit
        )
        | {
            "cnn_seeds": seeds,
            "cnn_devices": n_devices,
            "cnn_budget_s_mean": statistics.fmean(budgets),
        }
    )


def _compare(
    data: Dataset, budgets: Sequence[float], template: RunConfig, *, prefix: str, emit: Emit
) -> dict[str, Any]:
    """Every configuration at each seed's budget; the summary keys under ``prefix``."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CNN_CONFIGS}
    conv_devices = template.conv_devices
    for seed, budget in enumerate(budgets):
        base = replace(template, seed=seed)
        for name, overrides in CNN_CONFIGS.items():
            run = run_training(replace(base, n_data=None, budget_s=budget, **overrides), data)
            runs[name].append(run)
            emit(
                {
                    "bench": "lossy",
                    "kind": "cnn",
                    "config": name,
                    "conv_devices": conv_devices or "auto",
                    "seed": seed,
                    "acc": run["final_test_acc"],
                    "acc_lossless_inference": run["final_test_acc_lossless"],
                    "mini_batches": run["n_data"],
                    "propagation_rate": run["propagation_rate"],
                    "timeslot_ms": run["timeslot_ms"],
                    "pipeline_period": run["pipeline_period"],
                    "groups": run["allocation"]["groups"],
                    "mean_prr": run["mean_prr"],
                    "wall_s": run["wall_s"],
                }
            )
    acc = {name: statistics.fmean(r["final_test_acc"] for r in rs) for name, rs in runs.items()}
    out: dict[str, Any] = {f"{prefix}acc_{name}": value for name, value in acc.items()}
    for name, rs in runs.items():
        out[f"{prefix}acc_lossless_inference_{name}"] = statistics.fmean(
            r["final_test_acc_lossless"] for r in rs
        )
    out[f"{prefix}mini_batches"] = {
        name: statistics.fmean(r["n_data"] for r in rs) for name, rs in runs.items()
    }
    out[f"{prefix}hybrid_wins_vertical_seeds"] = sum(
        h["final_test_acc"] > v["final_test_acc"]
        for h, v in zip(runs["hybrid"], runs["vertical"], strict=True)
    )
    out[f"{prefix}hybrid_wins_horizontal_seeds"] = sum(
        h["final_test_acc"] > z["final_test_acc"]
        for h, z in zip(runs["hybrid"], runs["horizontal"], strict=True)
    )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from bench._common import emit, loadavg, summary
    from zpipe.lossy.data import load_dataset

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--devices", type=int, default=CNN_DEVICES)
    parser.add_argument("--quick", action="store_true", help="1 seed, 2 test repeats")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.devices < 2:
        parser.error("--seeds must be >= 1 and --devices >= 2")
    with single_threaded_blas():
        out = cnn_section(
            load_dataset("digits"),
            1 if args.quick else args.seeds,
            n_devices=args.devices,
            test_repeats=2 if args.quick else 10,
            emit=emit,
        )
    summary("lossy_cnn", **out, load=loadavg())
    return 0


if __name__ == "__main__":
    sys.exit(main())
