"""Where a recovery restores the weights from: the newest replica that still covers
every unit, each unit from its nearest holder; and what heavy recovery moves instead.

FTPipeHD (section III-E) runs two replications at once: chain replication (each
stage's state to the next stage, the last stage's to the coordinator) every
``chain_every`` mini-batches, and global replication (every stage's state to the
coordinator) every ``global_every``. Chain copies are newer and cheap and survive
any single failure; the global copy is older and survives any number. So a
recovery looks at the copies as :class:`ReplicaPoint` s, newest first:

- a chain point: each live device's own snapshot of its units, the backups its
  neighbours keep, and what the coordinator keeps at that mini-batch (the last
  stage's backup; every unit when a global copy was taken there too);
- a global point: every unit at the coordinator, at an older mini-batch.

:func:`plan_restore` takes the first point whose every unit still has a live
holder and fetches each unit from the nearest one
(:func:`~zpipe.recovery.redistribution.plan_redistribution`: a device's own copy,
then the nearest device's, then the coordinator's). Two adjacent stages failing
together lose one stage's snapshot with its backup (the other stage held it), so
the chain point fails and the global point serves, instead of the run failing.

:func:`heavy_restore` is the straw man Asteroid measures its lightweight recovery
against (section 3.4 and 5.6, "heavy rescheduling"): every unit is gathered at one
node (the coordinator), the plan is made from scratch, and every device of the new
plan receives all of its units from there. Lightweight recovery moves only the
units that change hands, between neighbours; both are plain lists of
:class:`~zpipe.recovery.redistribution.Transfer` so their bytes can be compared.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from zpipe._errors import ConfigError
from zpipe.recovery.errors import WeightsLostError
from zpipe.recovery.redistribution import (
    Redistribution,
    Replica,
    Transfer,
    own_replicas,
    plan_redistribution,
)
from zpipe.recovery.spans import COORDINATOR, PartitionLike, stage_spans


@dataclass(frozen=True)
class ReplicaPoint:
    """The copies of the model that exist at mini-batch ``version``.

    ``plan``: the partition they were taken under; ``copies``: what holders other
    than the units' own devices keep (backups at neighbours, the coordinator's);
    ``own_snapshots``: whether every live device of ``plan`` also kept a snapshot
    of its own units at ``version`` (chain replication does; a global copy alone
    leaves nothing at the stages).
    """

    version: int
    plan: PartitionLike
    copies: tuple[Replica, ...]
    own_snapshots: bool

    def holdings(self, failed: Collection[str]) -> list[Replica]:
        """Every live copy at this point: own snapshots and the others."""
        dead = set(failed)
        own = own_replicas(self.plan, self.version) if self.own_snapshots else []
        return [r for r in [*own, *self.copies] if r.holder not in dead]


@dataclass(frozen=True)
class Restore:
    """The point a recovery restores from (``index`` in the list given) and its fetches."""

    index: int
    point: ReplicaPoint
    moves: Redistribution


def plan_restore(
    new: PartitionLike, *, failed: Collection[str], points: Sequence[ReplicaPoint]
) -> Restore:
    """The newest of ``points`` (given newest first) from which every unit of ``new``
    can be restored, and the fewest fetches that do it, each from the nearest live
    holder. Raises :class:`WeightsLostError` (of the oldest point) when none can."""
    if not points:
        raise ConfigError("a restore needs at least one replica point")
    lost: WeightsLostError | None = None
    for index, point in enumerate(points):
        try:
            moves = plan_redistribution(
                point.plan,
                new,
                failed=failed,
                live_version=point.version,
                replicas=point.copies,
                version=point.version,
                own_copies=point.own_snapshots,
            )
        except WeightsLostError as exc:
            lost = exc
            continue
        return Restore(index, point, moves)
    assert lost is not None
    raise lost


@dataclass(frozen=True)
class HeavyMoves:
    """Asteroid's heavy rescheduling: ``gather`` brings every unit to the coordinator
    (from its nearest live holder; none for units the coordinator holds already),
    ``scatter`` sends every device of the new plan all of its units from there."""

    gather: tuple[Transfer, ...]
    scatter: tuple[Transfer, ...]

    @property
    def transfers(self) -> tuple[Transfer, ...]:
        return (*self.gather, *self.scatter)

    def bytes_moved(self, param_bytes: Sequence[int]) -> int:
        return sum(sum(param_bytes[t.start : t.end]) for t in self.transfers)


def heavy_restore(
    new: PartitionLike, *, failed: Collection[str], point: ReplicaPoint
) -> HeavyMoves:
    """What heavy recovery moves to restore ``new`` from ``point`` (see the module notes)."""
    spans = stage_spans(point.plan)
    num_units = spans[-1].end
    held = point.holdings(failed)
    at_coordinator = {u for r in held if r.holder == COORDINATOR for u in range(r.start, r.end)}
    gather: list[Transfer] = []
    lost: list[int] = []
    for u in range(num_units):
        if u in at_coordinator:
            continue
        # the unit's own device before a backup holder: the copy that is there anyway
        holders = [r.holder for r in held if r.start <= u < r.end]
        if not holders:
            lost.append(u)
            continue
        _append(gather, Transfer(COORDINATOR, holders[0], u, u + 1, point.version))
    if lost:
        raise WeightsLostError(lost, point.version)
    scatter = [
        Transfer(device, COORDINATOR, span.start, span.end, point.version)
        for span in stage_spans(new)
        for device in span.devices
    ]
    return HeavyMoves(tuple(gather), tuple(scatter))


def _append(out: list[Transfer], t: Transfer) -> None:
    last = out[-1] if out else None
    if last is not None and (last.source, last.end) == (t.source, t.start):
        out[-1] = Transfer(t.dest, t.source, last.start, t.end, t.version)
    else:
        out.append(t)
