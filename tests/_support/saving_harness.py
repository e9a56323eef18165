"""The coordinator harness with the shell's saves: each ``Persist`` writes the state
file (as :meth:`zpipe.coordinator.server.Coordinator._persist` does), and
:meth:`SavingHarness.restarted` is the coordinator a restart starts on that file."""

from __future__ import annotations

from tests._support.coordinator_harness import Harness
from zpipe.coordinator.commands import Command, Persist
from zpipe.coordinator.persistence import StateStore


class SavingHarness(Harness):
    def __init__(self, store: StateStore, **harness: object) -> None:
        super().__init__(**harness)  # type: ignore[arg-type]
        self.store = store
        self.state.saves_replicas = True
        self.saves = 0

    def _apply(self, commands: list[Command]) -> None:
        # the shell saves before the batch's sends go out (Coordinator._carry_out)
        if any(isinstance(c, Persist) for c in commands):
            self.store.save_state(self.core.saved_state())
            self.saves += 1
        super()._apply(commands)

    def restarted(self, **harness: object) -> SavingHarness:
        """A coordinator killed now and started again on the same state directory (the
        members, the run, the counters and the notices of the file; no replica)."""
        again = SavingHarness(self.store, **harness)
        again.core.restore(self.store.load_state(), self.store.load_replica(), again.now)
        return again
