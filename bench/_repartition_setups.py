"""The repartition section of ``bench/training_async.py``: each set-up's FTPipeHD
run (live re-partitioning) against PipeDream's (its even start, kept), on real
processes, and what the section's summary takes from them (the module notes of
``bench/training_async.py`` define every key). The bounds' arithmetic is in
``bench/_repartition_bounds.py``, the look's pause in parts in
``bench/_look_pauses.py``, the run's timeline in ``bench/_repartition_timeline.py``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench._common import emit, loadavg
from bench._look_pauses import pause_parts, speed_verdicts
from bench._repartition_bounds import (
    LEAVE_OUT_GAIN,
    SLOWING_FACTOR,
    Setup,
    after_change,
    even_bounds,
    fitted_phase_bound,
    phase_bound,
    residual_unit_weights,
    run_bound,
)
from bench._repartition_timeline import repartition_timeline
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.models import ModelSpec
from zpipe.training.repartition import RepartitionSettings

BENCH = "training_async"
SETUP_NAMES = ("u12_best", "u12_middle", "u16_best", "u16_middle", "r16_middle", "r24_middle")
# the smoothed loss must fall this much below its first 20 mini-batches' for a time to
# a loss to mean anything (the 12-layer model falls about 0.5; deeper ones about 0)
MIN_LOSS_DROP = 0.1
# Adam: SGD with momentum 0.9 at lr 0.05 diverges under the staleness of async 1F1B here
ADAM = {"name": "adam", "lr": 1e-3}


def minibatches(
    x: torch.Tensor, y: torch.Tensor, *, batch_size: int, epochs: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        for start in range(0, len(x) - batch_size + 1, batch_size):
            idx = order[start : start + batch_size]
            out.append((x[idx], y[idx]))
    return out


def run_once(
    cluster: LocalCluster,
    spec: ModelSpec,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    partition: list[list[int]],
    settings: dict[str, Any],
    optimizer: dict[str, Any] | None = None,
) -> tuple[Any, list[float]]:
    arrivals: list[float] = []
    report = cluster.fit(
        spec,
        batches,
        optimizer=optimizer or ADAM,
        partition=partition,
        progress=False,
        on_step=lambda step, loss: arrivals.append(time.perf_counter()),
        **settings,
    )
    return report, arrivals


def smoothed(losses: Sequence[float], window: int = 8) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(losses):
        total += value - (losses[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def headline_setup(results: dict[str, dict[str, Any]]) -> str | None:
    """The module notes' rule: of the set-ups whose model learned, one where a middle
    device slows, with the most units (ties: ``SETUP_NAMES``' order); else the
    first run."""
    learned = [
        name
        for name in SETUP_NAMES
        if name in results
        and results[name].get("ratio_kind") == "time_to_loss"
        and results[name].get("slowing_index", 0) not in (0, None)
    ]
    if learned:
        return max(learned, key=lambda name: (results[name]["units"], -SETUP_NAMES.index(name)))
    return next(iter(results), None)


def setups(args: argparse.Namespace) -> list[Setup]:
    """The repartition set-ups asked for (see the module notes); ``u12_best`` takes
    the original flags."""
    table = {
        "u12_best": Setup("u12_best", args.units, 0, args.repartition_steps, args.change_s),
        "u12_middle": Setup("u12_middle", args.units, 1, 160, 6.0),
        # 16 plain layers do not learn under async staleness (see the module notes):
        # these measure periods, their ratio is the time to their last step
        "u16_best": Setup("u16_best", 16, 0, 120, 5.0, "relu"),
        "u16_middle": Setup("u16_middle", 16, 1, 100, 4.0, "relu"),
        # residual blocks learn at these depths under the same staleness
        "r16_middle": Setup("r16_middle", 16, 1, 160, 5.0, residual=True,
                            weights=residual_unit_weights(_dims(args, 16))),
        "r24_middle": Setup("r24_middle", 24, 1, 200, 6.0, residual=True,
                            weights=residual_unit_weights(_dims(args, 24))),
    }  # fmt: skip
    return [table[name] for name in args.setups]


def _dims(args: argparse.Namespace, units: int) -> list[int]:
    """The repartition model's widths: the digits' 64 inputs, hidden, 10 classes."""
    return [64, *[args.repartition_hidden] * (units - 1), 10]


def fixed_units_of(looks: Sequence[dict[str, Any]], names: Sequence[str]) -> float | None:
    """A stage's own cost per mini-batch in units (reference unit-times), the median
    over the looks whose fit found one: each look's ``F_i / C_i`` (the fixed share in
    reference seconds, alike on every stage) over a reference unit's seconds (the
    look's period is its slowest stage's ``F_i + C_i * r * k_i``; the units taken as
    equal). None when no look found one."""
    found = []
    for look in looks:
        caps, own = look.get("capacities") or {}, look.get("fixed_s") or {}
        used = [d for d in names if d in caps]  # after a leave-out: the devices kept
        held = [b - a for a, b in itertools.pairwise(look["current"])]
        if len(used) != len(held) or not all(caps[d] and d in own for d in used):
            continue
        if not any(own.values()):
            continue
        cap, fixed = [caps[d] for d in used], [own[d] for d in used]
        r = min((look["period_s"] - f) / (c * k) for c, f, k in zip(cap, fixed, held, strict=True))
        if r > 0:
            found.append(statistics.median(f / c for c, f in zip(cap, fixed, strict=True)) / r)
    return statistics.median(found) if found else None


def _keep_logs(
    folder: Path, logs: dict[str, str], wall: float, started: float, arrivals: list[float]
) -> None:
    """One run's logs and its losses' times: seconds from the run's start, and wall
    clock (the logs' stamps) as ``wall + perf_counter``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in logs.items():
        (folder / f"{name}.log").write_text(text)
    lines = [f"{i + 1} {t - started:.4f} {wall + t:.4f}" for i, t in enumerate(arrivals)]
    (folder / "losses.txt").write_text("step run_s wall_s\n" + "\n".join(lines) + "\n")


def _gaps(times: Sequence[float], low: float, high: float) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times) if low < b <= high]


