"""Memory per stage: the one memory model's prediction against a stage process's peak.

For each model (ViT, BERT, a CNN and an MLP, small configurations) the parent
profiles the units (``--train``: forward peaks, bytes saved for the backward) at
micro-batch sizes 1, B/4, B/2 and B, splits the units evenly into ``--stages``
stages, and for every stage and mode (inference, training) starts a **fresh
worker process** that does what a stage process does: imports torch, zpipe's
stage modules and torch._dynamo (a stage's preload, zpipe.lazy_torch), keeps
freed memory as a stage does (``--retain-memory-mb``'s default), measures its
resident memory before any model (its **base**, what a stage reports when it
registers: ``Register.base_bytes``), builds its units, and for each size loads the
input it would receive and runs

- inference: two forwards under ``torch.inference_mode`` (as a stage serves);
- training: two micro-batches through the stage's ``TrainShard`` (forward,
  backward with a gradient of the output's shape, then the optimizer's step; one
  micro-batch in flight, K = 1), with ``--optimizer`` (default Adam: two copies of
  the weights of state).

**Measured** is the worker's peak resident memory (``VmHWM`` of
``/proc/self/status``, else ``ru_maxrss``): everything the process held at its
worst, not only what torch's allocator counts. One worker runs a stage's sizes
smallest first and sets its peak back to what it holds between them (Linux's
``clear_refs``; ``--fresh-per-size`` starts one process per size instead).
``--mmap-threshold-mb N`` sets glibc's mmap threshold in the workers (and the
profiling parent) after the stage's own setting (4 MiB with ``--retain-mb``,
``zpipe.transport.allocator.MMAP_THRESHOLD_MB``): at 32, the stage's before,
tensors of a few MiB fragmented the heap and a ViT stage at 8 images peaked
2.5-3x its live tensors' peak; at 4 every ratio was within 1.0-1.3
(docs/benchmarks.md). The parent profiles under the stage's allocator, as a stage
that profiles itself does.
**Predicted** is :func:`zpipe.planner.memory.profile_stage_memory` with the
worker's measured base (what the planner is given) and the safety margin the
limit check adds (``--margin``, default the coordinator's ``--memory-margin``):
``predicted_over_measured`` is what a budget is checked against over what the
process used; ``unmargined_over_measured`` the model alone. The transport's copies
of messages are not part of this bench (a stage's socket buffers; the margin
covers them).

Output: one JSON line per (model, stage, size, mode), then a summary with
``predicted_over_measured_min`` / ``_median`` / ``_max`` over all of them (the goal:
every ratio within 1.0 .. 1.3), the same without the margin
(``unmargined_over_measured_*``) and for the model's part alone
(``model_predicted_over_measured_*``: predicted and measured less the base and
training's runtime, the ratio the base would otherwise hide), and the process base cost
(``base_mib_min`` / ``_median`` / ``_max``, against the planner's default
``DEFAULT_STAGE_BASE_BYTES``).

Run: ``.venv/bin/python bench/memory.py`` (``--help`` for options; about 4-8
minutes on 2 busy cores).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emit, loadavg, on_alarm, summary

MIB = 2**20
ROOT = Path(__file__).resolve().parent.parent
# Small configurations whose model part is tens to hundreds of MiB (so the base does
# not hide it) and that run in seconds on one core.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "vit": ("vit-base", {"num_layers": 2}),
    "bert": ("bert-base", {"num_layers": 2, "seq_len": 128, "max_positions": 128}),
    "cnn": (
        "cnn-small",
        {"channels": [64, 128, 256, 256], "image_size": 96, "in_channels": 3},
    ),
    "mlp": ("mlp-small", {"dims": [2048, 4096, 4096, 2048, 10]}),
}


# --------------------------------------------------------------------------- worker


def _reset_peak() -> bool:
    """Set this process's peak resident memory back to what it holds now (Linux 4.0+:
    ``clear_refs`` 5), so that one process measures several sizes in turn."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _set_mmap_threshold(mib: int) -> None:
    """glibc's ``M_MMAP_THRESHOLD``: blocks this large or larger are mapped apart and
    unmapped when freed (an experiment against the stage's default)."""
    import ctypes

    if not ctypes.CDLL("libc.so.6").mallopt(-3, mib << 20):
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) refused")


