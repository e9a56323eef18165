"""``bench/training.py``'s hpp section: hybrid pipeline parallelism against data
parallelism, a straight 1F1B and the even GPipe partition (split out of that
script to keep it small; behaviour unchanged).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Sequence
from typing import Any

from bench._common import emit
from bench._torch_pipelining_baseline import make_batches
from bench._training_common import (
    HETERO_CNN,
    TimedRun,
    _bert_spec,
    _cluster,
    _log,
    _max_abs_diff,
    _median_run,
    _ratio,
    _round,
    _run_line,
    _zpipe_run,
)
from bench._training_hetero import (
    _auto_slowdown_scale,
)
from zpipe.client import TrainReport
from zpipe.cluster import DeviceSpec
from zpipe.models import ModelSpec, load_layer_sequence
from zpipe.planner.schedules import pipeline_actions, simulate

# Four emulated devices, fastest first (Jetson Xavier NX, TX2 and two Nanos, before the
# scale that fits them on this machine's cores). The straight and even plans run through
# them in this order, and so does HPP's DP: it takes the devices in memory order, and
# none declares a memory limit (the models need a few MB), so the listed order stands.
# Fastest first is also the order Eco-FL's order search picks for the CNN's straight
# pipeline, so the straight baseline is not handicapped by it.
HPP_DEVICES = (("nx", 1.0), ("tx2", 1.5), ("nano-a", 3.0), ("nano-b", 3.0))
HPP_SYSTEMS = ("hpp", "data_parallel", "straight_1f1b", "even_gpipe")
HPP_BASELINES = HPP_SYSTEMS[1:]
HPP_FITS: dict[str, dict[str, Any]] = {
    "hpp": {"planner": "hpp", "schedule": "1f1b"},
    "data_parallel": {"planner": "data-parallel", "schedule": "1f1b"},
    "straight_1f1b": {"planner": "straight", "schedule": "1f1b"},
    "even_gpipe": {"planner": "even", "schedule": "gpipe"},
}
# The goals, reported next to the numbers (never used to tune the experiment).
HPP_GOAL_CNN = 1.3
HPP_GOAL_BERT = 1.0
PREDICTION_TOLERANCE = 0.2


def _per(counters: dict[str, Any], key: str, count: int) -> float | None:
    value = counters.get(key)
    return _round(float(value) / count, 5) if value is not None and count else None


def _group_rows(report: TrainReport) -> list[dict[str, Any]]:
    """Per stage of the training plan: the cost model's times beside each device's counters.

    Compute is per micro-batch the device ran (``forward_s`` per forward, ``backward_s``
    per backward: what the device itself computed, its emulated slowdown included);
    all-reduce, optimizer step, idle and send time are per round.
    """
    tplan = report.training_plan
    assert tplan is not None
    pred = tplan.predicted
    steps = report.steps
    rows = []
    for i, stage in enumerate(tplan.stages):
        devices = []
        for name, share in zip(stage.devices, stage.shares, strict=True):
            c = dict(report.stages.get(name) or {})
            forwards, backwards = int(c.get("microbatches") or 0), int(c.get("backwards") or 0)
            devices.append(
                {
                    "device": name,
                    "share": share,
                    "forwards": forwards,
                    "backwards": backwards,
                    "forward_s": _per(c, "forward_s", forwards),
                    "backward_s": _per(c, "backward_s", backwards),
                    "allreduce_s_per_round": _per(c, "allreduce_s", steps),
                    "step_s_per_round": _per(c, "step_s", steps),
                    "busy_s_per_round": _per(c, "busy_s", steps),
                    "idle_s_per_round": _per(c, "idle_s", steps),
                    "send_s_per_round": _per(c, "send_s", steps),
                    "bytes_out": int(c.get("bytes_out") or 0),
                    "peak_activation_bytes": int(c.get("peak_activation_bytes") or 0),
                }
            )
        rows.append(
            {
                "stage": i,
                "units": [stage.start, stage.end],
                "warmup": stage.warmup,
                "predicted_forward_s": _round(pred.get(f"stage{i}_forward_s"), 5),
                "predicted_backward_s": _round(pred.get(f"stage{i}_backward_s"), 5),
                "predicted_allreduce_s": _round(pred.get(f"stage{i}_allreduce_s"), 5),
                "predicted_send_forward_s": _round(pred.get(f"stage{i}_send_forward_s"), 5),
                "predicted_send_backward_s": _round(pred.get(f"stage{i}_send_backward_s"), 5),
                "devices": devices,
            }
        )
    return rows


def _what_if_rounds(report: TrainReport, rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """The plan's round from ``simulate``, with measured and modelled parts swapped in.

    Measured, per stage: the slowest computing device's forward and backward per
    micro-batch, the fastest device's all-reduce per round (the others also wait there
    for the slowest to arrive) and the slowest's optimizer step. Modelled: the plan's
    own stage times (eq. 8, eq. 5). Links are always the cost model's.

    * ``resimulated_round_s``: measured compute and all-reduce. Near the measured round,
      it shows the schedule and link model hold, and any miss of the plan's prediction
      comes from the compute or all-reduce estimates.
    * ``predicted_round_s_measured_allreduce``: modelled compute, measured all-reduce:
      the prediction with the all-reduce estimate taken out.
    * ``resimulated_round_s_modelled_allreduce``: measured compute, modelled all-reduce:
      the round this run would have if its all-reduces took what eq. 5 says at the
      links' bandwidth (a simulation, not a measurement).
    """
    tplan = report.training_plan
    assert tplan is not None
    names = (
        "resimulated_round_s",
        "predicted_round_s_measured_allreduce",
        "resimulated_round_s_modelled_allreduce",
    )
    forward, backward, allreduce, step = [], [], [], []
    for row in rows:
        working = [d for d in row["devices"] if d["share"] > 0 and d["forward_s"] is not None]
        if not working:
            return dict.fromkeys(names)
        forward.append(max(d["forward_s"] for d in working))
        backward.append(max(d["backward_s"] or 0.0 for d in working))
        allreduce.append(min(d["allreduce_s_per_round"] or 0.0 for d in row["devices"]))
        step.append(max(d["step_s_per_round"] or 0.0 for d in row["devices"]))
    model_f = [float(row["predicted_forward_s"] or 0.0) for row in rows]
    model_b = [float(row["predicted_backward_s"] or 0.0) for row in rows]
    model_ar = [float(row["predicted_allreduce_s"] or 0.0) for row in rows]
    send_f = [float(row["predicted_send_forward_s"] or 0.0) for row in rows]
    send_b = [float(row["predicted_send_backward_s"] or 0.0) for row in rows]
    actions = pipeline_actions(
        tplan.schedule,
        num_stages=tplan.num_stages,
        num_microbatches=tplan.num_microbatches,
        warmups=tplan.warmups,
        data_parallel=any(len(s.devices) > 1 for s in tplan.stages),
    )

    def sim(f: list[float], b: list[float], ar: list[float], st: list[float]) -> float | None:
        return _round(simulate(actions, f, b, send_f, send_b, ar, step_s=st).round_s, 5)

    zero = [0.0] * len(rows)
    return {
        names[0]: sim(forward, backward, allreduce, step),
        names[1]: sim(model_f, model_b, allreduce, zero),
        names[2]: sim(forward, backward, model_ar, step),
    }


def _predicted_round(run: TimedRun) -> float | None:
    tplan = run.report.training_plan if run.report is not None else None
    return tplan.predicted.get("round_s") if tplan is not None else None


def _plan_summary(report: TrainReport) -> list[list[Any]]:
    """The plan in one line: [[devices, start, end, shares], ...]."""
    tplan = report.training_plan
    assert tplan is not None
    return [[list(s.devices), s.start, s.end, list(s.shares)] for s in tplan.stages]


def _hpp_model(
    args: argparse.Namespace,
    model: str,
    spec: ModelSpec,
    devices: list[DeviceSpec],
) -> tuple[dict[str, Any], bool]:
    """The four systems on one cluster of ``devices`` training ``spec``: keys, ok."""
    m = args.hpp_microbatches
    warm = make_batches(spec, args.warmup_steps, args.hpp_batch_size, args.seed + 1)
    batches = make_batches(spec, args.hpp_steps, args.hpp_batch_size, args.seed)
    runs: dict[str, list[TimedRun]] = {s: [] for s in HPP_SYSTEMS}
    plans: dict[str, list[list[Any]]] = {}
    described: dict[str, str] = {}
    plan_changed: dict[str, bool] = {s: False for s in HPP_SYSTEMS}
    sequence = load_layer_sequence(spec)
    unit_names = sequence.unit_names()
    started = time.perf_counter()
    with _cluster(devices) as cluster:
        _log(f"  {model}: cluster started in {time.perf_counter() - started:.1f} s")
        for system in HPP_SYSTEMS:  # the first pays the profiles and link probes
            t0 = time.perf_counter()
            fit = {"num_microbatches": m, **HPP_FITS[system]}
            warm_run = _zpipe_run(cluster, system, spec, warm, **fit)
            report = warm_run.report
            assert report is not None and report.training_plan is not None
            plans[system] = _plan_summary(report)
            described[system] = report.training_plan.describe(unit_names)
            _log(f"  {model} warm-up {system}: {time.perf_counter() - t0:.1f} s, plan")
            _log("    " + described[system].replace("\n", "\n    "))
        for repeat in range(args.hpp_repeats):
            order = HPP_SYSTEMS if repeat % 2 == 0 else HPP_SYSTEMS[::-1]
            for system in order:
                fit = {"num_microbatches": m, **HPP_FITS[system]}
                result = _zpipe_run(cluster, system, spec, batches, **fit)
                assert result.report is not None
                if _plan_summary(result.report) != plans[system]:
                    plan_changed[system] = True
                runs[system].append(result)
                _log(
                    f"  {model} repeat {repeat + 1}/{args.hpp_repeats} {system}: steady "
                    f"{result.steady_samples_per_s or 0:.2f} samples/s, round "
                    f"{result.period_s or 0:.3f} s, predicted "
                    f"{_predicted_round(result) or 0:.3f} s"
                )
    elapsed = time.perf_counter() - started
    medians = {s: _median_run(runs[s]) for s in HPP_SYSTEMS}
    config = {
        "hpp_model": model,
        "hpp_model_config": dict(spec.config),
        "hpp_units": sequence.num_units,
        "hpp_microbatches": m,
        "hpp_batch_size": args.hpp_batch_size,
        "hpp_steps": args.hpp_steps,
        "hpp_repeats": args.hpp_repeats,
        "hpp_devices": [
            {"name": d.name, "slowdown": d.slowdown, "bandwidth_mbps": d.bandwidth_mbps}
            for d in devices
        ],
    }
    results: dict[str, dict[str, Any]] = {}
    rows_by_system: dict[str, list[dict[str, Any]]] = {}
    for system in HPP_SYSTEMS:
        median = medians[system]
        report = median.report
        assert report is not None and report.training_plan is not None
        predicted = report.training_plan.predicted
        rows = rows_by_system[system] = _group_rows(report)
        results[system] = {
            "steady_samples_per_s": median.steady_samples_per_s,
            "predicted_samples_per_s": _round(predicted.get("samples_per_s")),
            "predicted_round_s": _round(predicted.get("round_s"), 5),
            "measured_round_s": _round(median.period_s, 5),
            "predicted_over_measured_round": _ratio(predicted.get("round_s"), median.period_s),
            **_what_if_rounds(report, rows),
            "plan": plans[system],
        }
        emit(
            _run_line(
                "hpp",
                f"{model}_{system}",
                runs[system],
                median,
                **{k: v for k, v in results[system].items() if k != "steady_samples_per_s"},
                plan_changed_between_runs=plan_changed[system],
                training_plan=report.training_plan.to_dict(),
                describe=described[system],
                stages=rows,
                **config,
            )
        )
    hpp = results["hpp"]
    best = max(HPP_BASELINES, key=lambda s: results[s]["steady_samples_per_s"] or 0.0)
    # Straight and even pipelines do the same maths; HPP and data parallelism split
    # micro-batches, which changes BatchNorm's batch statistics (the CNN) and the order
    # of float sums, so their losses are reported, not required to match.
    straight, even = medians["straight_1f1b"], medians["even_gpipe"]
    pipeline_diff = _max_abs_diff(straight.losses, even.losses)
    finite = all(math.isfinite(x) for s in HPP_SYSTEMS for r in runs[s] for x in r.losses)
    ok = finite and pipeline_diff is not None and pipeline_diff < 1e-3
    keys: dict[str, Any] = {
        f"hpp_over_best_baseline_{model}": _ratio(
            hpp["steady_samples_per_s"], results[best]["steady_samples_per_s"]
        ),
        f"hpp_best_baseline_{model}": best,
        f"hpp_predicted_over_measured_round_{model}": hpp["predicted_over_measured_round"],
        # what the 100 Mbit/s links would make of the all-reduces (simulated)
        f"hpp_over_best_baseline_{model}_modelled_allreduce": _ratio(
            min(
                (
                    r
                    for s in HPP_BASELINES
                    if (r := results[s]["resimulated_round_s_modelled_allreduce"])
                ),
                default=None,
            ),
            hpp["resimulated_round_s_modelled_allreduce"],
        ),
        f"hpp_{model}": {
            system: {
                **{k: v for k, v in r.items() if k != "steady_samples_per_s"},
                "steady_samples_per_s": _round(r["steady_samples_per_s"]),
                "steady_samples_per_s_runs": [_round(x.steady_samples_per_s) for x in runs[system]],
            }
            for system, r in results.items()
        },
        f"hpp_{model}_predicted_over_best_baseline": _ratio(
            hpp["predicted_samples_per_s"],
            max(results[s]["predicted_samples_per_s"] or 0.0 for s in HPP_BASELINES),
        ),
        f"hpp_{model}_loss_max_abs_diff_vs_straight": _max_abs_diff(
            medians["hpp"].losses, straight.losses
        ),
        # the first mini-batch's loss comes from the initial weights: only the split of
        # its micro-batches (BatchNorm's statistics, float sums) tells the two apart
        f"hpp_{model}_first_loss_abs_diff_vs_straight": _max_abs_diff(
            medians["hpp"].losses[:1], straight.losses[:1]
        ),
        f"hpp_{model}_pipelines_loss_max_abs_diff": pipeline_diff,
        f"hpp_{model}_allreduce_check": _allreduce_shortfall(rows_by_system),
        f"hpp_{model}_section_s": round(elapsed, 1),
        f"hpp_{model}_model_config": dict(spec.config),
        f"hpp_{model}_units": sequence.num_units,
    }
    return keys, ok


def _farthest_from_one(ratios: Sequence[float | None]) -> float | None:
    """The ratio that misses 1 the most (by factor), None if none was measured."""
    known = [r for r in ratios if r is not None and r > 0]
    return max(known, key=lambda r: abs(math.log(r)), default=None)


def _hpp_note(keys: dict[str, Any], models: Sequence[str]) -> str:
    """What the numbers say about the issue's goals, in words, with the plans."""
    goals = {"cnn": HPP_GOAL_CNN, "bert": HPP_GOAL_BERT}
    parts = []
    for model in models:
        ratio = keys.get(f"hpp_over_best_baseline_{model}")
        best = keys.get(f"hpp_best_baseline_{model}")
        systems = keys.get(f"hpp_{model}") or {}
        if ratio is None or best is None:
            continue
        plans = "; ".join(
            f"{s} {systems[s]['steady_samples_per_s']} samples/s (predicted "
            f"{systems[s]['predicted_samples_per_s']}), plan {systems[s]['plan']}"
            for s in HPP_SYSTEMS
        )
        parts.append(
            f"{model}: HPP runs at {ratio:g}x the best baseline ({best}): goal "
            f"{goals[model]:g}x {'met' if ratio >= goals[model] else 'NOT met'}; the cost "
            f"model predicted {keys.get(f'hpp_{model}_predicted_over_best_baseline')}x. "
            f"{plans}."
        )
        hpp = systems["hpp"]
        off = keys.get(f"hpp_predicted_over_measured_round_{model}")
        verdict = (
            "within" if off is not None and abs(off - 1.0) <= PREDICTION_TOLERANCE else "outside"
        )
        parts.append(
            f"{model}: HPP's predicted round {hpp['predicted_round_s']} s is {off}x the "
            f"measured {hpp['measured_round_s']} s ({verdict} {PREDICTION_TOLERANCE:.0%}); "
            f"simulated from the run's measured compute and all-reduce "
            f"{hpp['resimulated_round_s']} s, from the model's compute and the measured "
            f"all-reduce {hpp['predicted_round_s_measured_allreduce']} s."
        )
        allreduce = keys.get(f"hpp_{model}_allreduce_check")
        if allreduce:
            modelled = keys.get(f"hpp_over_best_baseline_{model}_modelled_allreduce")
            parts.append(
                f"{model}: {allreduce} Simulated with the measured compute and eq. 5's "
                f"all-reduce at the links' bandwidth, HPP would run at {modelled}x the best "
                "baseline."
            )
    return " ".join(parts)


