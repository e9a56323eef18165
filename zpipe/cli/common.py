"""Flags and process plumbing shared by every command.

Numeric flag types refuse what no run can use (NaN, infinities, negatives where
a count or a duration is meant) with argparse's exit status 2 and a message
naming the flag. :class:`DeprecatedAlias` keeps an old spelling of a flag
working while saying, in one line on stderr, which spelling replaces it.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import math
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from zpipe.cli.parent_watch import watch_parent
from zpipe.config import Timeouts
from zpipe.log import LOG_FORMATS, LOG_LEVELS

Number = TypeVar("Number", int, float)

# Bounds of device flags (stage and profile) far beyond any device: a typo is refused
# instead of asking torch for a billion threads or stretching compute without end.
MAX_THREADS = 1024
MAX_SLOWDOWN = 1000.0

# The longest duration a flag of seconds may ask for: a day. Longer waits are typos
# (or "inf"), and ZeroMQ's millisecond socket timeouts overflow far above it.
MAX_FLAG_SECONDS = 86_400.0


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number")
    return value


def positive_float(text: str) -> float:
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return value


def seconds(text: str) -> float:
    """A duration: finite, > 0 and at most :data:`MAX_FLAG_SECONDS`."""
    value = positive_float(text)
    if value > MAX_FLAG_SECONDS:
        raise argparse.ArgumentTypeError(
            f"{text!r} must be at most {MAX_FLAG_SECONDS:g} seconds (a day)"
        )
    return value


def unit_interval(text: str) -> float:
    """A number in [0, 1): a momentum, a probability of loss."""
    value = non_negative_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0 and below 1")
    return value


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def non_negative_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return value


def at_most(parse: Callable[[str], Number], limit: Number, why: str) -> Callable[[str], Number]:
    """``parse``, also refusing values above ``limit`` (``why`` says what the limit is)."""

    def parse_bounded(text: str) -> Number:
        value = parse(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"{text!r} must be at most {limit:g} ({why})")
        return value

    return parse_bounded


def existing_dir(text: str) -> Path:
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a directory; create keys with: python -m zpipe keys --dir {text} NAME"
        )
    return path


class DeprecatedAlias(argparse.Action):
    """Store a flag's value; under an old spelling, also warn on stderr (one line).

    ``parser.add_argument("--planner", "--algo", action=DeprecatedAlias, deprecated=("--algo",))``
    accepts both spellings into one destination; the help lists the old one as
    deprecated. The warning goes to stderr, so output a script reads is unchanged.
    """

    def __init__(
        self, option_strings: Sequence[str], dest: str, *, deprecated: Sequence[str], **kwargs: Any
    ) -> None:
        unknown = set(deprecated) - set(option_strings)
        if unknown or not deprecated or deprecated[0] == option_strings[0]:
            raise ValueError(f"deprecated spellings {deprecated} must follow the current one")
        self.current = option_strings[0]
        self.deprecated = tuple(deprecated)
        help_text = kwargs.get("help")
        if help_text and help_text is not argparse.SUPPRESS:
            kwargs["help"] = f"{help_text} ({', '.join(self.deprecated)}: deprecated spelling)"
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if option_string in self.deprecated:
            print(
                f"{parser.prog}: warning: {option_string} is deprecated and will be removed; "
                f"use {self.current}",
                file=sys.stderr,
            )
        setattr(namespace, self.dest, values)


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
        type=seconds,
        default=defaults.heartbeat_interval_s,
        metavar="S",
        help=f"seconds between heartbeats (default: {defaults.heartbeat_interval_s})",
    )
    timing.add_argument(
        "--connect-timeout",
        type=seconds,
        default=defaults.connect_s,
        metavar="S",
        help=f"give up reaching the coordinator after S seconds (default: {defaults.connect_s})",
    )
    group.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        metavar="PID",
        help="shut down (as on SIGTERM) once process PID is no longer this process's parent, "
        "i.e. it died; LocalCluster passes its own PID, so a cluster's processes do not "
        "outlive a program that was killed (default: off)",
    )
    timing.add_argument(
        "--send-timeout",
        type=seconds,
        default=defaults.send_s,
        metavar="S",
        help=f"give up a blocked send to a peer after S seconds (default: {defaults.send_s})",
    )


def timeouts_from_args(args: argparse.Namespace, **overrides: Any) -> Timeouts:
    interval = args.heartbeat_interval
    overrides.setdefault("coordinator_silence_s", max(60.0, 10 * interval))
    return Timeouts(
        connect_s=args.connect_timeout,
        heartbeat_interval_s=interval,
        send_s=args.send_timeout,
        **overrides,
    )


def enable_crash_tracebacks() -> None:
    """Every thread's Python traceback on stderr if the process dies of a fatal
    signal (SIGSEGV, SIGABRT, SIGBUS, ...), and on SIGUSR1 without stopping it.

    A crash inside libzmq, uvloop or torch otherwise leaves nothing in a stage's or
    the coordinator's log but its exit status; SIGUSR1 shows where a process that
    answers nothing is waiting. Skipped where stderr has no file descriptor (the
    command run in-process under a capturing test harness)."""
    try:
        faulthandler.enable(all_threads=True)
        if hasattr(signal, "SIGUSR1"):
            faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (AttributeError, OSError, RuntimeError, ValueError):
        pass  # stderr is None or not a real file: nothing to write the traceback to


def run_until_signalled(
    main: Callable[[], Awaitable[int]],
    on_signal: Callable[[], None],
    *,
    parent_pid: int | None = None,
) -> int:
    """Run ``main`` on uvloop where available; SIGINT/SIGTERM call ``on_signal`` once,
    and so does the death of ``parent_pid`` (see :func:`zpipe.cli.parent_watch.watch_parent`)."""
    enable_crash_tracebacks()
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
        if parent_pid is None:
            return await main()
        watch = asyncio.ensure_future(watch_parent(parent_pid, on_signal))
        try:
            return await main()
        finally:
            watch.cancel()

    return int(runner(wrapped()))
