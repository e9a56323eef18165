"""``python -m zpipe profile``: measure a model's units on this device.

The measuring itself is :mod:`zpipe.stage.profiling` (a stage measures itself
the same way when it registers); this module is the command's flags and output.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from zpipe._errors import ConfigError, ZpipeError
from zpipe.cli.common import (
    MAX_SLOWDOWN,
    MAX_THREADS,
    at_most,
    non_negative_int,
    positive_float,
    positive_int,
)
from zpipe.devices import DEVICE_CHOICES, resolve_device
from zpipe.models import ModelSpec, available_presets, load_layer_sequence
from zpipe.planner.profile import ModelProfile
from zpipe.progress import TerminalProgress
from zpipe.stage.profiling import profile_model
from zpipe.transport.allocator import retain_freed_memory


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be comma-separated integers") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: batch sizes must be >= 1")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m zpipe profile",
        description="Profile a model's units on this device: forward time per unit at each "
        "batch size (after warm-up, median of repeats), output bytes, weight bytes and "
        "activation memory. The planners read the file this writes (python -m zpipe plan).",
    )
    parser.add_argument(
        "--model", required=True, choices=available_presets(), help="built-in model preset"
    )
    parser.add_argument(
        "--layers",
        type=positive_int,
        default=None,
        help="override the number of transformer blocks (transformer presets)",
    )
    parser.add_argument(
        "--batch-sizes",
        type=_batch_sizes,
        default=[1, 2, 4, 8],
        metavar="B,B,...",
        help="micro-batch sizes to profile (default: 1,2,4,8)",
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--threads",
        type=at_most(positive_int, MAX_THREADS, "threads"),
        default=None,
        help="torch threads (default: torch's)",
    )
    parser.add_argument(
        "--warmup", type=non_negative_int, default=2, help="untimed runs first (default: 2)"
    )
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed runs (default: 5)")
    parser.add_argument(
        "--slowdown",
        type=at_most(positive_float, MAX_SLOWDOWN, "times slower"),
        default=1.0,
        help="profile as a device this many times slower (default: 1)",
    )
    parser.add_argument("--name", default="local", help="device name recorded in the file")
    parser.add_argument(
        "--device",
        default="auto",
        metavar=DEVICE_CHOICES,
        help="where to run the units: auto (CUDA if torch sees a GPU, else MPS, else the "
        "CPU), cpu, cuda, cuda:N or mps (default: auto)",
    )
    parser.add_argument(
        "--train",
        action="store_true",
        help="also measure what training planners need: each unit's backward time and the "
        "bytes it saves for its backward (python -m zpipe plan --train)",
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bar on stderr (it shows only on a terminal anyway)",
    )
    parser.add_argument("-o", "--output", type=Path, required=True, help="profile file to write")
    return parser


def _training_summary(profile: ModelProfile) -> str:
    if not profile.has_training:
        return ""
    sizes = profile.batch_sizes
    backward = ", ".join(f"{sum(profile.backward_times(b)) * 1e3:.1f} ms" for b in sizes)
    saved = ", ".join(f"{sum(profile.activation_bytes(b)) / 2**20:.1f} MiB" for b in sizes)
    return f"; backward {backward}; saved for backward {saved}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.slowdown < 1:
        parser.error("--slowdown must be >= 1")
    try:
        device = resolve_device(args.device)  # a device this machine lacks: refused now
    except ConfigError as exc:
        parser.error(str(exc))
    if not args.output.parent.is_dir():  # found now, not after minutes of profiling
        parser.error(f"--output {args.output}: the directory {args.output.parent} does not exist")
    try:
        overrides = {"num_layers": args.layers} if args.layers is not None else {}
        spec = ModelSpec.preset(args.model, **overrides)
        sizes = ",".join(str(b) for b in args.batch_sizes)
        what = "forward and backward" if args.train else "forward"
        bar = TerminalProgress(False if args.quiet else None).bar(
            total=load_layer_sequence(spec).num_units,
            unit="unit",
            desc=f"profiling {args.model} ({what}, batch sizes {sizes})",
        )

        def unit_done(done: int, _total: int) -> None:
            bar.update(done - bar.n)

        # a stage's allocator: a unit's forward memory counts the process's resident
        # growth, which glibc's thresholds move (a CNN's 1.6-1.9x higher under its defaults)
        retain_freed_memory()
        with bar:
            profile = profile_model(
                spec,
                batch_sizes=args.batch_sizes,
                dtype=args.dtype,
                warmup=args.warmup,
                repeats=args.repeats,
                slowdown=args.slowdown,
                device_name=args.name,
                train=args.train,
                device=device,
                on_unit=unit_done,
            )
        profile.save(args.output)
    except ZpipeError as exc:
        print(f"python -m zpipe profile: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"python -m zpipe profile: cannot write {args.output}: {exc}", file=sys.stderr)
        return 1
    total = [sum(profile.times(b)) for b in profile.batch_sizes]
    print(
        f"profiled {profile.num_units} units of {args.model} at batch sizes "
        f"{list(profile.batch_sizes)}: forward "
        + ", ".join(f"{t * 1e3:.1f} ms" for t in total)
        + _training_summary(profile)
        + f"; wrote {args.output}"
    )
    return 0