def repartition_section(
    args: argparse.Namespace, x_train: torch.Tensor, y_train: torch.Tensor
) -> dict[str, Any]:
    """Every set-up asked for, then the headline (see the module notes)."""
    results = {s.name: one_setup(args, s, x_train, y_train) for s in setups(args)}
    return results


def one_setup(
    args: argparse.Namespace, setup: Setup, x_train: torch.Tensor, y_train: torch.Tensor
) -> dict[str, Any]:
    """FTPipeHD (live re-partitioning) against PipeDream (its even start, kept)."""
    n, units = 4, setup.units
    # Adam at 3e-4: deeper plain MLPs barely train under async staleness
    config: dict[str, Any] = {"dims": _dims(args, units), "activation": setup.activation}
    if setup.residual:
        config["residual"] = True
    spec = ModelSpec("mlp", config, seed=1)
    cuts = even_bounds(units, n)
    even = [[a, b] for a, b in itertools.pairwise(cuts)]
    names = [f"d{i}" for i in range(n)]
    caps = list(args.capacities)
    slow = caps[setup.slowing]
    schedule = f"0:{slow:g},{setup.change_s:g}:{slow * SLOWING_FACTOR:g}"
    per_epoch = len(x_train) // args.batch_size
    epochs = -(-setup.steps // per_epoch)  # enough for every step asked for
    batches = minibatches(x_train, y_train, batch_size=args.batch_size, epochs=epochs, seed=4)
    batches = batches[: setup.steps]
    runs: dict[str, tuple[Any, list[float]]] = {}
    pauses: dict[str, float] = {}
    looks_of: dict[str, list[dict[str, Any]]] = {}
    kinds = {
        "pipedream": {},
        "ftpipehd": {
            "repartition": {
                "first": args.repartition_first,
                "every": args.repartition_every,
                "gain": LEAVE_OUT_GAIN,
                **({"leave_out": True} if args.repartition_leave_out else {}),
                **({"watch": args.repartition_watch} if args.repartition_watch else {}),
                **(
                    {"forward_watch": args.repartition_forward_watch}
                    if args.repartition_forward_watch
                    else {}
                ),
            }
        },
    }
    for kind, extra in kinds.items():
        devices = [
            DeviceSpec(d, threads=args.threads, slowdown_schedule=schedule)
            if i == setup.slowing
            else DeviceSpec(d, slowdown=c, threads=args.threads)
            for i, (d, c) in enumerate(zip(names, caps, strict=True))
        ]
        # info: the pause's parts come from the events' stamps (a few lines per look)
        level = "info" if kind == "ftpipehd" else "warning"
        with LocalCluster(devices, log_level=level, start_timeout_s=args.start_timeout) as cluster:
            started = time.perf_counter()
            wall = time.time() - started  # perf_counter + wall: the logs' clock
            report, arrivals = run_once(
                cluster,
                spec,
                batches,
                even,
                {"schedule": "async-1f1b", "num_microbatches": 1, **extra},
                optimizer={"name": "adam", "lr": 3e-4},
            )
            logs = {name: cluster.logs(name) for name in ["coordinator", *names]}
        if args.keep_logs is not None:
            _keep_logs(args.keep_logs / f"{setup.name}_{kind}", logs, wall, started, arrivals)
        runs[kind] = (report, [t - started for t in arrivals])
        gap = statistics.median(b - a for a, b in itertools.pairwise(arrivals))
        # a look pauses the feed before batch ``at``: its loss comes that much later
        looks = [
            {"at": r["at"], "t_s": round(arrivals[r["at"] - 1] - started, 2),
             "pause_s": round(arrivals[r["at"]] - arrivals[r["at"] - 1] - gap, 3),
             "moved": r["moved"], "bounds": r["bounds"], "capacities": r.get("capacities"),
             # the period the look predicted for its cuts (after a move: the loss
             # watch's baseline, zpipe.training.repartition_watch)
             "new_period_s": r.get("new_period_s"),
             # an early look (the loss watch's), not a scheduled one
             "early": kind == "ftpipehd" and not RepartitionSettings(
                 first=args.repartition_first, every=args.repartition_every).due(r["at"]),
             "fixed_s": r.get("fixed_s"),
             "parts": pause_parts(logs, r["at"], wall + arrivals[r["at"] - 1],
                                  wall + arrivals[r["at"]])}
            for r in report.repartitions
            if r["at"] < len(arrivals)
        ]  # fmt: skip
        looks_of[kind] = looks
        pauses[kind] = math.fsum(look["pause_s"] for look in looks)
        emit({"bench": BENCH, "section": "repartition", "setup": setup.name, "system": kind,
              "steps": report.steps, "run_s": round(arrivals[-1] - started, 2),
              "samples_per_s": round(report.samples_per_s, 2),
              "final_loss": round(report.losses[-1], 4), "looks": looks,
              # the forward watch's verdicts (an early look follows a relayed one)
              "speed_verdicts": speed_verdicts(logs["coordinator"]),
              "loadavg": loadavg()})  # fmt: skip
    pipedream, ftpipehd = runs["pipedream"], runs["ftpipehd"]
    # the lowest (smoothed) loss PipeDream reaches: late in its run, not a noisy dip
    curve = smoothed(pipedream[0].losses, window=20)
    target = min(curve)
    target_step = curve.index(target) + 1
    # a model that did not learn has no loss to reach: its "lowest" is a noisy dip
    # anywhere; the time to its last step is then what the run measured
    learned = curve[min(19, len(curve) - 1)] - target >= MIN_LOSS_DROP
    if not learned:
        target, target_step = curve[-1], len(curve)

    def time_to(run: tuple[Any, list[float]]) -> float:
        if not learned:
            return run[1][-1]
        for loss, at in zip(smoothed(run[0].losses, window=20), run[1], strict=True):
            if loss <= target:
                return at
        return run[1][-1]

    ratio = time_to(pipedream) / time_to(ftpipehd)
    # the same losses step by step: the whole run's time is the time to its last loss
    whole = pipedream[1][-1] / ftpipehd[1][-1]
    # with vertical sync a re-partition changes no mini-batch's weight version: the
    # losses agree up to float summation order (the optimizer's tensor grouping)
    same = max(
        abs(a - b) / max(abs(a), 1e-12)
        for a, b in zip(pipedream[0].losses, ftpipehd[0].losses, strict=True)
    )
    # each phase's measured periods (median gaps): the change comes change_s after the
    # slowing device's first step, about its run's first loss; FTPipeHD's phases start
    # after the move that answers them
    pd_t, ft_t = pipedream[1], ftpipehd[1]
    pd_change, ft_change = pd_t[0] + setup.change_s, ft_t[0] + setup.change_s
    moved_at = [
        ft_t[r["at"]] for r in ftpipehd[0].repartitions if r["moved"] and r["at"] < len(ft_t)
    ]
    first_move = moved_at[0] if moved_at else ft_t[0]
    last_move = max([ft_change + 0.5, *(t for t in moved_at if t > ft_change)])
    pd_before = _gaps(pd_t, pd_t[0] + 0.5, pd_change)
    pd_after = _gaps(pd_t, pd_change + 0.5, math.inf)
    ft_before = _gaps(ft_t, first_move, ft_change)
    ft_after = _gaps(ft_t, last_move, math.inf)
    measured: dict[str, float | None] = {"before": None, "after": None}
    if pd_before and ft_before:
        measured["before"] = round(statistics.median(pd_before) / statistics.median(ft_before), 3)
    if pd_after and ft_after:
        measured["after"] = round(statistics.median(pd_after) / statistics.median(ft_after), 3)
    leave_out = bool(args.repartition_leave_out)
    before_bound = phase_bound(caps, units, setup.reference(), leave_out=leave_out)
    # one unit-time in seconds, from PipeDream's own period before the change
    unit_s = statistics.median(pd_before or pd_after) / before_bound.even_period
    before, after, bound = run_bound(
        caps, setup, unit_s=unit_s, step=target_step, leave_out=leave_out
    )
    # the same bound with each stage's own cost per mini-batch, as FTPipeHD's looks
    # fitted it (in units; the median over the looks that found one)
    fixed_units = fixed_units_of(ftpipehd[0].repartitions, names)
    bound_fixed = None
    if fixed_units is not None:
        bound_fixed = run_bound(
            caps, setup, unit_s=unit_s, step=target_step, fixed_units=fixed_units,
            leave_out=leave_out,
        )[2]  # fmt: skip
    # where the run loses against the bound: detection, the move, each phase's period
    timeline = repartition_timeline(
        ft_t,
        ftpipehd[0].repartitions,
        ft_change,
        bound_periods_s=(before.best_period * unit_s, after.best_period * unit_s),
        drains={
            look["at"]: look["parts"]["drain_s"]
            for look in looks_of["ftpipehd"]
            if look["moved"] and "drain_s" in (look["parts"] or {})
        },
    )
    # the bound the stages' own costs leave after the change, from the last look's fit
    # (one that measured every device: PipeDream's even cuts are over all four, and a
    # look after a leave-out measured the devices kept only)
    last = next((r for r in reversed(ftpipehd[0].repartitions) if any(
        (r.get("fixed_s") or {}).values()) and set(names) <= set(r.get("capacities") or {})),
        None)  # fmt: skip
    fitted = None
    if last is not None:
        cap, own = [last["capacities"][d] for d in names], [last["fixed_s"][d] for d in names]
        held = [b - a for a, b in itertools.pairwise(last["current"])]
        # a reference unit's seconds: the look's period is its slowest stage's
        # F_i + C_i * r * k_i, and no stage is slower (the units taken as equal)
        r = min((last["period_s"] - f) / (c * k) for c, f, k in zip(cap, own, held, strict=True))
        fitted = fitted_phase_bound([c * r for c in cap], own, units, leave_out=leave_out)
    out = {
        "setup": setup.name, "units": units, "activation": setup.activation,
        "residual": setup.residual, "slowing": names[setup.slowing],
        "slowing_index": setup.slowing,
        "capacities_before": caps, "capacities_after": after_change(caps, setup.slowing),
        "steps": setup.steps, "change_s": setup.change_s,
        "target_loss": round(target, 4), "target_step": target_step,
        # how far the smoothed loss fell from its first 20 mini-batches: ~0 means the
        # model did not learn and the time to loss means nothing
        "loss_drop": round(curve[min(19, len(curve) - 1)] - min(curve), 3),
        "ratio_kind": "time_to_loss" if learned else "time_to_last_step",
        "pipedream_s": round(time_to(pipedream), 2), "ftpipehd_s": round(time_to(ftpipehd), 2),
        "max_loss_rel_diff": same, "ratio": round(ratio, 3), "whole": round(whole, 3),
        "bound_before": round(before.ratio, 3), "bound_after": round(after.ratio, 3),
        "best_cuts_before": list(before.best_bounds), "best_cuts_after": list(after.best_bounds),
        "fitted_bound_last_look": None if fitted is None else round(fitted.ratio, 3),
        "fitted_at": None if last is None else last["at"],
        "bound_run": round(bound, 3), "measured_over_bound": round(ratio / bound, 3),
        "fixed_units": None if fixed_units is None else round(fixed_units, 3),
        "bound_run_fixed": None if bound_fixed is None else round(bound_fixed, 3),
        "measured_over_bound_fixed": (
            None if bound_fixed is None else round(ratio / bound_fixed, 3)),
        "measured_before": measured["before"], "measured_after": measured["after"],
        "unit_s": round(unit_s, 5),
        # the change must fall inside both runs, or the set-up was not measured
        "change_inside_both": ft_t[-1] > ft_change + 1.0 and pd_t[-1] > pd_change + 1.0,
        "repartitions": len(moved_at),
        "leave_out": leave_out,
        # the devices each move that left some out kept, by mini-batch
        "left_out_moves": {r["at"]: r["devices"] for r in ftpipehd[0].repartitions
                           if r.get("devices")},
        "look_pauses_s": round(pauses["ftpipehd"], 2),
        "looks": len(looks_of["ftpipehd"]),
        "early_looks": sum(1 for look in looks_of["ftpipehd"] if look["early"]),
        "look_share": round(pauses["ftpipehd"] / ftpipehd[1][-1], 3),
        "timeline": timeline,
        "longest_move_pause": max(
            (look for look in looks_of["ftpipehd"] if look["moved"]),
            key=lambda look: look["pause_s"], default=None),
    }  # fmt: skip
    emit({"bench": BENCH, "section": "repartition", **out, "loadavg": loadavg()})
    return out
