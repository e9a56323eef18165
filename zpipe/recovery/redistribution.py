"""Weight redistribution after a re-partition: who fetches which units from whom.

FTPipeHD (section III-F, Algorithm 1) has each worker compare its new range
with its current one: units it already has stay local, the others are fetched
from the worker that held them (its chain replica's holder when that worker
failed, the central node when the last one did). Here the same decision is
made for every device of the new plan at once, from an explicit inventory of
who holds what, so that it also covers multiple failures, device groups and
global replicas without the paper's index arithmetic:

- every live device of the old plan holds its own units at ``live_version``
  (the mini-batches it has applied);
- :class:`Replica` entries add what else exists: chain or backup replicas on
  another stage's device, global replicas at :data:`COORDINATOR`, each at the
  mini-batch it was taken after;
- failed devices hold nothing; the coordinator never fails (FTPipeHD's
  assumption; it persists its replicas).

For each unit a device of the new plan runs, the wanted version is the newest
any live holder has (``fast`` consistency: survivors keep their newer weights)
or a given one (``exact``: everything rolls back to the last replicated
mini-batch). The device keeps the unit if it holds that version; otherwise it
fetches it once, from the best live holder of that version: another device
before the coordinator (whose link every recovering stage shares), and among
devices the one nearest in the new pipeline, since adjacent stages are what
lightweight re-planning moves units between. That is the least number of unit
transfers possible, and nothing a device holds at the wanted version moves.
Consecutive units from one holder travel as one :class:`Transfer`.

As in FTPipeHD, a device builds its new sub-model only after the
coordinator's commit, because it may still have to serve its old units
(:meth:`Redistribution.serves_of`) to others until everyone has fetched.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zpipe._errors import ConfigError
from zpipe.recovery.errors import WeightsLostError
from zpipe.recovery.spans import (
    COORDINATOR,
    PartitionLike,
    device_stage,
    stage_spans,
)


@dataclass(frozen=True)
class Replica:
    """``holder`` has the weights of units ``[start, end)`` as of mini-batch ``version``."""

    holder: str
    start: int
    end: int
    version: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "holder": self.holder,
            "start": self.start,
            "end": self.end,
            "version": self.version,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Replica:
        try:
            return cls(
                str(data["holder"]), int(data["start"]), int(data["end"]), int(data["version"])
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed replica: {exc}") from None


@dataclass(frozen=True)
class Transfer:
    """``dest`` fetches units ``[start, end)`` at mini-batch ``version`` from ``source``."""

    dest: str
    source: str
    start: int
    end: int
    version: int

    @property
    def num_units(self) -> int:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        return {
            "dest": self.dest,
            "source": self.source,
            "start": self.start,
            "end": self.end,
            "version": self.version,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Transfer:
        try:
            return cls(
                str(data["dest"]),
                str(data["source"]),
                int(data["start"]),
                int(data["end"]),
                int(data["version"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed transfer: {exc}") from None


@dataclass(frozen=True)
class Kept:
    """``device`` already holds units ``[start, end)`` at ``version`` and keeps them."""

    device: str
    start: int
    end: int
    version: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "start": self.start,
            "end": self.end,
            "version": self.version,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Kept:
        try:
            return cls(
                str(data["device"]), int(data["start"]), int(data["end"]), int(data["version"])
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed kept range: {exc}") from None


@dataclass(frozen=True)
class Redistribution:
    """Every fetch the new plan needs, and what each device keeps; sent with the new plan."""

    transfers: tuple[Transfer, ...]
    kept: tuple[Kept, ...]

    @property
    def units_moved(self) -> int:
        """Unit copies sent over the network (the quantity the plan minimises)."""
        return sum(t.num_units for t in self.transfers)

    def bytes_moved(self, param_bytes: Sequence[int]) -> int:
        """Weight bytes sent, from each unit's size (``ModelProfile.param_bytes()``)."""
        return sum(sum(param_bytes[t.start : t.end]) for t in self.transfers)

    def fetches_of(self, device: str) -> list[Transfer]:
        """What ``device`` fetches (Algorithm 1's ``M_need``), by unit."""
        return sorted((t for t in self.transfers if t.dest == device), key=lambda t: t.start)

    def serves_of(self, holder: str) -> list[Transfer]:
        """What ``holder`` must keep serving until the commit, by destination and unit."""
        return sorted(
            (t for t in self.transfers if t.source == holder), key=lambda t: (t.dest, t.start)
        )

    def kept_of(self, device: str) -> list[Kept]:
        """What ``device`` keeps locally (Algorithm 1's ``L_local``)."""
        return sorted((k for k in self.kept if k.device == device), key=lambda k: k.start)

    def to_dict(self) -> dict[str, Any]:
        return {
            "transfers": [t.to_dict() for t in self.transfers],
            "kept": [k.to_dict() for k in self.kept],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Redistribution:
        try:
            return cls(
                tuple(Transfer.from_dict(t) for t in data["transfers"]),
                tuple(Kept.from_dict(k) for k in data["kept"]),
            )
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"malformed redistribution: {exc}") from None


