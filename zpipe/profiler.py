"""Measure a model's units on this device: the numbers the planners plan from.

For each profiled batch size every unit's forward is timed (after warm-up, the
median of repeats), and its output size, weight size and activation memory are
recorded. Times of a larger batch are never reported below those of a smaller
one (a running maximum over batch sizes), so noise cannot make a planner
believe that more work is cheaper.

Activation memory is an estimate: the bytes of a unit's inputs and outputs,
which are alive together while it runs (torch has no cheap per-module peak
memory counter on CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from zpipe._errors import ConfigError, ZpipeError
from zpipe.cli_common import positive_float, positive_int
from zpipe.models import ModelSpec, available_presets, load_layer_sequence
from zpipe.planner.profile import ModelProfile, UnitProfile
from zpipe.transport.emulation import compute_cpu_s, emulate_slowdown

BUILT_IN_FAMILIES = ("transformer", "mlp", "cnn")


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _as_tuple(value: object) -> tuple[torch.Tensor, ...]:
    if isinstance(value, torch.Tensor):
        return (value,)
    return tuple(value)  # type: ignore[arg-type]


@contextlib.contextmanager
def _compute_dtype(dtype: str) -> Iterator[None]:
    if dtype == "bfloat16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield
    elif dtype == "float32":
        yield
    else:
        raise ConfigError(f"dtype must be float32 or bfloat16, got {dtype!r}")


def profile_model(
    spec: ModelSpec,
    *,
    batch_sizes: Sequence[int] = (1, 2, 4, 8),
    dtype: str = "float32",
    warmup: int = 2,
    repeats: int = 5,
    slowdown: float = 1.0,
    device_name: str = "local",
) -> ModelProfile:
    """Profile every unit of ``spec`` at each batch size on this device."""
    sizes = sorted(set(batch_sizes))
    if not sizes or sizes[0] < 1:
        raise ConfigError(f"batch sizes must be >= 1, got {list(batch_sizes)}")
    if repeats < 1 or warmup < 0:
        raise ConfigError("repeats must be >= 1 and warmup >= 0")
    sequence = load_layer_sequence(spec)
    names = sequence.unit_names()
    count = sequence.num_units
    # Built-in families build one unit at a time, so a device with little memory
    # can profile a model it could never hold whole; adapters build the user's
    # module whole anyway, so they build it once.
    whole = None if spec.family in BUILT_IN_FAMILIES else sequence.build_units(0, count)
    param_bytes: list[int] = []
    times: list[list[float]] = [[] for _ in range(count)]
    outputs: list[list[int]] = [[] for _ in range(count)]
    memory: list[list[int]] = [[] for _ in range(count)]
    activations = {b: sequence.example_input(b, seed=b) for b in sizes}
    input_bytes = [_nbytes(activations[b]) for b in sizes]
    with torch.inference_mode(), _compute_dtype(dtype):
        for index in range(count):
            unit = whole[index] if whole is not None else sequence.build_units(index, index + 1)[0]
            param_bytes.append(
                sum(p.numel() * p.element_size() for p in unit.parameters())
                + sum(b.numel() * b.element_size() for b in unit.buffers())
            )
            for batch_size in sizes:
                inputs = activations[batch_size]
                samples = []
                for attempt in range(warmup + repeats):
                    started, cpu_started = time.perf_counter(), time.thread_time()
                    result = _as_tuple(unit(*inputs))
                    elapsed = time.perf_counter() - started
                    # as a stage runs it: stretched from the CPU time (see emulation)
                    took = emulate_slowdown(
                        slowdown, elapsed, compute_cpu_s(time.thread_time() - cpu_started)
                    )
                    if attempt >= warmup:
                        samples.append(took)
                times[index].append(statistics.median(samples))
                outputs[index].append(_nbytes(result))
                memory[index].append(_nbytes(inputs) + _nbytes(result))
                activations[batch_size] = result
            del unit
    for row in times:  # a larger batch is never cheaper than a smaller one
        for i in range(1, len(row)):
            row[i] = max(row[i], row[i - 1])
    return ModelProfile(
        batch_sizes=tuple(sizes),
        units=tuple(
            UnitProfile(
                names[i], param_bytes[i], tuple(times[i]), tuple(outputs[i]), tuple(memory[i])
            )
            for i in range(count)
        ),
        input_bytes=tuple(input_bytes),
        model=spec.to_dict(),
        device={
            "name": device_name,
            "threads": torch.get_num_threads(),
            "dtype": dtype,
            "torch": torch.__version__,
            "slowdown": slowdown,
        },
    )


def speed_score(*, size: int = 256, repeats: int = 5, slowdown: float = 1.0) -> float:
    """Matrix-multiply GFLOP/s of this device (median), for comparing devices' speeds.

    Cheap enough to run at every stage start; a slowdown factor is applied as the
    stage applies it to real compute.
    """
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    flops = 2.0 * size**3 * 4
    samples = []
    with torch.inference_mode():
        torch.mm(a, b)
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in range(4):
                torch.mm(a, b)
            samples.append(emulate_slowdown(slowdown, time.perf_counter() - started))
    return flops / statistics.median(samples) / 1e9


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
        "--threads", type=positive_int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs first (default: 2)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed runs (default: 5)")
    parser.add_argument(
        "--slowdown",
        type=positive_float,
        default=1.0,
        help="profile as a device this many times slower (default: 1)",
    )
    parser.add_argument("--name", default="local", help="device name recorded in the file")
    parser.add_argument("-o", "--output", type=Path, required=True, help="profile file to write")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.slowdown < 1:
        parser.error("--slowdown must be >= 1")
    try:
        overrides = {"num_layers": args.layers} if args.layers is not None else {}
        spec = ModelSpec.preset(args.model, **overrides)
        profile = profile_model(
            spec,
            batch_sizes=args.batch_sizes,
            dtype=args.dtype,
            warmup=args.warmup,
            repeats=args.repeats,
            slowdown=args.slowdown,
            device_name=args.name,
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
        + f"; wrote {args.output}"
    )
    return 0
