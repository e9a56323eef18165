"""What a restarted coordinator takes over: the records it saves and restores. Pure.

The shell writes :func:`~zpipe.coordinator.saving.saved_state` to its state
directory on every change (:mod:`zpipe.coordinator.persistence`) and, at start,
hands what it read to
:func:`restore`: the members (alive until they stay silent past the usual
deadlines), the counters, the run (its controller, by its kind) and the replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zpipe._errors import ProtocolError, StateFileError
from zpipe.coordinator.current_run import Run
from zpipe.coordinator.notices import NoticeOutbox
from zpipe.coordinator.records import SavedReplica, SavedState
from zpipe.coordinator.restored_replica import replica_from_saved
from zpipe.coordinator.runs.async_copies import HeldCopy
from zpipe.coordinator.runs.async_training import AsyncTrainingController
from zpipe.coordinator.runs.inference import InferenceController
from zpipe.coordinator.runs.sync_training import SyncTrainingController
from zpipe.coordinator.state import ControlState
from zpipe.models import ModelSpec
from zpipe.planner.async_schedule import ASYNC_SCHEDULE
from zpipe.recovery.generation import GENERATION_ALGO


def restore(
    state: ControlState,
    saved: SavedState | None,
    replica: SavedReplica | None,
    now: float,
    newest_global: SavedReplica | None = None,
    copies: Sequence[HeldCopy] = (),
    notices: NoticeOutbox | None = None,
) -> None:
    """Take over the members, the run and the replica a previous coordinator saved
    (with ``newest_global`` behind it as its fallback: restored_replica.py), the
    copies asynchronous stages made without draining (runs/async_copies.py), and
    the run's notices the client had not acknowledged (into ``notices``).

    Restored members count as alive from now: one that does not speak within the
    usual suspect and probe intervals is declared dead as any other would be.
    """
    if saved is not None:
        state.epoch = max(state.epoch, saved.epoch)
        state.run_counter = max(state.run_counter, saved.run_counter)
        for m in saved.members:
            state.membership.register(
                name=m.name,
                routing_id=m.routing_id,
                data_endpoint=m.data_endpoint,
                info=m.info,
                public_key=m.public_key,
                now=now,
            )
            state.unconfirmed.add(m.name)
        if saved.run is not None:
            try:
                state.current = controller_for(state, Run.from_saved(saved.run))
            except (KeyError, TypeError, ValueError, ProtocolError) as exc:
                raise StateFileError(f"the saved run does not parse: {exc!r}") from exc
        if saved.notices is not None and notices is not None:
            notices.restore(saved.notices, now)
    state.async_copies.restore(copies)
    if replica is not None:
        state.replica = replica_from_saved(replica, newest_global)
        if isinstance(state.current, SyncTrainingController):
            state.current.fallback = state.replica.newest_global()


def controller_for(state: ControlState, run: Run) -> Any:
    """The controller of a run restored from disk, by its kind (None for a generation
    run: its stages go on, but a restarted coordinator does not know the client's
    request to re-plan it; a later death ends its stream at the client's deadline)."""
    if run.training_plan is not None and run.training_plan.schedule == ASYNC_SCHEDULE:
        # as the first coordinator ran it: replicas at flush points (a synchronous
        # controller would gather live weights, and leave the flushed stages paused)
        return AsyncTrainingController(state, run)
    if run.training_plan is not None or run.groups:
        return SyncTrainingController(state, run)
    if run.plan.algo == GENERATION_ALGO and run.request is None:
        return None
    assert run.request is not None
    return InferenceController(state, run, ModelSpec.from_dict(run.request.model))