def own_replicas(old: PartitionLike, live_version: int) -> list[Replica]:
    """What every device of ``old`` holds of its own: its units at ``live_version``."""
    return [Replica(d, s.start, s.end, live_version) for s in stage_spans(old) for d in s.devices]


def plan_redistribution(
    old: PartitionLike,
    new: PartitionLike,
    *,
    failed: Collection[str],
    live_version: int,
    replicas: Sequence[Replica] = (),
    version: int | None = None,
    own_copies: bool = True,
) -> Redistribution:
    """The fewest unit transfers that give every device of ``new`` its units.

    ``old``: the partition before (its live devices hold their units at
    ``live_version``). ``replicas``: every other copy (chain, backup and global
    replicas; the coordinator's under :data:`COORDINATOR`). ``version``: the
    mini-batch every unit must be at (``exact`` consistency), or ``None`` for
    the newest version any live holder has (``fast``). ``own_copies=False``:
    the devices of ``old`` hold nothing of their own at ``live_version`` (a
    global replica older than their snapshots), only ``replicas`` count. Raises
    :class:`WeightsLostError` naming the units no live holder has.
    """
    old_spans, new_spans = stage_spans(old), stage_spans(new)
    num_units = old_spans[-1].end
    if new_spans[-1].end != num_units:
        raise ConfigError(
            f"the old partition covers {num_units} units but the new one {new_spans[-1].end}"
        )
    dead = set(failed)
    for s in new_spans:
        for d in s.devices:
            if d in dead:
                raise ConfigError(f"the new partition uses device {d!r}, which failed")

    # holders[u]: version -> live holders of unit u at that version.
    holders: list[dict[int, set[str]]] = [{} for _ in range(num_units)]
    own = own_replicas(old_spans, live_version) if own_copies else []
    for r in [*own, *replicas]:
        if not 0 <= r.start < r.end <= num_units:
            raise ConfigError(
                f"replica on {r.holder!r} covers [{r.start}, {r.end}), outside the model's "
                f"{num_units} units"
            )
        if r.holder in dead:
            continue
        for u in range(r.start, r.end):
            holders[u].setdefault(r.version, set()).add(r.holder)

    wanted: list[int | None] = []
    for u in range(num_units):
        if version is not None:
            wanted.append(version if version in holders[u] else None)
        else:
            wanted.append(max(holders[u]) if holders[u] else None)
    lost = [u for u in range(num_units) if wanted[u] is None]
    if lost:
        raise WeightsLostError(lost, version)

    stage_new = device_stage(new_spans)
    stage_old = device_stage(old_spans)

    def rank(dest: str, holder: str) -> tuple[int, int, str]:
        if holder == COORDINATOR:
            return (1, 0, holder)
        where = stage_new.get(holder, stage_old.get(holder))
        distance = abs(where - stage_new[dest]) if where is not None else num_units + 1
        return (0, distance, holder)

    transfers: list[Transfer] = []
    kept: list[Kept] = []
    for span in new_spans:
        for dest in span.devices:
            for u in range(span.start, span.end):
                v = wanted[u]
                assert v is not None
                live = holders[u][v]
                if dest in live:
                    _append_kept(kept, Kept(dest, u, u + 1, v))
                else:
                    source = min(live, key=lambda h: rank(dest, h))
                    _append_transfer(transfers, Transfer(dest, source, u, u + 1, v))
    return Redistribution(tuple(transfers), tuple(kept))


def _append_transfer(out: list[Transfer], t: Transfer) -> None:
    last = out[-1] if out else None
    if last is not None and (last.dest, last.source, last.version, last.end) == (
        t.dest,
        t.source,
        t.version,
        t.start,
    ):
        out[-1] = Transfer(t.dest, t.source, last.start, t.end, t.version)
    else:
        out.append(t)


def _append_kept(out: list[Kept], k: Kept) -> None:
    last = out[-1] if out else None
    if last is not None and (last.device, last.version, last.end) == (k.device, k.version, k.start):
        out[-1] = Kept(k.device, last.start, k.end, k.version)
    else:
        out.append(k)
