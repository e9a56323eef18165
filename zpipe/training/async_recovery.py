"""What an asynchronous run's recovery supports: one pure decision, for fit and the CLI.

An ``async-1f1b`` run with ``recover`` keeps global replicas at flush points and,
after a stage dies, resumes on the survivors with the staleness of the depth it
started with (:mod:`zpipe.coordinator.async_replicas`). That is exact only where
a weight version names the same weights whatever the stages are: vertical sync
on (every stage forwards a batch with the first stage's version) and no weight
aggregation (stage ``i`` averages ``n - i`` versions: its index would change).
"""

from __future__ import annotations

from zpipe.training.async_schedule import ASYNC_SCHEDULE


def async_recovery_refusal(
    *,
    vertical_sync: bool,
    aggregate: bool,
    consistency: str,
    rebalance: float | None,
    repartition: bool,
) -> str | None:
    """Why an asynchronous run with these settings cannot recover (None: it can)."""
    if not vertical_sync:
        return f"{ASYNC_SCHEDULE} recovers with vertical sync only (its versions move)"
    if aggregate:
        return f"{ASYNC_SCHEDULE} does not recover with weight aggregation yet"
    if consistency != "exact":
        return f"{ASYNC_SCHEDULE} recovers with exact consistency only, not {consistency!r}"
    if rebalance is not None:
        return f"{ASYNC_SCHEDULE} does not rebalance at replicas: use repartition (without recover)"
    if repartition:
        return f"{ASYNC_SCHEDULE} does not recover and re-partition in one run yet"
    return None
