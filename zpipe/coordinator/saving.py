"""What the coordinator saves of its state: plain records, built without torch.

Apart from :mod:`~zpipe.coordinator.takeover` (which restores runs, and so imports
the run kinds and torch): a coordinator with ``--state-dir`` saves its members from
the first registration on, long before any run (run_kinds.py).
"""

from __future__ import annotations

from zpipe.coordinator.notices import NoticeOutbox
from zpipe.coordinator.records import SavedMember, SavedState
from zpipe.coordinator.state import ControlState

__all__ = ["saved_state"]


def saved_state(state: ControlState, notices: NoticeOutbox | None = None) -> SavedState:
    """The live members, the counters and the current run (with its notices the
    client has not acknowledged), as plain records.

    A run being re-planned is saved as it was (:meth:`Run.begin_change`), with the
    members it had that died since: restored as members, they stay silent and are
    declared dead again, and the restarted coordinator re-plans the run itself (the
    new plan was only assigned; nobody would tell its stages to connect)."""
    run = None if state.current is None else state.current.run
    saved_run = None if run is None else run.saved()
    alive = state.membership.alive()
    if run is not None and run.changing and saved_run is not None:
        names = {m.name for m in alive}
        devices = set(saved_run["devices"])
        alive += [m for m in state.membership.all() if m.name in devices - names]
    members = tuple(
        SavedMember(m.name, m.routing_id, m.data_endpoint, m.info, m.public_key) for m in alive
    )
    return SavedState(
        state.epoch,
        state.run_counter,
        members,
        saved_run,
        notices=None if notices is None or run is None else notices.saved(run.run),
    )
