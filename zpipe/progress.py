"""What a person at a terminal sees while zpipe works: phase lines and progress bars.

Everything goes to stderr, so a command's stdout stays its result (a table, a
JSON document) however it is piped. Nothing is shown when stderr is not a
terminal (a log file, a test) or when the user asked for quiet (``--quiet``,
``progress=False``)::

    progress = TerminalProgress()                      # on when stderr is a terminal
    with progress.phase("profiling 12 units"): # "profiling 12 units ..." then "... 4.1 s"
        ...
    async with progress.waiting("planning"):   # a line whose seconds count up
        await reply
    bar = progress.bar(total=32, unit="micro-batch", desc="streaming")

A bar's rate and time left come from tqdm, counted from the bar's first update
(:class:`ResultBar`), so the seconds spent starting and planning before the first
result do not drag the rate down.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, TextIO

from tqdm import tqdm

# how often a waiting line's seconds are redrawn
TICK_S = 0.5


def shown(setting: bool | None, stream: TextIO | None = None) -> bool:
    """``setting`` if given, else whether ``stream`` (stderr) is a terminal."""
    if setting is not None:
        return setting
    stream = stream if stream is not None else sys.stderr
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if isatty is not None else False
    except ValueError:  # a closed stream
        return False


class TerminalProgress:
    """Phase lines and bars on ``stream`` (stderr), or nothing when not ``enabled``."""

    def __init__(self, enabled: bool | None = None, *, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = shown(enabled, self.stream)

    def note(self, text: str) -> None:
        """One line, as it is."""
        if self.enabled:
            print(text, file=self.stream, flush=True)

    @contextlib.contextmanager
    def phase(self, text: str) -> Iterator[None]:
        """``text ...`` now, and how long it took when the block ends."""
        started = time.perf_counter()
        self.note(f"{text} ...")
        yield
        self.note(f"{text}: done in {time.perf_counter() - started:.1f} s")

    @contextlib.asynccontextmanager
    async def waiting(self, text: str) -> AsyncIterator[None]:
        """A line whose elapsed seconds count up while the block awaits something
        (on a terminal; elsewhere one line at the start and one at the end)."""
        if not self.enabled:
            yield
            return
        started = time.perf_counter()
        redraw = self.stream.isatty() if hasattr(self.stream, "isatty") else False

        async def tick() -> None:
            while True:
                await asyncio.sleep(TICK_S)
                elapsed = time.perf_counter() - started
                print(f"\r{text} ... {elapsed:.0f} s", end="", file=self.stream, flush=True)

        ticker = asyncio.ensure_future(tick()) if redraw else None
        if not redraw:
            self.note(f"{text} ...")
        try:
            yield
        finally:
            if ticker is not None:
                ticker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await ticker
            end = "\r" if redraw else ""
            self.note(f"{end}{text}: {time.perf_counter() - started:.1f} s")

    def bar(self, *, total: int | None, unit: str, desc: str, **extra: Any) -> tqdm[Any]:
        """A tqdm bar on the stream (hidden when not enabled); ``total`` gives the ETA."""
        return tqdm(
            total=total,
            unit=unit,
            desc=desc,
            file=self.stream,
            disable=not self.enabled,
            # a terminal that reports no size (a pty under `script`, some CI
            # consoles) would make tqdm draw nothing at all
            ncols=shutil.get_terminal_size().columns,
            nrows=shutil.get_terminal_size().lines,
            **extra,
        )


class ResultBar:
    """``progress(received, sent)`` for an inference stream: a bar of ``total``
    micro-batches, made at the first result so that its rate is the stream's
    (the time to start, profile and plan left out)."""

    def __init__(
        self, progress: TerminalProgress, *, total: int | None, desc: str = "streaming"
    ) -> None:
        self.progress = progress
        self.total = total
        self.desc = desc
        self._bar: tqdm[Any] | None = None

    def __call__(self, received: int, _sent: int) -> None:
        if self._bar is None:
            # tqdm's rate is (n - initial) / time since it was made: results after
            # the first, over the time since the first
            self._bar = self.progress.bar(
                total=self.total, unit="mb", desc=self.desc, initial=received
            )
            return
        self._bar.update(received - self._bar.n)

    @property
    def rate(self) -> float | None:
        """Micro-batches per second since the first result (None before a second one)."""
        bar = self._bar
        if bar is None or bar.n <= bar.initial:
            return None
        elapsed = bar._time() - bar.start_t
        return (bar.n - bar.initial) / elapsed if elapsed > 0 else None

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