def _allreduce_shortfall(rows_by_system: dict[str, list[dict[str, Any]]]) -> str:
    """Where groups all-reduced much faster than the cost model's links would let them."""
    found = []
    for system, rows in rows_by_system.items():
        for row in rows:
            predicted = row.get("predicted_allreduce_s") or 0.0
            measured = [d["allreduce_s_per_round"] or 0.0 for d in row["devices"]]
            if len(measured) > 1 and predicted > 0.02 and min(measured) < 0.5 * predicted:
                found.append(
                    f"{system} stage {row['stage']} all-reduced in {min(measured):.3f} s per "
                    f"round against {predicted:.3f} s predicted"
                )
    if not found:
        return ""
    return (
        "; ".join(found) + " (the stages pace their ring all-reduce on their emulated "
        "links, so a shortfall means the cost model's eq. 5 overestimates it)."
    )


def run_hpp(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    """HPP against data parallelism, a straight 1F1B and an even GPipe: summary keys, ok."""
    cores = os.cpu_count() or 1
    threads = args.threads or max(1, cores // len(HPP_DEVICES))
    scale = args.hpp_slowdown_scale or _auto_slowdown_scale(threads, cores, HPP_DEVICES)
    devices = [
        DeviceSpec(name, slowdown=s * scale, bandwidth_mbps=args.bandwidth_mbps, threads=threads)
        for name, s in HPP_DEVICES
    ]
    models = [
        ("cnn", ModelSpec("cnn", HETERO_CNN, seed=args.seed)),
        ("bert", _bert_spec(args.hidden, args.seed)),
    ]
    _log(
        f"hpp section: slowdowns x{scale:g} "
        f"({', '.join(f'{d.name} {d.slowdown:g}' for d in devices)}), "
        f"{args.bandwidth_mbps:g} Mbit/s, M = {args.hpp_microbatches} of "
        f"{args.hpp_batch_size} samples, systems {', '.join(HPP_SYSTEMS)}"
    )
    keys: dict[str, Any] = {}
    ok = True
    for model, spec in models:
        model_keys, model_ok = _hpp_model(args, model, spec, devices)
        keys.update(model_keys)
        ok = ok and model_ok
    names = [model for model, _ in models]
    keys["predicted_over_measured_round"] = _farthest_from_one(
        [keys.get(f"hpp_predicted_over_measured_round_{m}") for m in names]
    )
    keys["note"] = _hpp_note(keys, names)
    keys.update(
        {
            "hpp_microbatches": args.hpp_microbatches,
            "hpp_batch_size": args.hpp_batch_size,
            "hpp_steps": args.hpp_steps,
            "hpp_repeats": args.hpp_repeats,
            "hpp_devices": [
                {"name": d.name, "slowdown": d.slowdown, "bandwidth_mbps": d.bandwidth_mbps}
                for d in devices
            ],
            "hpp_slowdown_scale": scale,
            "hpp_threads_per_stage": threads,
        }
    )
    return keys, ok
