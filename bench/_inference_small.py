"""``bench/inference.py``'s ``small`` section: zpipe against the PipeEdge-style torch
RPC pipeline where the runtimes' own per-message cost decides (a small MLP, micro-
batches of one sample, fast devices, no link emulation). It runs the ``rpc``
section's comparison (:func:`bench._inference_rpc.compare_with_torch_rpc`) on its
own model, devices and batches, once per in-flight bound, and names its keys
``small_*``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
from multiprocessing.connection import Connection
from types import FrameType
from typing import Any

import torch

from bench._inference_common import Outputs, _device_config
from bench._inference_rpc import RpcComparison, compare_with_torch_rpc
from zpipe.cli.common import positive_int
from zpipe.cluster import DeviceSpec
from zpipe.log import configure_logging
from zpipe.models import ModelSpec, load_layer_sequence

SMALL_MODEL = "mlp-small"  # 784-512-256-128-10: a forward of one sample is tens of µs
SMALL_STAGES = 3
# The headline bound first: 12 starves neither system (both were slower at 4, and
# neither faster at 24, on two cores); 4, about one micro-batch per stage and link,
# shows what a tight bound costs each. Both systems get the same bound at each.
SMALL_MAX_IN_FLIGHT = (12, 4)
CHILD_EXIT_S = 30.0  # for the section's process to end after it answered
HEADLINE_KEY = "small_model_ratio_vs_torch_rpc"
# the per-bound figures beside the headline (the rpc comparison's key names)
PER_BOUND_KEYS = (
    "ratio_vs_torch_rpc",
    "zpipe_samples_per_s",
    "torch_rpc_samples_per_s",
    "zpipe_cpu_ms_per_sample",
    "torch_rpc_cpu_ms_per_sample",
    "outputs_match",
)


def add_small_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--skip-small",
        action="store_true",
        help="leave out the small-model section (zpipe vs torch RPC on a small MLP)",
    )
    parser.add_argument(
        "--small-batches",
        type=positive_int,
        default=400,
        help="small section: batches per timed run (default: 400)",
    )
    parser.add_argument(
        "--small-batch-size",
        type=positive_int,
        default=8,
        help="small section: samples per batch, sent as micro-batches of one (default: 8)",
    )
    parser.add_argument(
        "--small-max-in-flight",
        type=_bounds,
        default=SMALL_MAX_IN_FLIGHT,
        help="small section: comma-separated in-flight bounds, each measured for both "
        "systems; the first gives the headline keys (default: 12,4)",
    )
    parser.add_argument(
        "--small-repeats",
        type=positive_int,
        default=3,
        help="small section: timed runs per system and bound, alternating (default: 3)",
    )


def _bounds(text: str) -> tuple[int, ...]:
    values = tuple(positive_int(part) for part in text.split(",") if part.strip())
    if not values:
        raise argparse.ArgumentTypeError("give at least one in-flight bound")
    return values


def apply_small_quick(args: argparse.Namespace) -> None:
    """``--quick``: a few batches and one repeat (numbers then say little)."""
    args.small_batches, args.small_repeats = 20, 1


def small_spec(seed: int) -> ModelSpec:
    return ModelSpec.preset(SMALL_MODEL, seed=seed)


def small_devices(threads: int) -> list[DeviceSpec]:
    """Equal devices at full speed, without link emulation: nothing but the runtimes
    stands between the compute of one stage and the next."""
    return [DeviceSpec(f"small-{i}", threads=threads) for i in range(SMALL_STAGES)]


def small_batches(spec: ModelSpec, *, count: int, batch_size: int, seed: int) -> list[Outputs]:
    """``count`` seeded batches of ``batch_size`` samples."""
    sequence = load_layer_sequence(spec)
    generator = torch.Generator().manual_seed(seed)
    return [
        sequence.example_input(
            batch_size, seed=int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        )
        for _ in range(count)
    ]


def small_keys(
    results: dict[int, tuple[dict[str, Any], bool]], bounds: tuple[int, ...]
) -> dict[str, Any]:
    """The section's summary keys from the rpc comparison's keys per in-flight bound:
    the first bound's under ``small_*`` (its ratio as ``small_model_ratio_vs_torch_rpc``),
    every bound's main figures under ``small_by_max_in_flight``."""
    headline, _ = results[bounds[0]]
    keys: dict[str, Any] = {
        HEADLINE_KEY: headline["ratio_vs_torch_rpc"],
        **{f"small_{k}": v for k, v in headline.items() if k != "ratio_vs_torch_rpc"},
    }
    keys["small_outputs_match"] = all(ok for _, ok in results.values())
    keys["small_by_max_in_flight"] = {
        str(bound): {k: results[bound][0][k] for k in PER_BOUND_KEYS} for bound in bounds
    }
    return keys


