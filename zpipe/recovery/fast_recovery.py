"""FTPipeHD's recovery of an asynchronous run (``consistency="fast"``, section III-F):
the decision, as one pure function over plain data.

What the paper does after workers die, and what :func:`plan_fast_recovery` returns:

- **The survivors keep their weights.** A survivor's units stay where they are,
  untouched, at the version it has applied (source ``"kept"``); nothing rolls back.
- **The dead stages' units come from the nearest copy** (:func:`freshest_copy`):
  the newest chain copy at a live holder (the next stage, the last stage's at the
  coordinator), else the newest global copy at the coordinator (a global copy
  newer than the last completed chain copy wins: see :func:`freshest_copy`). Two
  adjacent deaths lose the first one's chain copy with its holder, so its units
  come from the global copy. The ledger records a copy only once its transfer
  completed, so a copy a death interrupted is never chosen. No completed copy at
  a live holder (a death before the first chain copy reached the next stage: the
  first is made after ``chain_every`` mini-batches, and it is on its way a while
  after that): the unit's initial weights (source ``"initial"``, version 0), which
  the run's model spec and seed rebuild exactly at the new holder (no copy is
  made at mini-batch 0: the spec is that copy), as an exact rollback to a replica
  of mini-batch 0 would; the unit loses every mini-batch acknowledged so far, and
  the report says so.
- **The survivors are re-partitioned by eq. 5**
  (:func:`zpipe.planner.ftpipehd.ftpipehd_partition`) over their measured
  capacities and the links between the survivors that become neighbours, in the
  order they had (the paper's worker list with the dead removed); without
  measurements every capacity is 1 (the paper's fallback to eq. 7). A unit that
  changes survivor moves peer to peer from the survivor that holds it (source
  ``"peer"``); a restored unit is fetched from its copy's holder (``"chain"`` or
  ``"global"``; a survivor may load a chain copy it holds itself); a unit of no
  copy is built afresh by its new holder (``"initial"``: nothing travels).
- **The pipeline resumes at the first un-acknowledged mini-batch**: the id of the
  first mini-batch whose gradients did not come back to the client (FTPipeHD resets
  both committed ids to it on every node). Mini-batches forwarded past it are
  discarded and trained again.

That mixes versions, and FTPipeHD accepts it: a unit restored from a copy taken
after ``step`` mini-batches never receives the updates of the mini-batches from
``step`` up to the resume id (they are not replayed: the survivors applied them),
and a unit whose holder had applied updates past the resume id applies those
mini-batches a second time when they are replayed. The paper restores the copy
and resumes at the first un-acknowledged id anyway; so does this decision, and
its report says, per unit, how many mini-batches of progress it lost
(``resume_at - version`` when positive) and how many it will apply twice
(``version - resume_at`` when positive). Exact consistency (every stage back to
one replica, replayed) stays :mod:`zpipe.training.async_recovery`'s.

**A death during a live re-partition's move.** A move commits only after every
fetch completed (the coordinator's commit); until then each stage still holds,
and serves, the units of the committed partition. So the decision reads the
committed partition: a death before the commit abandons the move (its fetched
units are dropped, never a source), and the plan says so (``abandoned_move``).
A death during the commit is the one case where stages disagree: the survivors
that got the commit switched to the new cuts while the coordinator, missing the
dead stage's answer, still has the old ones. The survivors say what they hold
(``holding``, from their state); the decision keeps what each holds and restores
from copies every unit no survivor holds (the plan's ``switched`` names them). A
death after the commit sees the new partition as the committed one.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Any

from zpipe._errors import ConfigError
from zpipe.planner.ftpipehd import ftpipehd_partition
from zpipe.recovery.errors import RecoveryError
from zpipe.recovery.live_copies import CopyLedger, CopyRecord
from zpipe.recovery.spans import COORDINATOR, StageSpan, validate_spans

SOURCE_KINDS = ("kept", "peer", "chain", "global", "initial")
# the weight version of a unit built afresh from the model spec and seed
INITIAL_VERSION = 0


@dataclass(frozen=True)
class UnitSource:
    """Where unit ``unit`` of the new partition comes from: ``dest`` runs it, with the
    weights ``source`` holds (``kind``: kept by ``dest``, a survivor's ``peer`` move,
    a ``chain`` or ``global`` copy, or the ``initial`` weights ``dest`` builds from
    the model spec when no copy was left), after ``version`` mini-batches. ``lost``: the
    mini-batches of progress the unit misses (resuming past its version);
    ``reapplied``: the mini-batches it will apply a second time (its version was past
    the resume id). ``owner`` and ``run``: whose copy it is and of which run (what a
    holder files its copies under); for live weights (``kept``, ``peer``) the owner
    is ``source`` and ``run`` is None; for ``initial`` weights the owner is the stage
    whose committed units it was (the dead one, or a survivor that switched away from
    it mid-commit) and ``run`` is None."""

    unit: int
    dest: str
    kind: str
    source: str
    version: int
    lost: int
    reapplied: int
    owner: str = ""
    run: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in SOURCE_KINDS:
            raise ConfigError(f"unknown unit source {self.kind!r}; use one of {SOURCE_KINDS}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "unit": self.unit,
            "dest": self.dest,
            "kind": self.kind,
            "source": self.source,
            "version": self.version,
            "lost": self.lost,
            "reapplied": self.reapplied,
            "owner": self.owner,
            "run": self.run,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> UnitSource:
        try:
            return cls(
                unit=int(data["unit"]),
                dest=str(data["dest"]),
                kind=str(data["kind"]),
                source=str(data["source"]),
                version=int(data["version"]),
                lost=int(data["lost"]),
                reapplied=int(data["reapplied"]),
                owner=str(data.get("owner", "")),
                run=None if data.get("run") is None else int(data["run"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed unit source {dict(data)!r}: {exc}") from None


@dataclass(frozen=True)
class SourceRange:
    """Units ``[start, end)`` that ``dest`` gets from one source: ``kind``, ``source``
    (a stage or the coordinator), the copy's ``owner`` and ``run`` (None: live
    weights), after ``version`` mini-batches."""

    dest: str
    kind: str
    source: str
    owner: str
    run: int | None
    version: int
    start: int
    end: int

    @property
    def key(self) -> tuple[str, str, str, int | None, int]:
        return (self.kind, self.source, self.owner, self.run, self.version)

    @property
    def local(self) -> bool:
        """Nothing travels: ``dest`` keeps these units or loads a copy it holds."""
        return self.source == self.dest


@dataclass(frozen=True)
class FastRecoveryPlan:
    """What a fast-consistency recovery does: the survivors' new partition (``order``,
    one device per stage, over ``bounds``), every unit's source, and the mini-batch
    id to resume at. Plain data: sent to the stages, logged as the report."""

    order: tuple[str, ...]
    bounds: tuple[int, ...]
    period_s: float  # eq. 5's predicted period of the new partition
    sources: tuple[UnitSource, ...]  # one per unit, by unit
    resume_at: int
    dead: tuple[str, ...]
    abandoned_move: bool = False
    # survivors that had switched to a move's cuts the coordinator had not committed
    # (a death during the move's commit): the plan starts from what they hold
    switched: tuple[str, ...] = ()
    # eq. 5's inputs as the report gives them: which capacities and links cut the
    # survivors, and from where (zpipe.recovery.fast_recovery_inputs)
    inputs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def spans(self) -> tuple[StageSpan, ...]:
        return tuple(
            StageSpan((d,), a, b)
            for d, (a, b) in zip(self.order, pairwise(self.bounds), strict=True)
        )

    def sources_of(self, dest: str) -> list[UnitSource]:
        """What ``dest`` runs after the recovery, by unit."""
        return [s for s in self.sources if s.dest == dest]

    def ranges_of(self, dest: str) -> list[SourceRange]:
        """What ``dest`` runs, as ranges of consecutive units with one source: what
        the shell turns into a stage's fetch entries (a ``kept`` range, and a chain
        copy ``dest`` holds itself, load locally; the others travel)."""
        out: list[SourceRange] = []
        for s in self.sources_of(dest):
            key = (s.kind, s.source, s.owner, s.run, s.version)
            last = out[-1] if out else None
            if last is not None and last.end == s.unit and last.key == key:
                out[-1] = replace(last, end=s.unit + 1)
            else:
                out.append(
                    SourceRange(
                        dest, s.kind, s.source, s.owner, s.run, s.version, s.unit, s.unit + 1
                    )
                )
        return out

    def fetches(self) -> list[UnitSource]:
        """The units that travel (every source but ``kept``, ``initial`` and a chain
        copy a stage loads from itself)."""
        return [s for s in self.sources if s.kind != "kept" and s.source != s.dest]

    @property
    def initial_units(self) -> list[int]:
        """The units no copy was left of, built afresh from the model spec."""
        return [s.unit for s in self.sources if s.kind == "initial"]

    @property
    def lost_per_unit(self) -> dict[int, int]:
        return {s.unit: s.lost for s in self.sources}

    @property
    def max_lost(self) -> int:
        """The report's headline: the most mini-batches of progress any unit lost."""
        return max((s.lost for s in self.sources), default=0)

    def copies_used(self) -> dict[str, list[int]]:
        """Which copy each restored unit came from: ``"chain@holder"``, ``"global"`` or
        ``"initial"`` (no copy: the initial weights) -> its units."""
        used: dict[str, list[int]] = {}
        for s in self.sources:
            if s.kind in ("chain", "global", "initial"):
                key = f"chain@{s.source}" if s.kind == "chain" else s.kind
                used.setdefault(key, []).append(s.unit)
        return used

    def summary(self) -> dict[str, Any]:
        """The report, for the log line and the run's report: where the run resumes,
        the progress each unit lost (and re-applies), which copy each restored unit
        came from, and how many units travel."""
        return {
            "dead": list(self.dead),
            "order": list(self.order),
            "bounds": list(self.bounds),
            "resume_at": self.resume_at,
            "max_lost": self.max_lost,
            "lost": {str(u): n for u, n in self.lost_per_unit.items() if n},
            "reapplied": {str(s.unit): s.reapplied for s in self.sources if s.reapplied},
            "copies_used": self.copies_used(),
            "units_moved": len(self.fetches()),
            "abandoned_move": self.abandoned_move,
            "switched": list(self.switched),
            "eq5": dict(self.inputs),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "order": list(self.order),
            "bounds": list(self.bounds),
            "period_s": self.period_s,
            "sources": [s.to_dict() for s in self.sources],
            "resume_at": self.resume_at,
            "dead": list(self.dead),
            "abandoned_move": self.abandoned_move,
            "switched": list(self.switched),
            "inputs": dict(self.inputs),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FastRecoveryPlan:
        try:
            return cls(
                order=tuple(str(d) for d in data["order"]),
                bounds=tuple(int(b) for b in data["bounds"]),
                period_s=float(data["period_s"]),
                sources=tuple(UnitSource.from_dict(s) for s in data["sources"]),
                resume_at=int(data["resume_at"]),
                dead=tuple(str(d) for d in data["dead"]),
                abandoned_move=bool(data.get("abandoned_move", False)),
                switched=tuple(str(d) for d in data.get("switched") or ()),
                inputs=dict(data.get("inputs") or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed fast recovery plan: {exc}") from None


def plan_fast_recovery(
    spans: Sequence[StageSpan],
    dead: Collection[str],
    *,
    ledger: CopyLedger,
    updates: Mapping[str, int],
    acknowledged: int,
    reference_unit_s: Sequence[float],
    capacities: Mapping[str, float] | None = None,
    output_bytes: Sequence[float] | None = None,
    bandwidths_bps: Mapping[tuple[str, str], float] | None = None,
    fixed_s: Mapping[str, float] | None = None,
    move_pending: bool = False,
    holding: Mapping[str, tuple[int, int]] | None = None,
) -> FastRecoveryPlan:
    """FTPipeHD's recovery of an asynchronous run after the stages ``dead`` died.

    ``spans``: the committed partition (one device per stage; a move not yet
    committed is not in it, ``move_pending`` says one was under way). ``ledger``:
    the completed copies. ``updates``: each survivor's update count (the
    mini-batches it has applied, its weight version). ``acknowledged``: how many
    mini-batches the client has acknowledged (ids ``0 .. acknowledged - 1``; the
    first un-acknowledged id is where the run resumes). ``reference_unit_s``,
    ``capacities`` (``C_i`` of every survivor, or None for all 1),
    ``output_bytes`` (``D_j``) and ``bandwidths_bps`` (``(a, b)`` -> bytes per
    second, for every pair of survivors that will be neighbours; a pair given in
    either direction serves both) and ``fixed_s`` (``F_i``, a survivor's own
    seconds per batch whatever its units; absent: 0): eq. 5's inputs, as
    :func:`zpipe.training.repartition.decide_repartition` takes them.
    ``holding``: the units each survivor says it holds (absent: its committed ones);
    a survivor that switched to a move's cuts before a death stopped the commit
    elsewhere holds other units than the committed partition says, and every unit
    no survivor holds is restored from its copy (the plan's ``switched``), or, with
    no copy left, from the initial weights (``initial``, version 0). Raises
    :class:`~zpipe.recovery.errors.RecoveryError` when no stage survives, and
    :class:`~zpipe._errors.ConfigError` on malformed input.
    """
    num_units = validate_spans(spans)
    for s in spans:
        if len(s.devices) != 1:
            raise ConfigError(
                f"an asynchronous run has one device per stage, not {list(s.devices)}"
            )
    order = [s.devices[0] for s in spans]
    gone = set(dead)
    unknown = sorted(gone - set(order))
    if unknown:
        raise ConfigError(f"{unknown} died but are not stages of {order}")
    if not gone:
        raise ConfigError("a recovery needs at least one dead stage")
    survivors = [d for d in order if d not in gone]
    if not survivors:
        raise RecoveryError(f"every stage died ({order}): nothing to resume on")
    if len(reference_unit_s) != num_units:
        raise ConfigError(
            f"reference_unit_s needs one entry per unit ({num_units}), got {len(reference_unit_s)}"
        )
    if isinstance(acknowledged, bool) or not isinstance(acknowledged, int) or acknowledged < 0:
        raise ConfigError(
            f"acknowledged must be a count of mini-batches >= 0, got {acknowledged!r}"
        )
    missing = [d for d in survivors if d not in updates]
    if missing:
        raise ConfigError(f"no update count from the survivors {missing}")
    for d in survivors:
        n = updates[d]
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"{d!r}: an update count is a whole number >= 0, got {n!r}")

    # Who holds each unit alive: a survivor its committed units, unless it says it
    # switched to a move's cuts (a death mid-commit); a unit two survivors hold
    # (one switched, one not: both at the move's version) stays with its committed one.
    committed = {d: (s.start, s.end) for s in spans for d in s.devices}
    switched = _switched(committed, survivors, holding, num_units)
    actual = {d: switched.get(d, committed[d]) for d in survivors}
    holder_of: dict[int, str] = {}
    for d in survivors:
        for u in range(*committed[d]):
            if actual[d][0] <= u < actual[d][1]:
                holder_of[u] = d
    for d in survivors:
        for u in range(*actual[d]):
            holder_of.setdefault(u, d)

    # The units no survivor holds (the dead stages'), each from its nearest completed
    # copy; with none (a death before the first copy landed), its initial weights.
    restored: dict[int, CopyRecord] = {}
    initial: dict[int, str] = {}  # unit -> the stage whose committed unit it was
    for u in range(num_units):
        if u in holder_of:
            continue
        copy = freshest_copy(ledger, u, survivors)
        if copy is None:
            initial[u] = next(d for d, (a, b) in committed.items() if a <= u < b)
        else:
            restored[u] = copy

    # Eq. 5 over the survivors, in their order.
    if capacities is None:
        caps = None
    else:
        absent = [d for d in survivors if d not in capacities]
        if absent:
            raise ConfigError(f"no measured capacity for the survivors {absent}")
        caps = [capacities[d] for d in survivors]
    links = None
    if bandwidths_bps is not None:
        links = [_bandwidth(bandwidths_bps, a, b) for a, b in pairwise(survivors)]
    own = None if fixed_s is None else [float(fixed_s.get(d, 0.0)) for d in survivors]
    # every stage had a unit, so the survivors are never more than the units
    cut = ftpipehd_partition(
        reference_unit_s,
        capacities=caps,
        num_stages=len(survivors),
        output_bytes=output_bytes,
        bandwidths_bps=links,
        fixed_s=own,
    )

    sources: list[UnitSource] = []
    for dest, (a, b) in zip(survivors, pairwise(cut.bounds), strict=True):
        for u in range(a, b):
            copy = restored.get(u)
            if copy is not None:
                kind, source, version = copy.kind, copy.holder, copy.step
                owner, run = copy.owner, copy.run
            elif u in initial:
                # built afresh where it will run: nothing travels
                kind, source, version = "initial", dest, INITIAL_VERSION
                owner, run = initial[u], None
            else:
                source = holder_of[u]
                kind = "kept" if source == dest else "peer"
                version = updates[source]
                owner, run = source, None
            sources.append(
                UnitSource(
                    unit=u,
                    dest=dest,
                    kind=kind,
                    source=source,
                    version=version,
                    lost=max(0, acknowledged - version),
                    reapplied=max(0, version - acknowledged),
                    owner=owner,
                    run=run,
                )
            )
    return FastRecoveryPlan(
        order=tuple(survivors),
        bounds=cut.bounds,
        period_s=cut.period_s,
        sources=tuple(sources),
        resume_at=acknowledged,
        dead=tuple(d for d in order if d in gone),
        abandoned_move=move_pending,
        switched=tuple(d for d in survivors if d in switched),
    )


def _switched(
    committed: Mapping[str, tuple[int, int]],
    survivors: Sequence[str],
    holding: Mapping[str, tuple[int, int]] | None,
    num_units: int,
) -> dict[str, tuple[int, int]]:
    """The survivors whose units, as they say (``holding``), are not their committed
    ones, with what they hold; ConfigError on a range that is not units of the model."""
    out: dict[str, tuple[int, int]] = {}
    for d in survivors:
        if holding is None or d not in holding:
            continue
        try:
            a, b = (int(x) for x in holding[d])
        except (TypeError, ValueError):
            raise ConfigError(f"{d!r} holds {holding[d]!r}, not a range of units") from None
        if not 0 <= a < b <= num_units:
            raise ConfigError(f"{d!r} holds units [{a}, {b}), not a range of the {num_units}")
        if (a, b) != committed[d]:
            out[d] = (a, b)
    return out


def freshest_copy(ledger: CopyLedger, unit: int, alive: Collection[str]) -> CopyRecord | None:
    """The completed copy ``unit`` is restored from: the newest of those at a live holder
    (or the coordinator), a chain copy before a global one of the same mini-batch.

    With FTPipeHD's periods (chain every 50, global every 100) this is
    :meth:`CopyLedger.nearest`'s chain-first rule. They differ only when a chain copy
    was interrupted (its holder died, or the owner, mid-transfer) after the global copy
    of the same step completed: the ledger then still has the previous chain copy,
    and restoring it would lose ``chain_every`` more mini-batches than the global one.
    """
    live = set(alive) | {COORDINATOR}
    found = [c for c in ledger.copies.values() if c.covers(unit) and c.holder in live]
    if not found:
        return None
    return max(found, key=lambda c: (c.run, c.step, c.kind == "chain"))


def _bandwidth(bandwidths: Mapping[tuple[str, str], float], a: str, b: str) -> float:
    """The bandwidth between neighbours ``a`` and ``b`` (either direction's entry)."""
    for key in ((a, b), (b, a)):
        if key in bandwidths:
            return float(bandwidths[key])
    raise ConfigError(
        f"no bandwidth between {a!r} and {b!r}, who become neighbours: measure the link "
        "(or leave bandwidths_bps out for free links)"
    )


__all__ = [
    "INITIAL_VERSION",
    "SOURCE_KINDS",
    "FastRecoveryPlan",
    "SourceRange",
    "UnitSource",
    "freshest_copy",
    "plan_fast_recovery",
]
