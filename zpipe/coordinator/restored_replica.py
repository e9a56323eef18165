"""The replica a restarted coordinator takes over, with the global copy behind it.

Pure: the files' contents (:class:`~zpipe.coordinator.persistence.SavedReplica`)
in, the coordinator's :class:`~zpipe.coordinator.current_run.KeptReplica` out. Under chain
replication the latest replica holds here only the last stage's backup; its
``fallback`` is the newest global copy (``global.state``), which a recovery takes
when the chain copies of some unit all died (two adjacent stages). Without it a
coordinator restarted between two global copies could resume such a run only
from the stages' snapshots, and two adjacent deaths after the restart would lose
units the old coordinator still held.
"""

from __future__ import annotations

from zpipe._errors import ConfigError, StateFileError
from zpipe.coordinator.current_run import KeptReplica
from zpipe.coordinator.records import SavedReplica
from zpipe.planner.training_plan import TrainingPlan


def replica_from_saved(
    latest: SavedReplica, newest_global: SavedReplica | None = None
) -> KeptReplica:
    """``latest`` as the coordinator's replica; ``newest_global`` becomes its fallback
    when ``latest`` does not hold every unit itself and the copy fits it (the same
    model, not newer than it)."""
    replica = KeptReplica(
        latest.run,
        latest.step,
        _plan(latest, "replica"),
        latest.state,
        dict(latest.holders),
        global_copy=latest.global_copy,
    )
    if replica.complete or newest_global is None or not newest_global.complete:
        return replica
    plan = _plan(newest_global, "global copy")
    newer = newest_global.run == latest.run and newest_global.step > latest.step
    if plan.num_units != replica.plan.num_units or newer:
        return replica  # of another model, or not behind this replica: no fallback
    fallback = KeptReplica(
        newest_global.run,
        newest_global.step,
        plan,
        newest_global.state,
        dict(newest_global.holders),
        global_copy=True,
    )
    return KeptReplica(
        replica.run,
        replica.step,
        replica.plan,
        replica.state,
        replica.holders,
        fallback=fallback,
        global_copy=replica.global_copy,
    )


def _plan(saved: SavedReplica, what: str) -> TrainingPlan:
    try:
        return TrainingPlan.from_dict(saved.plan)
    except (ConfigError, KeyError, TypeError, ValueError) as exc:
        raise StateFileError(f"the saved {what}'s plan does not parse: {exc!r}") from exc


def fallback_named(replica: KeptReplica | None) -> dict[str, int] | None:
    """The fallback of ``replica`` as ``{run, step}`` (for a log line), or None."""
    behind = None if replica is None else replica.fallback
    return None if behind is None else {"run": behind.run, "step": behind.step}