def _worker(job: dict[str, Any]) -> dict[str, Any]:
    """One stage's work in this fresh process at each size in turn (smallest first, as
    a stage that serves them all would); its base and its peak resident memory at each."""
    import gc

    import torch

    import zpipe.stage.runtime  # noqa: F401  (what a stage process has imported)
    from zpipe.devices import peak_resident_bytes, stage_base_bytes
    from zpipe.lazy_torch import import_lazy_torch_modules
    from zpipe.models import ModelSpec, load_layer_sequence, run_units
    from zpipe.stage.executors.training_shard import TrainShard
    from zpipe.transport.allocator import retain_freed_memory

    import_lazy_torch_modules()  # as a stage does before it registers
    retain_freed_memory(job["retain_mb"])  # a stage's default
    if job.get("mmap_threshold_mb"):
        _set_mmap_threshold(job["mmap_threshold_mb"])
    torch.set_num_threads(job["threads"])
    base = stage_base_bytes("cpu") or 0  # before any model: what registration reports
    spec = ModelSpec.from_dict(job["spec"])
    units = load_layer_sequence(spec).build_units(job["start"], job["end"])
    shard = None
    if job["mode"] == "training":
        shard = TrainShard(
            units,
            start=job["start"],
            first=job["start"] == 0,
            last=False,
            loss="mse",
            optimizer={"name": job["optimizer"], "lr": 1e-4},
        )
    peaks = []
    for path in job["inputs"]:
        gc.collect()
        if len(job["inputs"]) > 1 and not _reset_peak():
            raise RuntimeError("cannot reset the peak resident memory: use --fresh-per-size")
        inputs = tuple(torch.load(path, weights_only=True))
        if shard is None:
            for _ in range(2):
                with torch.inference_mode():
                    outputs = run_units(units, inputs)
                del outputs
        else:
            for mb in range(2):
                sent, _, _ = shard.forward(mb, inputs)
                grads = tuple(torch.ones_like(t) for t in sent)
                del sent
                shard.backward(mb, grads)
                del grads
                shard.step()
        del inputs
        peaks.append(peak_resident_bytes() or 0)
    return {"base_bytes": base, "peaks": peaks}


# --------------------------------------------------------------------------- parent


