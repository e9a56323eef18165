"""``python -m zpipe.stage``: run one pipeline stage on this device."""

from __future__ import annotations

import argparse
import gc
import re
import sys
from pathlib import Path

from zpipe._errors import ZpipeError
from zpipe.cli.common import (
    MAX_SLOWDOWN,
    MAX_THREADS,
    add_common_flags,
    at_most,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    run_until_signalled,
    seconds,
    timeouts_from_args,
)
from zpipe.devices import DEVICE_CHOICES, resolve_device
from zpipe.lazy_torch import import_lazy_torch_modules
from zpipe.log import configure_logging, get_logger
from zpipe.models.size import default_build_limit, set_peer_build_limit
from zpipe.models.trust import (
    add_allow_factory_arguments,
    allow_list_from_args,
    allow_peer_factories,
)
from zpipe.planner.profile import ModelProfile
from zpipe.stage.config import DEFAULT_MAX_BATCH_ROWS
from zpipe.stage.runtime import CoordinatorLost, StageConfig, StageRuntime
from zpipe.transport.allocator import retain_freed_memory
from zpipe.transport.emulation import LinkSpec
from zpipe.transport.slowdown import SlowdownSchedule
from zpipe.transport.sockets import check_resolvable, validate_endpoint

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# Bounds far beyond any device, so that a typo (or "1e308") is refused instead of
# overflowing a byte count or delaying every message without end.
MAX_MEMORY_MB = float(2**30)  # a pebibyte
MAX_BANDWIDTH_MBPS = 1e9  # a petabit per second
MAX_LATENCY_MS = 3_600_000.0  # an hour


def stage_name(text: str) -> str:
    if not NAME_PATTERN.match(text):
        raise argparse.ArgumentTypeError(
            f"{text!r}: a stage name is 1-64 letters, digits, '.', '_' or '-'"
        )
    return text


def probability(text: str) -> float:
    value = non_negative_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be below 1")
    return value


