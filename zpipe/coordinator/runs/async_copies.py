"""The copies an asynchronous run's stages make without draining, as the coordinator
holds them (FTPipeHD III-E; :mod:`zpipe.recovery.live_copies`).

A stage sends, unasked, an ``async_copy`` on its bulk connection: a global copy of
its units (every ``global_every`` mini-batches), or the last stage's chain copy
(every ``chain_every``). A chain copy another stage keeps is announced with the
same message without tensors (``holder``: that stage), by its owner once the
holder acknowledged the last chunk, and by the holder itself once it kept the
whole copy (``name``: the owner, sent by the holder): the owner may die between
the holder's acknowledgement and its own notice, and the copy the holder keeps
is the one a recovery of that death needs (:func:`holder_notice`). The second
notice of the same copy changes nothing. Each is checked against
the running plan (the sender's units, the kind, the digest of the bytes), then
kept: the tensors here (the newest of each stage and kind), its record in the
:class:`~zpipe.recovery.live_copies.CopyLedger` a recovery queries, and, with a
state directory, on disk (:class:`SaveCopy`, one file per stage and kind), so a
restarted coordinator holds them again (:mod:`zpipe.coordinator.takeover`).

Pure: events in, commands out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zpipe._errors import ProtocolError, StateFileError
from zpipe.coordinator.commands import Command, Log, ShellJob
from zpipe.coordinator.flows import Flow
from zpipe.protocol.stage_control import AsyncCopy
from zpipe.recovery.live_copies import COPY_KINDS, CopyLedger, CopyRecord, state_digest
from zpipe.recovery.spans import COORDINATOR

if TYPE_CHECKING:
    import torch

    from zpipe.coordinator.state import ControlState


@dataclass(frozen=True)
class HeldCopy:
    """A copy's record and, when the coordinator holds it, its tensors."""

    record: CopyRecord
    state: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class SaveCopy(ShellJob):
    """Write ``copy`` to the state directory (replacing the older one of its stage
    and kind); returns the file's size."""

    copy: HeldCopy


@dataclass
class HeldCopies:
    """The newest copy of each (stage, kind): the ledger, and the tensors held here."""

    ledger: CopyLedger = field(default_factory=CopyLedger)
    states: dict[tuple[str, str], dict[str, torch.Tensor]] = field(default_factory=dict)

    def keep(self, copy: HeldCopy) -> bool:
        """Keep ``copy`` unless a newer one of its stage and kind is known."""
        record = copy.record
        if not self.ledger.record(record):
            return False
        key = (record.owner, record.kind)
        if record.holder == COORDINATOR:
            self.states[key] = copy.state
        else:
            self.states.pop(key, None)  # held at a stage now, not here
        return True

    def state_of(self, owner: str, kind: str) -> dict[str, torch.Tensor] | None:
        """The tensors of ``owner``'s newest ``kind`` copy, if they are here."""
        return self.states.get((owner, kind))

    def restore(self, copies: Iterable[HeldCopy]) -> None:
        for copy in copies:
            self.keep(copy)

    def summary(self) -> list[dict[str, Any]]:
        """What the ledger holds, for a log line."""
        return [
            {"owner": c.owner, "kind": c.kind, "holder": c.holder, "step": c.step}
            for c in self.ledger.copies.values()
        ]


def keep_async_copy(
    state: ControlState, stage: str, message: AsyncCopy, now: float
) -> list[Command]:
    """A stage's ``async_copy``: checked, kept, saved (see the module notes)."""
    current = state.current
    run = None if current is None else current.run
    if run is None or run.run != message.run or run.training_plan is None:
        return [Log("debug", "late_reply", {"stage": stage, "kind": message.KIND})]
    try:
        copy = _checked(stage, message, run.devices, run.training_plan)
    except ProtocolError as exc:
        return [Log("warning", "dropped_message", {"peer": stage, "error": str(exc)})]
    record = copy.record
    known = state.async_copies.ledger.newest(record.owner, record.kind)
    if known is not None and _same_copy(known, record):
        # the owner's and the holder's notices of one copy: the second says nothing new,
        # unless the bytes the holder hashed are not those the owner sent
        fields = {"stage": stage, "owner": record.owner, "step": record.step}
        if known.digest and record.digest and known.digest != record.digest:
            return [Log("warning", "async_copy_digests_differ",
                        {**fields, "digests": [known.digest, record.digest]})]  # fmt: skip
        return [Log("debug", "async_copy_known", fields)]
    if not state.async_copies.keep(copy):
        return [Log("debug", "async_copy_stale", {"stage": stage, "step": record.step})]
    out: list[Command] = [
        Log(
            "info",
            "async_copy_kept",
            {
                "run": record.run,
                "owner": record.owner,
                "kind": record.kind,
                "holder": record.holder,
                "step": record.step,
                "bytes": record.nbytes,
                "digest": record.digest,
                # who told: the owner, or the holder (holder_notice)
                "from": stage,
            },
        )
    ]
    if state.saves_replicas:
        out += state.flows.start(_save(state.async_copies, copy), now)
    return out


