"""Who backs up which units to whom, and after which mini-batches: replication topologies.

Two topologies, both pure functions of a plan:

- ``asteroid`` (MobiCom '24, section 3.4, "topology-driven model
  replication"): a single-device stage backs its units up to a backup node in
  the next stage (that stage's first device), the last stage to the first
  stage. A multi-device stage sends nothing: its members hold the same
  weights, so a lost member is restored from a surviving one. A plan of one
  single-device stage has no other device to back up to, so it backs up to
  the coordinator.
- ``ftpipehd`` (section III-E): chain replication, each stage to the next
  stage and the last to the coordinator, every ``chain_every`` mini-batches;
  plus global replication, every stage to the coordinator, every
  ``global_every`` (FTPipeHD uses 50 and 100). Chain replication survives any
  single failure and spreads the load; the global replica survives any number
  of failures at the cost of the coordinator's link.

A group's members hold identical weights after the all-reduce, so one member
(the first) sends for its stage. A send is due after mini-batch ``m`` when
``m`` is a positive multiple of its period, and the copy it makes is version
``m``: the weights after ``m`` optimizer steps, the same numbering as a
stage's own ``live_version``. :meth:`ReplicationSchedule.replicas_after`
turns the schedule into the replica inventory that
:func:`~zpipe.recovery.redistribution.plan_redistribution` reads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zpipe._errors import ConfigError
from zpipe.recovery.redistribution import Replica
from zpipe.recovery.spans import COORDINATOR, PartitionLike, StageSpan, stage_spans

TOPOLOGIES = ("asteroid", "ftpipehd")
REPLICA_KINDS = ("backup", "chain", "global")

# FTPipeHD's periods (section IV): chain replication every 50 batches, global every 100.
FTPIPEHD_CHAIN_EVERY = 50
FTPIPEHD_GLOBAL_EVERY = 100

# Where a training run's replicas go: all to the coordinator (FTPipeHD's global
# replication), or kept at the stages and backed up to the next stage (FTPipeHD's
# chain; Asteroid's topology-driven replication, the last stage backing up to the first).
REPLICATIONS = ("global", "chain", "topology")


def _check_period(name: str, every: int) -> None:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(f"{name} must be a whole number of mini-batches >= 1, got {every!r}")


@dataclass(frozen=True)
class ReplicaSend:
    """``source`` sends units ``[start, end)`` to ``dest`` after every ``every``-th mini-batch."""

    kind: str
    source: str
    dest: str
    start: int
    end: int
    every: int

    def __post_init__(self) -> None:
        if self.kind not in REPLICA_KINDS:
            raise ConfigError(f"unknown replica kind {self.kind!r}; use one of {REPLICA_KINDS}")
        _check_period(f"the {self.kind} period", self.every)
        if not 0 <= self.start < self.end:
            raise ConfigError(
                f"a replica covers a non-empty unit range, got [{self.start}, {self.end})"
            )

    def due(self, minibatch: int) -> bool:
        """Whether the send happens once mini-batch ``minibatch`` (1-based) has been applied."""
        return minibatch > 0 and minibatch % self.every == 0

    def last_version(self, minibatch: int) -> int | None:
        """The newest copy this send has made by mini-batch ``minibatch``, if any."""
        v = minibatch - minibatch % self.every
        return v if v > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "source": self.source,
            "dest": self.dest,
            "start": self.start,
            "end": self.end,
            "every": self.every,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReplicaSend:
        try:
            return cls(
                str(data["kind"]),
                str(data["source"]),
                str(data["dest"]),
                int(data["start"]),
                int(data["end"]),
                int(data["every"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"malformed replica send: {exc}") from None


@dataclass(frozen=True)
class ReplicationSchedule:
    """Every periodic replica send of one plan; sent to the stages with the plan."""

    topology: str
    sends: tuple[ReplicaSend, ...]

    def sends_at(self, minibatch: int) -> list[ReplicaSend]:
        """The sends due once mini-batch ``minibatch`` has been applied."""
        return [s for s in self.sends if s.due(minibatch)]

    def duties_of(self, device: str) -> list[ReplicaSend]:
        """What ``device`` sends (the coordinator's duties are to receive)."""
        return [s for s in self.sends if s.source == device]

    def received_by(self, holder: str) -> list[ReplicaSend]:
        """What ``holder`` (a device or :data:`COORDINATOR`) receives and keeps."""
        return [s for s in self.sends if s.dest == holder]

    def replicas_after(self, minibatch: int, *, senders_keep_copy: bool = False) -> list[Replica]:
        """The replicas that exist once ``minibatch`` has been applied (newest per send).

        With ``senders_keep_copy`` a sender also keeps what it sent, at the same
        version: what ``exact`` consistency rolls a surviving stage back to
        without fetching its own units.
        """
        out: list[Replica] = []
        for s in self.sends:
            v = s.last_version(minibatch)
            if v is None:
                continue
            out.append(Replica(s.dest, s.start, s.end, v))
            if senders_keep_copy:
                out.append(Replica(s.source, s.start, s.end, v))
        return out

    def last_replicated(self, minibatch: int, *, to: str | None = None) -> int | None:
        """The newest mini-batch at which a replica of every unit exists (sent to ``to``).

        ``exact`` consistency rolls back to it. Each send keeps only its newest
        copy, so a unit exists at the versions of the sends covering it; the
        answer is the newest version common to every unit, ``None`` if there is none.
        """
        if not self.sends:
            return None
        num_units = max(s.end for s in self.sends)
        versions: list[set[int]] = [set() for _ in range(num_units)]
        for s in self.sends:
            v = s.last_version(minibatch)
            if v is not None and (to is None or s.dest == to):
                for u in range(s.start, s.end):
                    versions[u].add(v)
        common = set.intersection(*versions)
        return max(common) if common else None

    def to_dict(self) -> dict[str, Any]:
        return {"topology": self.topology, "sends": [s.to_dict() for s in self.sends]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReplicationSchedule:
        try:
            topology = str(data["topology"])
            sends = tuple(ReplicaSend.from_dict(s) for s in data["sends"])
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"malformed replication schedule: {exc}") from None
        if topology not in TOPOLOGIES:
            raise ConfigError(f"unknown replication topology {topology!r}; use one of {TOPOLOGIES}")
        return cls(topology, sends)


def asteroid_replication(
    plan: PartitionLike, *, every: int = FTPIPEHD_CHAIN_EVERY, global_every: int | None = None
) -> ReplicationSchedule:
    """Asteroid's topology-driven replication of ``plan``, every ``every`` mini-batches.

    It covers one failure per stage; a group that loses every member at once
    needs another copy, which Asteroid leaves to a complementary mechanism:
    ``global_every`` adds FTPipeHD's global replication to the coordinator.
    """
    _check_period("every", every)
    spans = stage_spans(plan)
    sends = []
    for i, span in enumerate(spans):
        if len(span.devices) > 1:
            continue  # restored from a surviving member of the group
        nxt = spans[(i + 1) % len(spans)]
        dest = nxt.devices[0] if nxt is not span else COORDINATOR
        sends.append(ReplicaSend("backup", span.devices[0], dest, span.start, span.end, every))
    if global_every is not None:
        sends.extend(_global_sends(spans, global_every))
    return ReplicationSchedule("asteroid", tuple(sends))


def _global_sends(spans: Sequence[StageSpan], every: int) -> list[ReplicaSend]:
    _check_period("global_every", every)
    return [ReplicaSend("global", s.devices[0], COORDINATOR, s.start, s.end, every) for s in spans]


def ftpipehd_replication(
    plan: PartitionLike,
    *,
    chain_every: int = FTPIPEHD_CHAIN_EVERY,
    global_every: int = FTPIPEHD_GLOBAL_EVERY,
) -> ReplicationSchedule:
    """FTPipeHD's chain replication plus global replication of ``plan``."""
    _check_period("chain_every", chain_every)
    spans = stage_spans(plan)
    sends = []
    for i, span in enumerate(spans):
        dest = spans[i + 1].devices[0] if i + 1 < len(spans) else COORDINATOR
        sends.append(ReplicaSend("chain", span.devices[0], dest, span.start, span.end, chain_every))
    sends.extend(_global_sends(spans, global_every))
    return ReplicationSchedule("ftpipehd", tuple(sends))


def plan_replication(
    plan: PartitionLike,
    topology: str,
    *,
    every: int = FTPIPEHD_CHAIN_EVERY,
    global_every: int | None = FTPIPEHD_GLOBAL_EVERY,
) -> ReplicationSchedule:
    """The schedule of ``topology``: ``every`` is Asteroid's period or FTPipeHD's chain period.

    ``global_every`` is FTPipeHD's global period (required there); for Asteroid
    it adds global replication, ``None`` leaves it out.
    """
    if topology == "asteroid":
        return asteroid_replication(plan, every=every, global_every=global_every)
    if topology == "ftpipehd":
        if global_every is None:
            raise ConfigError("ftpipehd replication needs a global_every period")
        return ftpipehd_replication(plan, chain_every=every, global_every=global_every)
    raise ConfigError(f"unknown replication topology {topology!r}; use one of {TOPOLOGIES}")


def replicas_due(
    step: int, *, chain_every: int | None, global_every: int | None
) -> tuple[bool, bool]:
    """Whether (chain, global) replication is due before mini-batch ``step`` (0-based,
    counted over the whole fit): every ``chain_every``-th and every ``global_every``-th
    mini-batch, both before the first one. ``None`` leaves a kind out."""
    if step < 0:
        raise ConfigError(f"a replica step must be >= 0, got {step}")
    for name, every in (("chain_every", chain_every), ("global_every", global_every)):
        if every is not None:
            _check_period(name, every)
    chain = chain_every is not None and step % chain_every == 0
    whole = global_every is not None and step % global_every == 0
    return chain, whole
