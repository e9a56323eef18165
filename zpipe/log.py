"""structlog set-up shared by every zpipe process, bridged to standard ``logging``.

Events are key-value pairs that name the stage, epoch and micro-batch they are
about; ``console`` renders them for people, ``json`` one object per line for
machines.

structlog renders each event to one line and hands it to the standard-library
logger of the same name (``zpipe.client``, ``zpipe.stage``, ...), so a program
that embeds zpipe controls zpipe's output the usual way::

    logging.getLogger("zpipe").setLevel(logging.WARNING)   # less
    logging.getLogger("zpipe").addHandler(my_handler)      # elsewhere

Until the program configures logging itself (a handler on the root logger or
on ``zpipe``), zpipe's events at INFO and above go to stderr, as before. zpipe's
own processes (:func:`configure_logging`) own their stderr: the ``zpipe``
logger writes there at the chosen level and does not propagate.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any, TextIO

import structlog

from zpipe.log_limits import FloodLimit

LOG_FORMATS = ("console", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
ROOT_LOGGER = "zpipe"


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (as logging's last resort
    does), so a replaced stderr (pytest's capture, a notebook's) gets the lines."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        pass


class _UntilConfigured(_Stderr):
    """zpipe's default output in an embedding program: it steps aside once the
    program gives the root logger or the ``zpipe`` logger a handler of its own
    (which then gets the records), so nothing is printed twice."""

    def emit(self, record: logging.LogRecord) -> None:
        zpipe_logger = logging.getLogger(ROOT_LOGGER)
        if logging.getLogger().handlers or any(h is not self for h in zpipe_logger.handlers):
            return
        super().emit(record)


def configure_logging(*, log_format: str = "console", level: str = "info", **context: Any) -> None:
    """Configure logging for a zpipe process; ``context`` is bound to every event."""
    _configure_structlog(log_format=log_format, with_stamp=True)
    logger = logging.getLogger(ROOT_LOGGER)
    for handler in list(logger.handlers):
        if isinstance(handler, _Stderr):
            logger.removeHandler(handler)
    handler = _Stderr()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(_numeric(level))
    logger.propagate = False  # this process's stderr is the log; nothing above it
    structlog.contextvars.clear_contextvars()
    if context:
        structlog.contextvars.bind_contextvars(**context)


def _numeric(level: str) -> int:
    if level not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {LOG_LEVELS}, got {level!r}")
    return int(getattr(logging, level.upper()))


def _configure_structlog(*, log_format: str, with_stamp: bool) -> None:
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {log_format!r}")
    renderer: Any
    if log_format == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=with_stamp and sys.stderr.isatty())
    # the level and time are the handler's to add when structlog does not stamp them
    stamps: list[Any] = (
        [structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True)]
        if with_stamp
        else []
    )
    structlog.configure(
        processors=[
            # first: an event the logging level leaves out costs nothing more
            structlog.stdlib.filter_by_level,
            FloodLimit(),  # a flood of bad input writes a few lines a second, not megabytes
            structlog.contextvars.merge_contextvars,
            *stamps,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.stdlib.BoundLogger,
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )


def _configure_embedded() -> None:
    """A program that embeds zpipe and never configured it: events go through the
    standard ``zpipe`` logger, shown on stderr at INFO and above until the program
    configures logging (see the module notes)."""
    _configure_structlog(log_format="console", with_stamp=False)
    logger = logging.getLogger(ROOT_LOGGER)
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        handler = _UntilConfigured()
        handler.setFormatter(
            logging.Formatter("%(asctime)s [%(levelname)-7s] %(name)s: %(message)s")
        )
        logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def get_logger(name: str) -> Any:
    # A program that embeds zpipe and never configured structlog would get
    # structlog's default, which prints to stdout and mixes with the program's
    # own output; zpipe's events go through standard logging instead.
    if not structlog.is_configured():
        _configure_embedded()
    return structlog.get_logger(name)


def read_events(text: str, *events: str) -> list[dict[str, Any]]:
    """The records of ``events`` (all records when none is named) in a JSON-lines
    log, ``configure_logging(log_format="json")``'s output, in order. Other lines
    (a traceback, a line from a library) are skipped."""
    found = []
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and (not events or record.get("event") in events):
            found.append(record)
    return found