def _same_copy(a: CopyRecord, b: CopyRecord) -> bool:
    return (a.owner, a.kind, a.holder, a.run, a.step) == (b.owner, b.kind, b.holder, b.run, b.step)


def holder_notice(stage: str, message: AsyncCopy, devices: list[str]) -> bool:
    """Whether ``message`` is a holder's notice of a chain copy it keeps (see the module
    notes): sent by ``stage``, the next stage after the owner it names, which it
    names as the holder, without tensors. Its range is the units of the keys it
    received, which may leave out units without parameters at either end: the
    record takes the owner's span from the plan. Anything else sent for another
    stage is refused."""
    owner = message.name
    if owner == stage:
        return False
    if (
        message.kind != "chain"
        or message.holder != stage
        or owner not in devices
        or devices.index(owner) + 1 >= len(devices)
        or devices[devices.index(owner) + 1] != stage
        or message.keys
        or message.tensors
    ):
        raise ProtocolError(f"an async_copy of {owner!r} sent by {stage!r}")
    return True


def _checked(stage: str, message: AsyncCopy, devices: list[str], plan: Any) -> HeldCopy:
    from_holder = holder_notice(stage, message, devices)
    owner = message.name
    if owner not in devices:
        raise ProtocolError(f"{owner!r} is not a stage of run {message.run}")
    if message.kind not in COPY_KINDS:
        raise ProtocolError(f"unknown copy kind {message.kind!r}")
    index = devices.index(owner)
    span = plan.stages[index]
    if from_holder:
        if not span.start <= message.start < message.end <= span.end:
            raise ProtocolError(
                f"{stage!r} holds {owner!r}'s units [{message.start}, {message.end}), "
                f"but {owner!r} runs [{span.start}, {span.end})"
            )
    elif (message.start, message.end) != (span.start, span.end):
        raise ProtocolError(
            f"{stage!r} copied units [{message.start}, {message.end}), "
            f"but runs [{span.start}, {span.end})"
        )
    last = index == len(devices) - 1
    holder = message.holder or COORDINATOR
    if message.kind == "global" and holder != COORDINATOR:
        raise ProtocolError("a global copy is held by the coordinator")
    if message.kind == "chain" and holder != (COORDINATOR if last else devices[index + 1]):
        raise ProtocolError(f"{owner!r}'s chain copy is not held by {holder!r}")
    if len(message.keys) != len(message.tensors):
        raise ProtocolError("an async_copy whose keys and tensors differ")
    from zpipe.models.weights import split_unit_key  # needs torch: tensors came with it

    state: dict[str, torch.Tensor] = {}
    for key, tensor in zip(message.keys, message.tensors, strict=True):
        unit = split_unit_key(str(key))
        if unit is None or not span.start <= unit[0] < span.end:
            raise ProtocolError(f"an async_copy holds {key!r}, not state of its units")
        # a copy: the received frame's memory belongs to a zmq message
        state[str(key)] = tensor.clone()
    if holder == COORDINATOR:
        if not state:
            raise ProtocolError("a copy held by the coordinator comes with its tensors")
        if message.digest and state_digest(state) != message.digest:
            raise ProtocolError(f"{stage!r}'s copy of mini-batch {message.step} is damaged")
    elif state:
        raise ProtocolError("a chain copy held at a stage is announced without tensors")
    try:
        record = CopyRecord(
            owner=owner,
            kind=message.kind,
            holder=holder,
            run=message.run,
            step=message.step,
            start=span.start,
            end=span.end,
            nbytes=sum(t.numel() * t.element_size() for t in state.values()),
            digest=message.digest or "",
        )
    except ValueError as exc:  # ConfigError: a bad step or range
        raise ProtocolError(str(exc)) from None
    return HeldCopy(record, state)


def _save(held: HeldCopies, copy: HeldCopy) -> Flow:
    """Write ``copy``; and again the newest of its stage and kind if a newer one was kept
    while this one was written. Saves run in threads side by side, each replacing the
    one file of its stage and kind, so an older copy's write can end after a newer
    one's: without the second write the file would keep the older copy."""
    record = copy.record
    while True:
        fields = {"owner": record.owner, "kind": record.kind, "step": record.step}
        try:
            size = yield SaveCopy(copy)
        except (OSError, StateFileError) as exc:
            # kept in memory still; a restart before the next copy loses this one
            yield Log("error", "async_copy_not_saved", {**fields, "error": str(exc)})
            return None
        # info: a copy is what a restarted coordinator recovers from, once it is on disk
        yield Log("info", "async_copy_saved", {**fields, "file_bytes": size})
        newest = held.ledger.newest(record.owner, record.kind)
        if newest is None or newest == record:
            return None
        copy = HeldCopy(newest, held.state_of(newest.owner, newest.kind) or {})
        record = newest