def _slowdown_schedule(text: str) -> SlowdownSchedule:
    try:
        return SlowdownSchedule.parse(text)
    except ZpipeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m zpipe.stage",
        description="Run one zpipe pipeline stage on this device. The stage registers with the "
        "coordinator, receives an assignment (model, unit range, neighbours, plan epoch), builds "
        "only its own units and streams micro-batches from its upstream to its downstream.",
    )
    parser.add_argument(
        "--coordinator",
        required=True,
        metavar="tcp://HOST:PORT",
        help="the coordinator's control endpoint",
    )
    parser.add_argument(
        "--name",
        required=True,
        type=stage_name,
        help="unique name of this device (also its key name with --keys)",
    )
    parser.add_argument(
        "--bind",
        default="tcp://0.0.0.0:0",
        metavar="tcp://HOST:PORT",
        help="where to receive micro-batches (default: every interface, any port)",
    )
    parser.add_argument(
        "--probe-bind",
        default=None,
        metavar="tcp://HOST:PORT",
        help="where to answer other stages' link measurements (default: the --bind host, any port)",
    )
    parser.add_argument(
        "--advertise-host",
        default=None,
        metavar="HOST",
        help="address peers use to reach --bind (default: the address that "
        "routes to the coordinator)",
    )
    parser.add_argument(
        "--threads",
        type=at_most(positive_int, MAX_THREADS, "threads"),
        default=None,
        help="torch compute threads (default: torch's choice); give stages that "
        "share a machine cores // stages each",
    )
    parser.add_argument(
        "--memory-mb",
        type=at_most(positive_float, MAX_MEMORY_MB, "a pebibyte"),
        default=None,
        help="memory budget (MiB) reported to the planner; the stage reports the smaller of "
        "this and the free memory it measures on its device at start (default: the measured "
        "free memory)",
    )
    parser.add_argument(
        "--device",
        default="auto",
        metavar=DEVICE_CHOICES,
        help="where this stage computes: auto (CUDA if torch sees a GPU, else MPS, else the "
        "CPU), cpu, cuda, cuda:N or mps; the wire always carries CPU tensors (default: auto)",
    )
    parser.add_argument(
        "--max-model-mb",
        type=at_most(positive_float, MAX_MEMORY_MB, "a pebibyte"),
        default=None,
        help="the most parameters (MiB, float32) this stage builds for the coordinator's "
        "model specs; a larger request is refused before anything is allocated "
        "(default: --memory-mb, else the machine's memory)",
    )
    parser.add_argument(
        "--max-batch-rows",
        type=at_most(positive_int, 2**31, "rows"),
        default=DEFAULT_MAX_BATCH_ROWS,
        metavar="N",
        help="the most rows (samples) of one data message: once assigned, the data port "
        "refuses frames larger than N samples of the model's largest activation "
        f"(default: {DEFAULT_MAX_BATCH_ROWS})",
    )
    emu = parser.add_argument_group("emulation (experiments on one machine)")
    emu.add_argument(
        "--slowdown",
        type=at_most(positive_float, MAX_SLOWDOWN, "times slower"),
        default=1.0,
        help="play a device this many times slower: each compute step is held for (F - 1) "
        "times its CPU work on top of what it took (default: 1, must be >= 1)",
    )
    emu.add_argument(
        "--slowdown-schedule",
        type=_slowdown_schedule,
        default=None,
        metavar="S:F,...",
        help="a slowdown that changes over time, seconds:factor from the stage's first "
        "compute step (e.g. '0:1,60:10': 10 times slower after 60 s); instead of --slowdown",
    )
    emu.add_argument(
        "--bandwidth-mbps",
        type=at_most(positive_float, MAX_BANDWIDTH_MBPS, "a petabit per second"),
        default=None,
        help="emulated bandwidth of the outgoing data link in Mbit/s (default: none)",
    )
    emu.add_argument(
        "--latency-ms",
        type=at_most(non_negative_float, MAX_LATENCY_MS, "an hour"),
        default=0.0,
        help="emulated one-way latency of the outgoing data link (default: 0)",
    )
    emu.add_argument(
        "--loss",
        type=probability,
        default=0.0,
        help="probability that the outgoing link loses a message (default: 0)",
    )
    emu.add_argument(
        "--uplink-mbps",
        type=at_most(positive_float, MAX_BANDWIDTH_MBPS, "a petabit per second"),
        default=None,
        help="emulated bandwidth of the link to the coordinator in Mbit/s, which its "
        "control messages and its bulk state (weights, replicas) share (default: none)",
    )
    emu.add_argument("--loss-seed", type=non_negative_int, default=0, help="seed of the loss draws")
    emu.add_argument(
        "--emulate-compute",
        type=Path,
        default=None,
        metavar="PROFILE.json",
        help="do not compute: for each micro-batch sleep for this profile's time of the "
        "assigned units (times --slowdown) and send zero tensors of the real output shapes; "
        "profile requests are answered from the file (inference only; for emulating large "
        "clusters on one machine)",
    )
    parser.add_argument(
        "--retain-memory-mb",
        type=non_negative_int,
        default=256,
        metavar="MB",
        help="keep up to MB of freed memory instead of returning it to the kernel, so "
        "messages under 4 MiB do not page-fault in again; blocks of 4 MiB or more are "
        "mapped apart, which keeps the memory prediction true (glibc only; 0 turns it "
        "off; default: 256)",
    )
    parser.add_argument(
        "--coordinator-timeout",
        type=seconds,
        default=None,
        metavar="S",
        help="serve the current run on while the coordinator is silent (cut off, "
        "restarting), and exit once it has been silent for S seconds (default: 60, or ten "
        "heartbeat intervals if longer)",
    )
    add_allow_factory_arguments(parser)
    add_common_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        # Model factories peers' specs may name: what the operator allowed, nothing else.
        allow_peer_factories(allow_list_from_args(args))
        # How big a model a peer's spec may make this device build.
        set_peer_build_limit(
            default_build_limit(args.max_model_mb if args.max_model_mb else args.memory_mb)
        )
        validate_endpoint(args.coordinator, flag="--coordinator")
        validate_endpoint(args.bind, flag="--bind")
        if args.probe_bind is not None:
            validate_endpoint(args.probe_bind, flag="--probe-bind")
        emulate_compute = (
            ModelProfile.load(args.emulate_compute) if args.emulate_compute is not None else None
        )
        config = StageConfig(
            name=args.name,
            coordinator=args.coordinator,
            data_bind=args.bind,
            probe_bind=args.probe_bind,
            advertise_host=args.advertise_host,
            threads=args.threads,
            slowdown=args.slowdown,
            slowdown_schedule=args.slowdown_schedule,
            link=LinkSpec(args.bandwidth_mbps, args.latency_ms, args.loss, args.loss_seed),
            uplink=LinkSpec(args.uplink_mbps),
            memory_mb=args.memory_mb,
            device=args.device,
            max_batch_rows=args.max_batch_rows,
            emulate_compute=emulate_compute,
            keys_dir=Path(args.keys) if args.keys else None,
            timeouts=timeouts_from_args(
                args,
                **(
                    {"coordinator_silence_s": args.coordinator_timeout}
                    if args.coordinator_timeout is not None
                    else {}
                ),
            ),
        )
        resolve_device(config.device)  # an unavailable device is refused now, by name
        # last: every other flag is checked without a name lookup
        check_resolvable(args.coordinator, flag="--coordinator")
    except ZpipeError as exc:
        parser.error(str(exc))
    configure_logging(log_format=args.log_format, level=args.log_level)
    retain_freed_memory(args.retain_memory_mb)
    log = get_logger("zpipe.stage")
    runtime = StageRuntime(config)
    # before registering: torch's lazy imports would otherwise hold the GIL for
    # seconds on the compute thread at the first step, while heartbeats are judged
    import_lazy_torch_modules()
    # torch and the rest are imported for good: out of the collector's way, so that a
    # full collection does not pause the loop that answers heartbeats
    gc.collect()
    gc.freeze()

    async def run() -> int:
        try:
            await runtime.serve()
        except CoordinatorLost as exc:
            log.error("coordinator_lost", stage=config.name, error=str(exc))
            print(f"zpipe.stage {config.name}: {exc}", file=sys.stderr)
            return 1
        except ZpipeError as exc:
            log.error("stage_failed", stage=config.name, error=str(exc))
            print(f"zpipe.stage {config.name}: {exc}", file=sys.stderr)
            return 1
        return 0

    return run_until_signalled(run, runtime.stop, parent_pid=args.parent_pid)


if __name__ == "__main__":
    sys.exit(main())
