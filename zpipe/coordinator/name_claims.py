"""A registration under a name that a live stage holds: a duplicate, or a restart?

Each stage process connects with a routing id of its own (``NAME#INCARNATION``),
so a registration from another routing id under a name a member holds comes
either from a second process started with that name by mistake, or from the
same stage restarted after a crash (or frozen, then replaced). The coordinator
asks the holder with a probe, and the claim is settled by what happens:

    the probe cannot be sent (the holder's connection is gone) ─> the newcomer takes over
    the holder answers the probe                                ─> the newcomer is refused
    no answer within the suspect and probe times (frozen)       ─> the newcomer takes over

A holder that the coordinator has not heard from for its suspect time is not
asked: the newcomer takes over at once. Pure bookkeeping; the core sends and
decides with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from zpipe.coordinator.events import RegisterAsked

# Probe nonces of claims, far from the membership's own (which count up from 1), so that
# a late answer to one is never taken for the other.
_FIRST_NONCE = 1 << 40


@dataclass
class Claim:
    """A newcomer's registration, waiting for the holder of its name to answer."""

    name: str
    registration: RegisterAsked
    nonce: int
    deadline: float


class NameClaims:
    """The claims pending, at most one per name (a newcomer's repeated registrations
    refresh its claim; they open no second probe)."""

    def __init__(self) -> None:
        self._claims: dict[str, Claim] = {}
        self._next_nonce = _FIRST_NONCE

    def __contains__(self, name: str) -> bool:
        return name in self._claims

    def open(
        self, name: str, registration: RegisterAsked, now: float, window_s: float
    ) -> Claim | None:
        """A new claim (the caller probes the holder), or None when one is pending
        (its registration is replaced by this newer one)."""
        pending = self._claims.get(name)
        if pending is not None:
            pending.registration = registration
            return None
        self._next_nonce += 1
        claim = Claim(name, registration, self._next_nonce, now + window_s)
        self._claims[name] = claim
        return claim

    def answered(self, name: str, nonce: object) -> Claim | None:
        """The holder answered this claim's probe: the claim, settled (refused)."""
        claim = self._claims.get(name)
        if claim is None or claim.nonce != nonce:
            return None
        return self._claims.pop(name)

    def holder_gone(self, name: str) -> Claim | None:
        """The holder's connection is gone: the claim, settled (taken over)."""
        return self._claims.pop(name, None)

    def expired(self, now: float) -> list[Claim]:
        """Claims whose holder did not answer in time: settled (taken over)."""
        late = [c for c in self._claims.values() if c.deadline <= now]
        for claim in late:
            del self._claims[claim.name]
        return late
