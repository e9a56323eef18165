"""``bench/training.py``'s torch section: zpipe's 1F1B against
torch.distributed.pipelining's Schedule1F1B on the same split (split out of that
script to keep it small; behaviour unchanged).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from bench._common import emit
from bench._torch_pipelining_baseline import TorchPipeline, make_batches
from bench._training_common import (
    OPTIMIZER,
    TimedRun,
    _bert_spec,
    _cluster,
    _log,
    _max_abs_diff,
    _measured_link_s,
    _median_run,
    _predict_round,
    _profile,
    _ratio,
    _round,
    _run_line,
    _stage_rows,
    _torch_run,
    _warmups,
    _zpipe_run,
)
from zpipe.cluster import DeviceSpec
from zpipe.models import load_layer_sequence
from zpipe.planner import even_ranges
from zpipe.training.warmup import warmup_counts

TORCH_SYSTEMS = ("zpipe_1f1b", "torch_1f1b", "zpipe_gpipe", "zpipe_1f1b_torch_warmups")


def run_torch(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    """zpipe 1F1B vs torch's Schedule1F1B, and zpipe GPipe's memory: summary keys, ok."""
    spec = _bert_spec(args.hidden, args.seed)
    num_units = load_layer_sequence(spec).num_units
    p, m = args.stages, args.microbatches
    ranges = even_ranges(num_units, p)
    partition = [list(r) for r in ranges]
    cores = os.cpu_count() or 1
    threads = args.threads or max(1, cores // p)
    microbatch_size = args.batch_size // m
    torch_warmups = [min(m, p - i) for i in range(p)]  # Schedule1F1B's warm-up
    warmups = {
        "zpipe_1f1b": _warmups("1f1b", p, m),
        "torch_1f1b": torch_warmups,
        "zpipe_gpipe": _warmups("gpipe", p, m),
        "zpipe_1f1b_torch_warmups": warmup_counts("torch", p, m),
    }
    zpipe_fits: dict[str, dict[str, Any]] = {
        "zpipe_1f1b": {"schedule": "1f1b"},
        "zpipe_gpipe": {"schedule": "gpipe"},
        "zpipe_1f1b_torch_warmups": {"schedule": "1f1b", "warmup": "torch"},
    }
    warm = make_batches(spec, args.warmup_steps, args.batch_size, args.seed + 1)
    batches = make_batches(spec, args.steps, args.batch_size, args.seed)
    _log(
        f"torch section: {p} stages {partition}, M = {m}, {args.batch_size} samples per "
        f"mini-batch, {threads} thread(s) per stage; profiling the units"
    )
    profile = _profile(spec, microbatch_size, threads)  # before any stage process runs
    devices = [DeviceSpec(f"s{i}", threads=threads) for i in range(p)]
    runs: dict[str, list[TimedRun]] = {s: [] for s in TORCH_SYSTEMS}
    started = time.perf_counter()
    with _cluster(devices) as cluster:
        # After the cluster: both starting at once can starve its coordinator of CPU.
        with TorchPipeline(spec, ranges, threads=threads) as pipe:
            _log(f"  started in {time.perf_counter() - started:.1f} s")

            def once(system: str, data: list[Any], steps: int, seed: int) -> TimedRun:
                if system == "torch_1f1b":
                    return _torch_run(
                        pipe,
                        system,
                        schedule="1f1b",
                        num_microbatches=m,
                        batch_size=args.batch_size,
                        batches=steps,
                        seed=seed,
                    )
                return _zpipe_run(
                    cluster,
                    system,
                    spec,
                    data,
                    num_microbatches=m,
                    partition=partition,
                    **zpipe_fits[system],
                )

            for system in TORCH_SYSTEMS:
                t0 = time.perf_counter()
                once(system, warm, args.warmup_steps, args.seed + 1)
                _log(f"  warm-up {system}: {time.perf_counter() - t0:.1f} s")
            for repeat in range(args.repeats):
                order = TORCH_SYSTEMS if repeat % 2 == 0 else TORCH_SYSTEMS[::-1]
                for system in order:
                    result = once(system, batches, args.steps, args.seed)
                    runs[system].append(result)
                    _log(
                        f"  repeat {repeat + 1}/{args.repeats} {system}: steady "
                        f"{result.steady_samples_per_s or 0:.2f} samples/s, whole run "
                        f"{result.samples_per_s:.2f}"
                    )

    medians = {s: _median_run(runs[s]) for s in TORCH_SYSTEMS}
    z1, tt, zg = medians["zpipe_1f1b"], medians["torch_1f1b"], medians["zpipe_gpipe"]
    zk = medians["zpipe_1f1b_torch_warmups"]
    assert z1.report is not None and zg.report is not None
    # Every run trains the same weights on the same data: one loss sequence for all.
    loss_diff = max(
        (d for r in runs["torch_1f1b"] if (d := _max_abs_diff(z1.losses, r.losses)) is not None),
        default=None,
    )
    zpipe_loss_diff = max(
        (
            d
            for s in zpipe_fits
            for r in runs[s]
            if (d := _max_abs_diff(z1.losses, r.losses)) is not None
        ),
        default=None,
    )
    losses_match = loss_diff is not None and loss_diff < 1e-4
    prediction = _predict_round(
        z1.report, profile, microbatch_size, warmups["zpipe_1f1b"], _measured_link_s
    )
    predicted_over_measured = _ratio(prediction["predicted_round_s"], z1.period_s)
    config = {
        "torch_model": "bert-base shrunk",
        "torch_model_config": dict(spec.config),
        "torch_units": num_units,
        "torch_stages": p,
        "torch_partition": partition,
        "torch_microbatches": m,
        "torch_batch_size": args.batch_size,
        "torch_steps": args.steps,
        "torch_repeats": args.repeats,
        "torch_threads_per_stage": threads,
        "cores": cores,
        "optimizer": OPTIMIZER,
    }
    rows: dict[str, list[dict[str, Any]]] = {}
    for system in TORCH_SYSTEMS:
        median = medians[system]
        extra: dict[str, Any] = {"warmups": warmups[system]}
        if median.report is not None:
            rows[system] = extra["stages"] = _stage_rows(median.report)
        if median.torch_run is not None:
            extra["stage_step_busy_s"] = [_round(b) for b in median.torch_run.busy_s]
        if system == "zpipe_1f1b":
            extra["prediction"] = prediction
        emit(_run_line("torch", system, runs[system], median, **extra, **config))

    peak_1f1b = rows["zpipe_1f1b"][0]["peak_activation_bytes"]
    peak_gpipe = rows["zpipe_gpipe"][0]["peak_activation_bytes"]
    keys = {
        "ratio_vs_torch_1f1b": _ratio(z1.steady_samples_per_s, tt.steady_samples_per_s),
        "ratio_vs_torch_1f1b_whole_run": _ratio(z1.samples_per_s, tt.samples_per_s),
        "ratio_vs_torch_1f1b_torch_warmups": _ratio(
            zk.steady_samples_per_s, tt.steady_samples_per_s
        ),
        "auto_over_torch_warmups": _ratio(z1.steady_samples_per_s, zk.steady_samples_per_s),
        "zpipe_1f1b_steady_samples_per_s": _round(z1.steady_samples_per_s),
        "torch_1f1b_steady_samples_per_s": _round(tt.steady_samples_per_s),
        "zpipe_gpipe_steady_samples_per_s": _round(zg.steady_samples_per_s),
        "zpipe_1f1b_torch_warmups_steady_samples_per_s": _round(zk.steady_samples_per_s),
        "zpipe_1f1b_over_gpipe": _ratio(z1.steady_samples_per_s, zg.steady_samples_per_s),
        "loss_max_abs_diff": loss_diff,
        "losses_match_torch": losses_match,
        "zpipe_schedules_loss_max_abs_diff": zpipe_loss_diff,
        "gpipe_over_1f1b_peak_memory_stage0": _ratio(peak_gpipe, peak_1f1b),
        "expected_gpipe_over_1f1b_peak_memory_stage0": round(m / warmups["zpipe_1f1b"][0], 4),
        "warmups_1f1b": warmups["zpipe_1f1b"],
        "peak_activation_bytes_1f1b": [r["peak_activation_bytes"] for r in rows["zpipe_1f1b"]],
        "peak_activation_bytes_gpipe": [r["peak_activation_bytes"] for r in rows["zpipe_gpipe"]],
        "peak_live_activations_1f1b": [r["peak_live_activations"] for r in rows["zpipe_1f1b"]],
        "peak_live_activations_gpipe": [r["peak_live_activations"] for r in rows["zpipe_gpipe"]],
        "zpipe_1f1b_predicted_over_measured_round": predicted_over_measured,
        "predicted_round_s": prediction["predicted_round_s"],
        "measured_round_s": _round(z1.period_s, 5),
        **config,
    }
    return keys, losses_match
