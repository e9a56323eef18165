"""Speed verdicts that came during a look or a move, kept until it ends.

A stage's speed watch fires once per change (it then starts again from the new
level), so a verdict the coordinator dropped was never sent again. One that comes
while a look or a move is in progress is therefore kept, and when the look ends
(:func:`zpipe.coordinator.runs.async_speed.relay_speed_change` keeps it,
:meth:`~zpipe.coordinator.runs.async_repartition.LiveRepartitioning.flow` calls
:meth:`DeferredVerdicts.after_look`), it goes to the client, whose next look takes
it, unless:

- the look took it itself (it came before that look decided): the client need not
  look again;
- the look moved the cuts it measured (its plan epoch is older now), or the client
  is pausing for a move a look decided (the commit will make it older): it measured
  units the stage no longer runs.

Pure: verdicts in, commands out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zpipe.coordinator.commands import Command, Log, Send
from zpipe.coordinator.state import CLIENT_NAME
from zpipe.protocol.repartition import SpeedChanged
from zpipe.training.repartition_window import SpeedVerdict


def verdict_fields(stage: str, message: SpeedChanged) -> dict[str, Any]:
    """What a speed verdict's relay, deferral or drop says of it in the log."""
    return {
        "stage": stage,
        "run": message.run,
        "step": message.step,
        "plan_epoch": message.plan_epoch,
        "ratio": round(message.ratio, 3),
    }


class DeferredVerdicts:
    """The latest verdict per stage that came during the look or move in progress,
    in the run's epoch, as the client is to be told it."""

    def __init__(self) -> None:
        self._kept: dict[str, SpeedChanged] = {}

    def keep(self, stage: str, relayed: SpeedChanged) -> None:
        self._kept[stage] = relayed

    def after_look(
        self,
        *,
        move_pending: bool,
        plan_epoch: int,
        untaken: Mapping[str, SpeedVerdict],
        client: bytes,
        timeout_s: float,
    ) -> list[Command]:
        """A look or a move ended with the cuts of ``plan_epoch``; ``untaken``: the
        verdicts kept for the next look (those the look just made did not take).
        What to tell the client; with ``move_pending`` nothing yet: every verdict is
        kept until the move's own flow ends."""
        if move_pending:
            return []
        kept, self._kept = self._kept, {}
        out: list[Command] = []
        for stage, message in kept.items():
            fields = verdict_fields(stage, message)
            waiting = untaken.get(stage)
            if message.plan_epoch < plan_epoch:
                out.append(Log("info", "speed_change_dropped", {**fields, "why": "older cuts"}))
            elif waiting is None or waiting.step != message.step:
                why = "the look took it"
                out.append(Log("info", "speed_change_dropped", {**fields, "why": why}))
            else:
                out.append(Log("info", "speed_change_relayed", {**fields, "deferred": True}))
                out.append(Send(client, message, CLIENT_NAME, timeout_s))
        return out
