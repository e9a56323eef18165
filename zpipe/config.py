"""Timeouts and intervals shared by the coordinator, the stages and the client.

Every network await in zpipe takes its deadline from here; the command-line
flags of each process set these fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zpipe._errors import ConfigError


@dataclass(frozen=True)
class Timeouts:
    # How long a stage or client keeps trying to reach the coordinator at start.
    connect_s: float = 15.0
    # Stages send a heartbeat this often; the coordinator acknowledges each.
    heartbeat_interval_s: float = 1.0
    # Missed heartbeat intervals before the coordinator suspects and probes a stage
    # (a floor: a stage whose heartbeats come late gets a deadline from its gaps).
    suspect_after_intervals: int = 3
    # Intervals a suspect stage has to answer the probe before it is declared dead
    # (a floor too: late probe answers and late heartbeats lengthen it).
    probe_intervals: int = 2
    # A stage that hears nothing from its coordinator for this long exits; until then it
    # serves its run on (a partition, a coordinator restarted). The coordinator, cut off
    # from every stage, withholds its judgement of them as long.
    coordinator_silence_s: float = 60.0
    # A blocked send to a peer (its queue full) gives up after this long.
    send_s: float = 30.0
    # Building a shard (import, init, load weights) may take long for big models.
    assign_s: float = 300.0
    # The client waits this long for each result before naming the stalled stage.
    result_s: float = 120.0
    # A reply to a control request (run start, metrics).
    reply_s: float = 10.0

    def __post_init__(self) -> None:
        for name in (
            "connect_s",
            "heartbeat_interval_s",
            "coordinator_silence_s",
            "send_s",
            "assign_s",
            "result_s",
            "reply_s",
        ):
            value = getattr(self, name)
            # inf is refused too: a wait without end is the hang a timeout exists to prevent
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"timeout {name} must be finite and > 0 seconds, got {value}")
        if self.suspect_after_intervals < 1 or self.probe_intervals < 1:
            raise ConfigError("suspect_after_intervals and probe_intervals must be >= 1")

    @property
    def detection_bound_s(self) -> float:
        """The longest a dead stage that was punctual can go unnoticed: suspect, then an
        unanswered probe. These are floors: a stage whose heartbeats came late is
        given deadlines that follow its gaps (:mod:`zpipe.coordinator.membership`)."""
        return (self.suspect_after_intervals + self.probe_intervals + 1) * (
            self.heartbeat_interval_s
        )
