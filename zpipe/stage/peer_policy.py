"""Who may plant a backup on this stage or fetch units from it: pure decisions.

A stage's probe port admits every cluster member (with ``--keys``, every key the
coordinator named). Backups and unit fetches arrive there too, so an admitted
peer could plant snapshots under made-up owners until the stage's memory ran
out, and read back whatever was held. Each request is judged here, from the
request, the sender's identity (:class:`PeerIdentity`: the name its CURVE key
was allowed under) and what this stage's plan says (:class:`BackupPlan`):

- a backup is kept only for an owner the running training plan names as backing
  up here (``backup_from``), for that run, only from the owner itself when keys
  say who sent it, only of unit tensors, and only while everything held for
  peers stays within the device's budget (:func:`backup_refusal`);
- a fetch is answered only when the coordinator granted it (:class:`FetchGrant`,
  sent with ``link_peers`` before the new plan's assignments, and revoked by an
  empty one before the run's next backup replaces those snapshots): that device,
  that owner's snapshot, units within the granted range, of the newest run held
  here (:func:`fetch_refusal`).

Without keys nobody's name can be checked: the plan's owner list, the run, the
granted snapshots and ranges, the key shapes and the budget still hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from zpipe._errors import ProtocolError
from zpipe.models.registry import MAX_DECLARED_UNITS
from zpipe.models.weights import split_unit_key
from zpipe.stage.executors.training_shard import OPTIMIZER_KEY


@dataclass(frozen=True)
class PeerIdentity:
    """Who sent a request: ``authenticated`` when CURVE keys are in use; ``name`` the
    device the coordinator named for the sender's key (None: a key without a name)."""

    authenticated: bool
    name: str | None = None

    def describe(self) -> str:
        if not self.authenticated:
            return "an unauthenticated peer"
        return self.name or "an unnamed key"


UNAUTHENTICATED = PeerIdentity(False)


@dataclass(frozen=True)
class BackupPlan:
    """What this stage's running training plan says about backups (None: no run)."""

    run: int | None
    backup_from: tuple[str, ...] = ()


@dataclass(frozen=True)
class BackupOffer:
    owner: str
    run: int
    keys: tuple[str, ...]
    tensors: int
    nbytes: int


def is_state_key(key: str) -> bool:
    """``units.<i>.<name>`` or ``units.<i>.<name>#opt.<state>``, with a unit index in
    range: what a stage's training state holds, nothing else."""
    unit = split_unit_key(key.split(OPTIMIZER_KEY, 1)[0])
    return unit is not None and unit[0] < MAX_DECLARED_UNITS


def backup_refusal(
    offer: BackupOffer,
    sender: PeerIdentity,
    plan: BackupPlan,
    *,
    held_after_bytes: int,
    budget_bytes: int,
) -> str | None:
    """Why this backup is not kept here, or None to keep it.

    ``held_after_bytes``: what the stage would hold for peers with this backup kept
    (and the snapshot it replaces dropped); ``budget_bytes``: what it can hold.
    """
    if plan.run is None or plan.run != offer.run:
        return f"this stage is not training run {offer.run}"
    refusal = backup_owner_refusal(offer.owner, sender, plan)
    if refusal is not None:
        return refusal
    if len(offer.keys) != offer.tensors:
        return "keys and tensors do not match"
    strange = [k for k in offer.keys if not is_state_key(k)]
    if strange:
        return f"keys that are not unit state: {strange[:3]}"
    if held_after_bytes > budget_bytes:
        return (
            f"a backup of {offer.nbytes} bytes would make this stage hold {held_after_bytes} "
            f"bytes for peers, more than it can ({budget_bytes})"
        )
    return None


def backup_owner_refusal(owner: str, sender: PeerIdentity, plan: BackupPlan) -> str | None:
    """Why a backup of ``owner`` from ``sender`` is not kept, judged before its content
    is known (at chunk 0 of a chunked one, so no bytes are held for a backup that
    would be refused whole), or None."""
    if plan.run is None:
        return "this stage is not training"
    if owner not in plan.backup_from:
        named = ", ".join(plan.backup_from) or "nobody"
        return (
            f"{owner!r} does not back up to this stage in run {plan.run} (the plan names {named})"
        )
    if sender.authenticated and sender.name != owner:
        return f"a backup of {owner!r} sent by {sender.describe()}, not by its owner"
    return None


@dataclass(frozen=True)
class FetchRequest:
    owner: str
    run: int
    step: int
    start: int
    end: int


@dataclass(frozen=True)
class FetchGrant:
    """The coordinator's word that ``peer`` (the device the new plan assigns these
    units to) may fetch units ``[start, end)`` of ``owner``'s snapshot of ``run`` at
    ``step`` from this stage."""

    peer: str
    owner: str
    run: int
    step: int
    start: int
    end: int

    def covers(self, request: FetchRequest) -> bool:
        return (
            (self.owner, self.run, self.step) == (request.owner, request.run, request.step)
            and self.start <= request.start
            and request.end <= self.end
        )


def fetch_grants(entries: Sequence[Any]) -> tuple[FetchGrant, ...]:
    """The grants of a ``link_peers`` message's ``fetches`` list; ``ProtocolError``
    for an entry that is not a map of those fields."""
    out = []
    for entry in entries:
        if not isinstance(entry, dict):
            raise ProtocolError("a fetch grant must be a map")
        try:
            grant = FetchGrant(
                peer=str(entry["peer"]),
                owner=str(entry["owner"]),
                run=int(entry["run"]),
                step=int(entry["step"]),
                start=int(entry["start"]),
                end=int(entry["end"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"a malformed fetch grant: {exc!r}") from exc
        out.append(grant)
    return tuple(out)


def fetch_refusal(
    request: FetchRequest,
    sender: PeerIdentity,
    *,
    newest_run: int | None,
    grants: Sequence[FetchGrant] = (),
) -> str | None:
    """Why a fetch of units is not answered, or None to answer it (if the snapshot is
    held). ``newest_run``: the newest run of any snapshot held here; ``grants``: the
    fetches the coordinator said the new plan makes from here."""
    if sender.authenticated and sender.name is None:
        return "units are sent only to devices the coordinator named"
    if not 0 <= request.start < request.end <= MAX_DECLARED_UNITS:
        return f"unit range [{request.start}, {request.end}) is not a range of units"
    if newest_run is not None and request.run < newest_run:
        return f"snapshots of run {request.run} are no longer served (run {newest_run} is newer)"
    wanted = (
        f"units [{request.start}, {request.end}) of {request.owner!r} "
        f"(run {request.run}, step {request.step})"
    )
    covering = [g for g in grants if g.covers(request)]
    if not covering:
        return f"the coordinator did not name anyone to fetch {wanted} from this stage"
    if sender.authenticated and all(g.peer != sender.name for g in covering):
        named = ", ".join(sorted({g.peer for g in covering}))
        return f"{wanted} go to {named} in the current plan, not to {sender.describe()}"
    return None


def foreign_units(keys: Sequence[str], start: int, end: int) -> list[str]:
    """The keys of a ``units`` reply that are not state of units ``[start, end)``:
    what a fetching stage refuses to load."""
    out = []
    for key in keys:
        unit = split_unit_key(key.split(OPTIMIZER_KEY, 1)[0])
        if unit is None or not start <= unit[0] < end:
            out.append(key)
    return out