def run_small(
    args: argparse.Namespace, _spec: ModelSpec, _warmup: list[Outputs], _batches: list[Outputs]
) -> tuple[dict[str, Any], bool]:
    """The small-model comparison (its own model and batches), in a process of its own:
    summary keys, outputs match.

    torch.distributed.rpc does not start twice in one process (a second ``init_rpc``
    after ``shutdown`` hangs in its gloo rendezvous, torch 2.13), and the rpc section
    may have run here. The child is "this process" of the section: zpipe's client and
    the RPC driver, whose CPU both systems count."""
    context = mp.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(vars(args), sender), name="small-section")
    child.start()
    sender.close()
    try:
        while not receiver.poll(1.0):
            if not child.is_alive():
                break
        try:
            keys: dict[str, Any] = json.loads(receiver.recv())
        except EOFError:  # it ended without an answer (its error is on stderr)
            child.join(CHILD_EXIT_S)
            raise RuntimeError(
                f"the small section's process exited with {child.exitcode}"
            ) from None
    finally:
        receiver.close()
        child.join(CHILD_EXIT_S)
        if child.is_alive():  # an alarm or an error here: its context managers clean up
            child.terminate()
            child.join(CHILD_EXIT_S)
    return keys, bool(keys["small_outputs_match"])


def _child(arguments: dict[str, Any], sender: Connection) -> None:
    """The section's process: runs it and sends its keys back (JSON)."""
    signal.signal(signal.SIGTERM, _exit_on_term)
    configure_logging(level="warning")  # stdout is for JSON lines
    keys, _ = _run_small_here(argparse.Namespace(**arguments))
    sender.send(json.dumps(keys))
    sender.close()


def _exit_on_term(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # leaves the cluster's and the RPC world's ``with``


def _run_small_here(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    spec = small_spec(args.seed)
    cores = os.cpu_count() or 1
    threads = args.threads or max(1, cores // SMALL_STAGES)
    devices = small_devices(threads)
    warm = max(2, args.small_batches // 10)
    warmup = small_batches(spec, count=warm, batch_size=args.small_batch_size, seed=args.seed + 1)
    batches = small_batches(
        spec, count=args.small_batches, batch_size=args.small_batch_size, seed=args.seed
    )
    bounds = tuple(args.small_max_in_flight)
    config = {
        "model": SMALL_MODEL,
        "dims": spec.config["dims"],
        "units": load_layer_sequence(spec).num_units,
        "batches": args.small_batches,
        "batch_size": args.small_batch_size,
        "microbatch_size": 1,
        "dtype": "float32",
        "threads_per_stage": threads,
        "cores": cores,
        "repeats": args.small_repeats,
        "warmup_batches": warm,
        "devices": _device_config(devices),
    }
    comparison = RpcComparison(
        spec=spec,
        devices=devices,
        threads=threads,
        microbatch_size=1,
        max_in_flight=bounds,
        dtype="float32",
        repeats=args.small_repeats,
        rpc_transport=args.rpc_transport,
        rpc_timeout_s=args.rpc_timeout,
        config=config,
        section="small",
    )
    results = compare_with_torch_rpc(comparison, warmup, batches)
    keys = small_keys(results, bounds)
    return keys, bool(keys["small_outputs_match"])
