"""A stage's ``move`` phase fetches from a peer that is still draining.

In a ``move`` (:mod:`zpipe.stage.executors.async_repartition`) a stage fetches its new
units as soon as it flushed, while a holder upstream may still be backwarding the
last mini-batches before the pause: that holder answers that it has no snapshot of
the step yet. The fetch is asked again until the holder flushed; a refusal for any
other reason (no grant, an older run) ends the move at once, not after the
timeout."""

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

STATE = {"units.2.weight": torch.ones(2)}


class DrainingHolder:
    """A snapshot service whose peer answers with ``errors`` one by one, then the state."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = list(errors)
        self.asked = 0

    async def fetched_state(self, fetch: list[Any]) -> dict[str, torch.Tensor]:
        self.asked += 1
        if self.errors:
            raise UnitsLostError((2, 3), f"s1 could not send them: {self.errors.pop(0)}")
        return dict(STATE)


def _repartition(holder: DrainingHolder, timeout_s: float) -> StageRepartition:
    snapshots: SnapshotService = holder  # type: ignore[assignment]
    return StageRepartition(
        name="s0",
        snapshots=snapshots,
        counters=StageCounters(),
        compute=ThreadPoolExecutor(1),
        timeout_s=timeout_s,
    )


NOT_YET = "no snapshot of 's1' after mini-batch 10 of run 1 here (held: [])"


def test_a_holder_that_has_not_flushed_yet_is_asked_again_until_it_has() -> None:
    holder = DrainingHolder([NOT_YET, NOT_YET, NOT_YET])
    state, tries = asyncio.run(_repartition(holder, 60.0)._fetch_when_held([{}]))
    assert holder.asked == tries == 4
    torch.testing.assert_close(state["units.2.weight"], STATE["units.2.weight"])


def test_a_refusal_ends_the_move_at_once() -> None:
    holder = DrainingHolder(["the coordinator did not name anyone to fetch units [2, 3)"])
    started = time.monotonic()
    with pytest.raises(UnitsLostError, match="did not name"):
        asyncio.run(_repartition(holder, 60.0)._fetch_when_held([{}]))
    assert holder.asked == 1 and time.monotonic() - started < 30.0


def test_a_holder_that_never_flushes_fails_the_move_at_the_timeout() -> None:
    holder = DrainingHolder([NOT_YET] * 1000)
    with pytest.raises(UnitsLostError, match="no snapshot"):
        asyncio.run(_repartition(holder, 0.3)._fetch_when_held([{}]))
    assert 2 <= holder.asked < 1000


def test_each_entry_is_asked_again_alone() -> None:
    class TwoHolders:
        def __init__(self) -> None:
            self.asked: list[str] = []
            self.draining = 2  # s2's snapshot comes on its third request

        async def fetched_state(self, fetch: list[Any]) -> dict[str, torch.Tensor]:
            (entry,) = fetch
            self.asked.append(entry["from"])
            if entry["from"] == "s2" and self.draining:
                self.draining -= 1
                raise UnitsLostError((3, 4), f"s2 could not send them: {NOT_YET}")
            return {f"units.{entry['start']}.weight": torch.ones(1)}

    holders = TwoHolders()
    snapshots: SnapshotService = holders  # type: ignore[assignment]
    stage = StageRepartition(
        name="s0", snapshots=snapshots, counters=StageCounters(),
        compute=ThreadPoolExecutor(1), timeout_s=60.0,
    )  # fmt: skip
    entries = [{"from": "s1", "start": 2}, {"from": "s2", "start": 3}]
    state, tries = asyncio.run(stage._fetch_when_held(entries))
    assert sorted(state) == ["units.2.weight", "units.3.weight"]
    # the holder that had flushed was asked once, not again with the one still draining
    assert holders.asked.count("s1") == 1 and holders.asked.count("s2") == 3 and tries == 4


def test_when_one_entry_is_refused_the_others_stop_asking() -> None:
    class RefusedAndDraining:
        def __init__(self) -> None:
            self.asked: list[str] = []

        async def fetched_state(self, fetch: list[Any]) -> dict[str, torch.Tensor]:
            (entry,) = fetch
            self.asked.append(entry["from"])
            if entry["from"] == "s1":
                await asyncio.sleep(0.05)  # s2 is asked a few times first
                raise UnitsLostError((2, 3), "s1 could not send them: not named")
            raise UnitsLostError((3, 4), f"s2 could not send them: {NOT_YET}")

    async def scenario(holders: RefusedAndDraining) -> int:
        snapshots: SnapshotService = holders  # type: ignore[assignment]
        stage = StageRepartition(
            name="s0", snapshots=snapshots, counters=StageCounters(),
            compute=ThreadPoolExecutor(1), timeout_s=60.0,
        )  # fmt: skip
        with pytest.raises(UnitsLostError, match="not named"):
            await stage._fetch_when_held([{"from": "s1"}, {"from": "s2"}])
        asked = len(holders.asked)
        await asyncio.sleep(0.5)  # a poller left running would ask s2 again meanwhile
        return len(holders.asked) - asked

    assert asyncio.run(scenario(RefusedAndDraining())) == 0