def _run_worker(job: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(job)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"worker {job['model']} failed: {done.stderr[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _jobs(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    """Profile each model, cut it into stages and save each stage's input; the jobs."""
    import torch

    from zpipe.models import ModelSpec, load_layer_sequence, run_units
    from zpipe.planner.plan import plan_even_partition
    from zpipe.planner.profile import training_profile_sizes
    from zpipe.stage.profiling import profile_model
    from zpipe.transport.allocator import retain_freed_memory

    # profile under the allocator a stage profiles under (a unit's peak counts the
    # process's resident growth, which glibc's thresholds move)
    retain_freed_memory(args.retain_mb)
    if args.mmap_threshold_mb:
        _set_mmap_threshold(args.mmap_threshold_mb)
    torch.set_num_threads(args.threads)
    sizes = training_profile_sizes(args.batch)
    jobs = []
    for name in args.models:
        preset, overrides = MODELS[name]
        spec = ModelSpec.preset(preset, **overrides)
        profile = profile_model(spec, batch_sizes=sizes, warmup=0, repeats=1, train=True)
        sequence = load_layer_sequence(spec)
        plan = plan_even_partition(profile.num_units, [f"s{i}" for i in range(args.stages)])
        units = sequence.build_units(0, profile.num_units)
        paths: dict[tuple[int, int], str] = {}
        for b in sizes:
            inputs = sequence.example_input(b, seed=b)
            for index, stage in enumerate(plan.stages):
                path = workdir / f"{name}-{index}-{b}.pt"
                torch.save(list(inputs), path)
                paths[index, b] = str(path)
                with torch.inference_mode():
                    inputs = tuple(run_units(units[stage.start : stage.end], inputs))
        groups = [[b] for b in sizes] if args.fresh_per_size else [sizes]
        for index, stage in enumerate(plan.stages):
            for mode in args.modes:
                for group in groups:
                    jobs.append(
                        {
                            "model": name,
                            "spec": spec.to_dict(),
                            "profile": profile.to_dict(),
                            "stage": index,
                            "start": stage.start,
                            "end": stage.end,
                            "sizes": group,
                            "inputs": [paths[index, b] for b in group],
                            "mode": mode,
                            "optimizer": args.optimizer,
                            "threads": args.threads,
                            "retain_mb": args.retain_mb,
                            "mmap_threshold_mb": args.mmap_threshold_mb,
                            "margin": args.margin,
                        }
                    )
    return jobs


def _rows(job: dict[str, Any], measured: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        _row({**job, "batch": b}, measured["base_bytes"], peak, job["margin"])
        for b, peak in zip(job["sizes"], measured["peaks"], strict=True)
    ]


def _row(job: dict[str, Any], base: int, peak: int, margin: float) -> dict[str, Any]:
    from zpipe.planner.memory import profile_stage_memory
    from zpipe.planner.profile import ModelProfile

    profile = ModelProfile.from_dict(job["profile"], source="the bench's profile")
    need = profile_stage_memory(
        profile,
        job["start"],
        job["end"],
        job["batch"],
        training=job["mode"] == "training",
        optimizer=job["optimizer"],
        in_flight=1,
        base=base,
    )
    return {
        "bench": "memory",
        "model": job["model"],
        "stage": job["stage"],
        "units": [job["start"], job["end"]],
        "batch": job["batch"],
        "mode": job["mode"],
        "base_mib": round(base / MIB, 1),
        "weights_mib": round(need.weights / MIB, 1),
        "forward_mib": round(need.forward / MIB, 1),
        "saved_mib": round(need.saved / MIB, 1),
        "optimizer_mib": round((need.gradients + need.optimizer) / MIB, 1),
        "runtime_mib": round(need.runtime / MIB, 1),
        "predicted_mib": round(need.total / MIB, 1),
        "measured_mib": round(peak / MIB, 1),
        # what the limit check compares with a budget: the prediction with the margin
        "predicted_over_measured": round(need.with_margin(margin) / peak, 3),
        "unmargined_over_measured": round(need.total / peak, 3),
        # None where the model's measured part is under a MiB (page noise, not a ratio)
        "model_predicted_over_measured": (
            round(need.model / (peak - base - need.runtime), 3)
            if peak - base - need.runtime >= MIB
            else None
        ),
    }


def _spread(values: list[float], key: str) -> dict[str, float]:
    return {
        f"{key}_min": min(values),
        f"{key}_median": round(statistics.median(values), 3),
        f"{key}_max": max(values),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--models", default=",".join(MODELS), help="of " + ",".join(MODELS))
    parser.add_argument("--batch", type=int, default=8, help="B: sizes 1, B/4, B/2, B")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--modes", default="inference,training")
    parser.add_argument("--optimizer", default="adam", choices=("sgd", "adam", "adamw"))
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--retain-mb", type=int, default=256, help="as a stage's default")
    parser.add_argument(
        "--mmap-threshold-mb",
        type=int,
        default=0,
        help="set glibc's mmap threshold in the workers after the stage's "
        "(0: leave the stage's, zpipe.transport.allocator.MMAP_THRESHOLD_MB)",
    )
    parser.add_argument("--jobs", type=int, default=2, help="workers at once")
    parser.add_argument(
        "--margin",
        type=float,
        default=None,
        help="the safety margin (default: the coordinator's, DEFAULT_MEMORY_MARGIN)",
    )
    parser.add_argument(
        "--fresh-per-size",
        action="store_true",
        help="one process per size (default: one per stage and mode, its peak reset "
        "between sizes, smallest first)",
    )
    parser.add_argument("--timeout", type=int, default=3600, help="seconds before giving up")
    args = parser.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(_worker(json.loads(args.worker))))
        return 0
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(args.timeout)
    args.models = [m for m in args.models.split(",") if m]
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS] + [
        m for m in args.modes if m not in ("inference", "training")
    ]
    if unknown:
        parser.error(f"unknown models or modes: {unknown}")
    from zpipe.planner.memory import DEFAULT_MEMORY_MARGIN

    if args.margin is None:
        args.margin = DEFAULT_MEMORY_MARGIN
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zpipe-memory-") as tmp:
        jobs = _jobs(args, Path(tmp))
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            measured = list(pool.map(lambda j: _run_worker(j, args.timeout), jobs))
    rows = [r for j, m in zip(jobs, measured, strict=True) for r in _rows(j, m)]
    for row in rows:
        emit(row)
    from zpipe.planner.memory import DEFAULT_STAGE_BASE_BYTES
    from zpipe.transport.allocator import MMAP_THRESHOLD_MB

    ratios = [r["predicted_over_measured"] for r in rows]
    bases = [r["base_mib"] for r in rows]
    summary(
        "memory",
        models=args.models,
        batch=args.batch,
        stages=args.stages,
        optimizer=args.optimizer,
        threads=args.threads,
        measurements=len(rows),
        loadavg=loadavg(),
        seconds=round(time.monotonic() - started, 1),
        margin=args.margin,
        mmap_threshold_mb=args.mmap_threshold_mb or min(args.retain_mb, MMAP_THRESHOLD_MB),
        **_spread(ratios, "predicted_over_measured"),
        **_spread([r["unmargined_over_measured"] for r in rows], "unmargined_over_measured"),
        within_1_0_to_1_3=sum(1.0 <= r <= 1.3 for r in ratios),
        **_spread(
            [
                r["model_predicted_over_measured"]
                for r in rows
                if r["model_predicted_over_measured"]
            ],
            "model_predicted_over_measured",
        ),
        **_spread(bases, "base_mib"),
        default_base_mib=DEFAULT_STAGE_BASE_BYTES / MIB,
        **{
            f"predicted_over_measured_{mode}_max": max(
                r["predicted_over_measured"] for r in rows if r["mode"] == mode
            )
            for mode in args.modes
        },
        **{
            f"predicted_over_measured_{mode}_min": min(
                r["predicted_over_measured"] for r in rows if r["mode"] == mode
            )
            for mode in args.modes
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
