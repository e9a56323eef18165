"""Whether the coordinator itself is cut off from its stages: self-suspicion. Pure.

Stages fail one at a time; when every one of several goes silent at once, the
likelier story is that the coordinator lost the network (or was paused), while
the stages and the data plane run on. Declaring them all dead would end a run
that is fine, so the coordinator suspects itself instead::

    trusting --(several live members, none heard for quiet_after_s)--> suspecting
    suspecting --(any of them heard again)--> trusting   (the silence was not theirs)
    suspecting --(nobody heard for give_up_after_s more)--> trusting (judged as usual)

While it suspects itself the coordinator declares no death and starts no
recovery. When a stage speaks again, every member that was speaking when the
silence began counts as alive from then (the silence was the coordinator's),
so one that truly died meanwhile is still found, after the usual suspect and
probe intervals; one that was already silent before is judged as it was. A
coordinator that hears nobody for ``give_up_after_s`` (the stages' own limit on
its silence, after which they exit) judges them as usual again. Fed the
members' last-heard times and the time, tested with plain numbers
(``tests/unit/coordinator/test_coordinator_partition.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# One member alone going silent is that member's failure, not a partition.
MIN_MEMBERS = 2


@dataclass(frozen=True)
class Suspected:
    """The coordinator now suspects itself: nobody spoke for ``silent_s``."""

    silent_s: float
    members: int


@dataclass(frozen=True)
class Rejoined:
    """A member spoke again after ``away_s`` of silence. ``refreshed``: the silent members
    that were speaking when the silence began, to count as alive from now."""

    away_s: float
    refreshed: tuple[str, ...]


@dataclass(frozen=True)
class GaveUp:
    """Nobody spoke for ``away_s``, too long for a partition the stages outlive:
    the members are judged as usual."""

    away_s: float


@dataclass(frozen=True)
class Holding:
    """Still suspecting itself: no judgement this time."""


Transition = Suspected | Rejoined | GaveUp | Holding


class PartitionWatch:
    """The coordinator's suspicion of itself, from when it last heard each live member."""

    def __init__(self, *, quiet_after_s: float, give_up_after_s: float) -> None:
        self.quiet_after_s = quiet_after_s
        self.give_up_after_s = give_up_after_s
        self._since: float | None = None  # when the suspicion began
        self._last_heard = 0.0  # the newest word from anyone when it began
        # the newest word when it gave up: no new suspicion until someone speaks after it
        self._gave_up_on: float | None = None

    @property
    def suspecting(self) -> bool:
        return self._since is not None

    def tick(self, last_heard: Mapping[str, float], now: float) -> Transition | None:
        """Judge the time: ``last_heard`` has, for every live member that has spoken to
        this process, when it was last heard. None: judge the members as usual."""
        newest = max(last_heard.values(), default=None)
        if self._since is None:
            if (
                newest is None
                or len(last_heard) < MIN_MEMBERS
                or now - newest < self.quiet_after_s
                or (self._gave_up_on is not None and newest <= self._gave_up_on)
            ):
                return None
            self._gave_up_on = None
            self._since, self._last_heard = now, newest
            return Suspected(now - newest, len(last_heard))
        began = self._last_heard
        if newest is not None and newest > began:
            self._since = None
            refreshed = tuple(
                sorted(
                    name
                    for name, heard in last_heard.items()
                    if heard <= began and began - heard < self.quiet_after_s
                )
            )
            return Rejoined(now - began, refreshed)
        # counted from the first tick that saw the silence, not from the last word: a
        # coordinator paused for long (SIGSTOP, a VM freeze) first reads what queued
        if now - self._since >= self.give_up_after_s:
            self._since, self._gave_up_on = None, newest
            return GaveUp(now - began)
        return Holding()
