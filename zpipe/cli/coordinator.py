"""``python -m zpipe.coordinator``: keep the membership and plan the runs."""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
from pathlib import Path

from zpipe._errors import ConfigError, ZpipeError
from zpipe.cli.common import (
    add_common_flags,
    at_most,
    positive_int,
    run_until_signalled,
    timeouts_from_args,
)
from zpipe.coordinator.server import Coordinator, CoordinatorConfig
from zpipe.log import configure_logging, get_logger
from zpipe.models.trust import (
    add_allow_factory_arguments,
    allow_list_from_args,
    allow_peer_factories,
)
from zpipe.planner.memory import DEFAULT_MEMORY_MARGIN, check_margin
from zpipe.transport.sockets import validate_endpoint

# More missed heartbeats than this before acting is no failure detection at all.
MAX_INTERVALS = 1000


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m zpipe.coordinator",
        description="Run the zpipe coordinator: stages register here and send heartbeats; clients "
        "ask for runs here; the coordinator plans each run, assigns every stage its units and "
        "neighbours, reports stages that die, and gathers per-stage metrics. It carries control "
        "messages only, never activations.",
    )
    parser.add_argument(
        "--bind",
        default="tcp://0.0.0.0:5550",
        metavar="tcp://HOST:PORT",
        help="control endpoint to listen on (default: tcp://0.0.0.0:5550)",
    )
    parser.add_argument(
        "--endpoint-file",
        default=None,
        metavar="PATH",
        help="once listening, write the endpoint it listens on to PATH, its port resolved "
        "(with --bind tcp://HOST:0 the system picks a free port: whoever starts the "
        "coordinator reads it here instead of choosing a port that another program may "
        "take before the coordinator binds it)",
    )
    parser.add_argument(
        "--suspect-after",
        type=at_most(positive_int, MAX_INTERVALS, "heartbeat intervals"),
        default=3,
        metavar="N",
        help="missed heartbeat intervals before a stage is suspected and probed; a floor: "
        "a stage whose heartbeats come late gets a deadline from its gaps (default: 3)",
    )
    parser.add_argument(
        "--probe-intervals",
        type=at_most(positive_int, MAX_INTERVALS, "heartbeat intervals"),
        default=2,
        metavar="N",
        help="intervals a suspect stage has to answer the probe before it is "
        "declared dead; a floor, lengthened for a stage that answers late (default: 2)",
    )
    parser.add_argument(
        "--no-measure-links",
        dest="measure_links",
        action="store_false",
        help="plan links from what each stage declares (--bandwidth-mbps, --latency-ms) "
        "instead of having the stages measure them before the first planned run",
    )
    parser.add_argument(
        "--state-dir",
        default=None,
        metavar="DIR",
        help="keep the current run and its latest training replica in DIR (created if "
        "missing), so that a coordinator restarted with the same DIR and --bind takes the "
        "run over: stages that are still running register again, and the client carries "
        "on (restart within the stages' --coordinator-timeout; default: not kept). On SIGTERM "
        "or SIGINT the stages are left running for the next coordinator",
    )
    parser.add_argument(
        "--shutdown-stages-on-exit",
        action="store_true",
        help="on SIGTERM or SIGINT, tell every stage to shut down even with --state-dir "
        "(without --state-dir they always are)",
    )
    parser.add_argument(
        "--memory-margin",
        type=memory_margin,
        default=DEFAULT_MEMORY_MARGIN,
        metavar="F",
        help="safety margin of the memory model: a stage fits its memory budget when its "
        "predicted peak (its process's base, weights, working set; for training also "
        "gradients, optimizer state and saved activations) times 1 + F is within it "
        f"(default: {DEFAULT_MEMORY_MARGIN:g})",
    )
    add_allow_factory_arguments(parser)
    add_common_flags(parser)
    return parser


def memory_margin(text: str) -> float:
    """``--memory-margin``: a fraction within 0 .. 10 (argparse's type)."""
    try:
        return check_margin(float(text))
    except (ValueError, ConfigError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def config_from_args(args: argparse.Namespace) -> CoordinatorConfig:
    """The coordinator's configuration from its parsed flags (ConfigError if they clash)."""
    validate_endpoint(args.bind, flag="--bind")
    return CoordinatorConfig(
        bind=args.bind,
        keys_dir=Path(args.keys) if args.keys else None,
        measure_links=args.measure_links,
        memory_margin=args.memory_margin,
        state_dir=Path(args.state_dir) if args.state_dir else None,
        shutdown_stages_on_exit=True if args.shutdown_stages_on_exit else None,
        timeouts=timeouts_from_args(
            args,
            suspect_after_intervals=args.suspect_after,
            probe_intervals=args.probe_intervals,
        ),
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        # Model factories peers' specs may name: what the operator allowed, nothing else.
        allow_peer_factories(allow_list_from_args(args))
        config = config_from_args(args)
    except ZpipeError as exc:
        parser.error(str(exc))
    configure_logging(log_format=args.log_format, level=args.log_level)
    log = get_logger("zpipe.coordinator")
    try:
        coordinator = Coordinator(config)
    except ZpipeError as exc:
        parser.error(str(exc))

    # Torch, the run kinds and what a planner would import on its first plan (on a
    # thread sharing the GIL with the loop) are imported at the first run request,
    # on the loop (zpipe/coordinator/run_kinds.py): membership needs none of them.
    # What is imported and built by now lives as long as the process: out of the
    # collector's way, so that a full collection does not walk it (a pause of tens of
    # milliseconds every few seconds, heard as late heartbeat answers).
    gc.collect()
    gc.freeze()
    gc.enable()  # off during the imports when started as python -m zpipe.coordinator

    async def run() -> int:
        listening = asyncio.Event()
        announce = None
        if args.endpoint_file:
            path = Path(args.endpoint_file)
            announce = asyncio.create_task(announce_endpoint(listening, coordinator, path))
        try:
            await coordinator.serve(ready=listening)
        except ZpipeError as exc:
            log.error("coordinator_failed", error=str(exc))
            print(f"zpipe.coordinator: {exc}", file=sys.stderr)
            return 1
        finally:
            if announce is not None:
                announce.cancel()
        return 0

    return run_until_signalled(run, coordinator.stop, parent_pid=args.parent_pid)


async def announce_endpoint(listening: asyncio.Event, coordinator: Coordinator, path: Path) -> None:
    """``--endpoint-file``: the endpoint, written once the coordinator listens. Written
    whole (a temporary file renamed), so that a reader never sees half of it."""
    await listening.wait()
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(coordinator.endpoint + "\n")
    os.replace(partial, path)


if __name__ == "__main__":
    sys.exit(main())
