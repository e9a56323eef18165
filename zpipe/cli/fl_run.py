"""How the networked federated commands (``fl-server``, ``fl-client``) run.

Both log to the console, keep BLAS to one thread (a process per device on a
shared machine: threads would only fight over the cores) and turn zpipe's
typed errors into one line on stderr and an exit status: 2 for bad input, 1
for a run that failed.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from zpipe._errors import ConfigError, ZpipeError

T = TypeVar("T")


def run_net_command(
    command: str, work: Callable[[], Coroutine[Any, Any, T]]
) -> tuple[int, T | None]:
    """Run ``work()`` to its end; the exit status and its result (None on an error)."""
    from zpipe.devices import single_threaded_blas
    from zpipe.log import configure_logging

    configure_logging(log_format="console", level="info")
    try:
        with single_threaded_blas():
            return 0, asyncio.run(work())
    except ZpipeError as exc:
        print(f"python -m zpipe {command}: {exc}", file=sys.stderr)
        return (2 if isinstance(exc, ConfigError) else 1), None
