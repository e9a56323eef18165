"""Whose acknowledgements an ACK sender still waits for: a pure decision.

Under ACK recovery in the emulated wait mode a sender waits (at most the run's
``wait_s``) for the acknowledgement the seeded decision says comes back, before
its next copy (:mod:`zpipe.stage.executors.lossy_recovery`). A receiver that died but is
not yet declared dead by the coordinator never answers, so waiting for every one
of its acknowledgements stalls the sender ``wait_s`` per promised
acknowledgement (copies x passes) until the verdict.

So one overdue acknowledgement makes its receiver *silent*: the sender waits for
none of its acknowledgements until it is heard from again (an acknowledgement or
a partial of its arrives), and the coordinator's verdict (dead) ends the waiting
for good, as before. What this decides is only how long the sender waits, never
what it sends: the number of copies stays the seeded decision's
(:func:`zpipe.lossy.links.deliver_over`), so the simulation, which does not wait,
needs no counterpart, and a run whose live receivers answer within ``wait_s``
still equals its simulation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class AckWaitCounts:
    """One receiver's acknowledgements as its sender waited for them."""

    awaited: int = 0  # waits begun (heard in time, overdue, or cut by a verdict)
    overdue: int = 0  # waits that ended at wait_s without the acknowledgement
    unawaited: int = 0  # promised while the receiver was silent: not waited for
    heard_again: int = 0  # silences ended by hearing from the receiver

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class AckPatience:
    """Per receiver: whether to wait for its next promised acknowledgement, and the
    counts of what was decided (see the module docstring). Not thread-safe: its
    owner (:class:`zpipe.stage.executors.lossy_recovery.AckBook`) holds a lock around it."""

    def __init__(self) -> None:
        self._silent: set[int] = set()
        self.counts: dict[int, AckWaitCounts] = {}

    def _of(self, receiver: int) -> AckWaitCounts:
        return self.counts.setdefault(receiver, AckWaitCounts())

    def should_wait(self, receiver: int) -> bool:
        """A promised acknowledgement of ``receiver``'s is due: wait for it (True), or
        not, as the receiver has been silent since an overdue one (counted either way)."""
        counts = self._of(receiver)
        if receiver in self._silent:
            counts.unawaited += 1
            return False
        counts.awaited += 1
        return True

    def overdue(self, receiver: int) -> None:
        """An awaited acknowledgement did not come within ``wait_s``: the receiver is
        silent until heard from."""
        self._of(receiver).overdue += 1
        self._silent.add(receiver)

    def heard(self, device: int) -> None:
        """``device`` was heard from (an acknowledgement or a partial of its arrived)."""
        if device in self._silent:
            self._silent.discard(device)
            self._of(device).heard_again += 1

    def is_silent(self, receiver: int) -> bool:
        return receiver in self._silent

    def as_body(self) -> dict[str, dict[str, int]]:
        """The counts by receiver, as ``lossy_result``'s ``ack_waits`` carries them."""
        return {str(r): c.as_dict() for r, c in sorted(self.counts.items())}
