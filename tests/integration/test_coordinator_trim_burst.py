"""A burst of asks to give memory back (the refused chunks of a transfer) makes one
trim and logs nothing: each ask while a trim was due fell through to
``unknown_command``, an error line per refused 16 MiB chunk (issue 33, half_bulk)."""

from __future__ import annotations

from typing import Any

import pytest

from zpipe.coordinator import server
from zpipe.coordinator.commands import GiveBackMemory
from zpipe.coordinator.server import Coordinator, CoordinatorConfig


class Recorder:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **fields: self.lines.append((level, event))


async def test_a_burst_of_give_backs_schedules_one_trim_and_logs_no_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    recorder = Recorder()
    monkeypatch.setattr(server, "log", recorder)
    trims: list[int] = []
    monkeypatch.setattr(server, "trim_heap", lambda: trims.append(1) or True)
    coordinator = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0"))
    try:
        coordinator._carry_out([GiveBackMemory(16 << 20) for _ in range(5)])
        assert coordinator._trim_soon is not None
        assert recorder.lines == []  # no unknown_command
        coordinator._trim_soon._run()  # due: the one trim
        assert trims == [1] and coordinator._trim_soon is None
    finally:
        coordinator._close()
