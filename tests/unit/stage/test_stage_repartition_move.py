"""A stage's ``move`` phase fetches from a peer that is still draining.

In a ``move`` (:mod:`zpipe.stage.executors.async_repartition`) a stage fetches its new
units as soon as it flushed, while a holder upstream may still be backwarding the
last mini-batches before the pause. Each entry is asked for once, with ``wait_s``
(what is left of the stage's deadline): the holder answers once it has flushed
(``tests/integration/test_move_fetch_waits.py``), so nothing is asked again. A
refusal ends the move at once; the other entries stop waiting."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from zpipe._errors import UnitsLostError
from zpipe.stage.executors.async_repartition import StageRepartition
from zpipe.stage.metrics import StageCounters
from zpipe.stage.snapshots import SnapshotService


class Holders:
    """A snapshot service whose peers answer each entry after ``delay_s[from]`` seconds
    (a holder still draining), or refuse it (``refuse``); every request is recorded."""

    def __init__(self, delay_s: dict[str, float], refuse: str = "") -> None:
        self.delay_s = delay_s
        self.refuse = refuse
        self.asked: list[tuple[str, float | None]] = []
        self.answered: list[str] = []

    async def fetched_state(
        self, fetch: list[Any], spec: object = None, *, wait_s: float | None = None
    ) -> dict[str, torch.Tensor]:
        (entry,) = fetch
        source = entry["from"]
        self.asked.append((source, wait_s))
        await asyncio.sleep(self.delay_s.get(source, 0.0))
        if source == self.refuse:
            raise UnitsLostError((2, 3), f"{source} could not send them: not named")
        self.answered.append(source)
        return {f"units.{entry['start']}.weight": torch.ones(1)}


def _stage(holders: Holders, timeout_s: float = 60.0) -> StageRepartition:
    snapshots: SnapshotService = holders  # type: ignore[assignment]
    return StageRepartition(
        name="s0",
        snapshots=snapshots,
        counters=StageCounters(),
        compute=ThreadPoolExecutor(1),
        timeout_s=timeout_s,
    )


def test_each_entry_is_asked_for_once_and_may_wait_at_its_holder() -> None:
    holders = Holders({"s2": 0.2})  # s2 still drains: its answer comes later
    entries = [{"from": "s1", "start": 2}, {"from": "s2", "start": 3}]
    state = asyncio.run(_stage(holders, timeout_s=60.0)._fetch_when_held(entries))
    assert sorted(state) == ["units.2.weight", "units.3.weight"]
    # one request per entry, none asked again, each letting its holder wait for its flush
    assert sorted(source for source, _ in holders.asked) == ["s1", "s2"]
    assert all(wait is not None and 0 < wait <= 60.0 for _, wait in holders.asked)
    # the holder that had flushed answered first, not held up by the one draining
    assert holders.answered == ["s1", "s2"]


def test_a_refusal_ends_the_move_at_once_and_the_other_entries_stop_waiting() -> None:
    async def scenario() -> tuple[float, list[str]]:
        holders = Holders({"s1": 0.05, "s2": 30.0}, refuse="s1")
        started = time.monotonic()
        with pytest.raises(UnitsLostError, match="not named"):
            await _stage(holders)._fetch_when_held([{"from": "s1", "start": 2},
                                                    {"from": "s2", "start": 3}])  # fmt: skip
        took = time.monotonic() - started
        await asyncio.sleep(0.1)  # a wait left running would answer later
        return took, holders.answered

    took, answered = asyncio.run(scenario())
    assert took < 20.0 and answered == []


def test_a_move_with_nothing_to_fetch_asks_nobody() -> None:
    holders = Holders({})
    assert asyncio.run(_stage(holders)._fetch_when_held([])) == {}
    assert holders.asked == []
