"""structlog set-up shared by every zpipe process.

Events are key-value pairs that name the stage, epoch and micro-batch they are
about; ``console`` renders them for people, ``json`` one object per line for
machines.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

LOG_FORMATS = ("console", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")


def configure_logging(*, log_format: str = "console", level: str = "info", **context: Any) -> None:
    """Configure structlog for this process; ``context`` is bound to every event."""
    _configure(log_format=log_format, level=level)
    structlog.contextvars.clear_contextvars()
    if context:
        structlog.contextvars.bind_contextvars(**context)


def _configure(*, log_format: str, level: str) -> None:
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {log_format!r}")
    numeric = getattr(logging, level.upper())
    renderer: Any
    if log_format == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str) -> Any:
    # A program that embeds zpipe and never configured structlog would get
    # structlog's default, which prints to stdout and mixes with the program's
    # own output; zpipe's events go to stderr unless the program chose otherwise.
    if not structlog.is_configured():
        _configure(log_format="console", level="info")
    return structlog.get_logger(name)
