"""Flags and process plumbing shared by the coordinator and stage commands."""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from zpipe.config import Timeouts
from zpipe.log import LOG_FORMATS, LOG_LEVELS


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def existing_dir(text: str) -> Path:
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a directory; create keys with: python -m zpipe keys --dir {text} NAME"
        )
    return path


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("logging and security")
    group.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="console",
        help="console for people, json for one object per line (default: console)",
    )
    group.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="info",
        help="lowest level printed (default: info)",
    )
    group.add_argument(
        "--keys",
        type=existing_dir,
        default=None,
        metavar="DIR",
        help="directory of CurveZMQ key pairs (python -m zpipe keys); without it the "
        "cluster is open to any peer and a warning says so",
    )
    timing = parser.add_argument_group("timeouts")
    defaults = Timeouts()
    timing.add_argument(
        "--heartbeat-interval",
        type=positive_float,
        default=defaults.heartbeat_interval_s,
        metavar="S",
        help=f"seconds between heartbeats (default: {defaults.heartbeat_interval_s})",
    )
    timing.add_argument(
        "--connect-timeout",
        type=positive_float,
        default=defaults.connect_s,
        metavar="S",
        help=f"give up reaching the coordinator after S seconds (default: {defaults.connect_s})",
    )
    timing.add_argument(
        "--send-timeout",
        type=positive_float,
        default=defaults.send_s,
        metavar="S",
        help=f"give up a blocked send to a peer after S seconds (default: {defaults.send_s})",
    )


def timeouts_from_args(args: argparse.Namespace, **overrides: Any) -> Timeouts:
    interval = args.heartbeat_interval
    overrides.setdefault("coordinator_silence_s", max(10.0, 10 * interval))
    return Timeouts(
        connect_s=args.connect_timeout,
        heartbeat_interval_s=interval,
        send_s=args.send_timeout,
        **overrides,
    )


def run_until_signalled(main: Callable[[], Awaitable[int]], on_signal: Callable[[], None]) -> int:
    """Run ``main`` on uvloop where available; SIGINT/SIGTERM call ``on_signal`` once."""
    try:
        import uvloop  # zmq.asyncio works on uvloop: it watches zmq's fd with add_reader

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run

    async def wrapped() -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, on_signal)
            except (NotImplementedError, RuntimeError):
                pass  # not on the main thread or not supported: default handling stays
        return await main()

    return int(runner(wrapped()))
