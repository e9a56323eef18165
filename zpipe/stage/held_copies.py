"""The copies a training stage holds, and the peer requests that read or add to them.

- its own snapshots and its peers' backups (``replicas``), read by owner, run and
  step: for a ``weights_request`` with a ``snapshot`` and for an assignment's fetch
  entries that name this stage (:mod:`zpipe.stage.snapshots`), or for a peer's fetch.
- a peer's ``backup`` to keep, or its ``fetch_units`` of a snapshot held here,
  arrive on the probe socket (:meth:`CopyHolder.on_peer_request`), judged by
  :mod:`zpipe.stage.peer_policy` (the plan's owners, the sender's key, a budget);
  either crosses in chunks when it is big (:mod:`zpipe.stage.peer_transfer`).
- a ``backup`` marked ``live`` is a peer's chain copy made without draining
  (:mod:`zpipe.stage.live_copies`): the holder keeps it apart from the snapshots
  of flushes (``live_copies``), judged as any backup, and tells the coordinator it
  holds it (``announce``).

Each request returns the reply to send; a refusal becomes the reply's ``error``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator

import torch

from zpipe._errors import ConfigError, ProtocolError
from zpipe.log import get_logger
from zpipe.models.size import peer_build_limit
from zpipe.protocol import WireMessage
from zpipe.protocol.peer import Backup, BackupOk, FetchUnits, StateChunk, StateChunkOk, Units
from zpipe.recovery.live_copies import state_digest
from zpipe.stage.executors.sync_training import TrainingExecutor
from zpipe.stage.live_copies import ToCoordinator, announce_held, held_copy_notice
from zpipe.stage.metrics import StageCounters
from zpipe.stage.peer_policy import (
    UNAUTHENTICATED,
    BackupOffer,
    BackupPlan,
    FetchGrant,
    FetchRequest,
    PeerIdentity,
    backup_owner_refusal,
    backup_refusal,
    fetch_refusal,
)
from zpipe.stage.peer_transfer import ChunkedState, encoded_size, state_chunks
from zpipe.stage.replicas import ReplicaStore
from zpipe.transport.bulk import MAX_CHUNK_BYTES, stall_after_s

log = get_logger("zpipe.stage")

# A fetch's answer is streamed in chunks of at least this size, whatever a requester
# asks: smaller ones would only make the holder send (and rate-limit) more messages.
MIN_FETCH_CHUNK_BYTES = 64 * 1024


class CopyHolder:
    """What this stage holds for its peers (their backups, their chain copies made
    without draining) beside its own snapshots, and the peer requests that add to
    them or read them."""

    def __init__(
        self,
        *,
        name: str,
        timeout_s: float,
        counters: StageCounters,
        replicas: ReplicaStore,
        backup_budget_bytes: int | None = None,
        announce: ToCoordinator | None = None,
    ) -> None:
        self.name = name
        self._timeout_s = timeout_s
        self._counters = counters
        self.replicas = replicas
        # chain copies peers made without draining, by (owner, run, step): apart from
        # ``replicas``, so that they never push out a flush's snapshot a rollback needs
        self.live_copies = ReplicaStore()
        self._digests: set[asyncio.Future[str]] = set()  # kept copies being hashed
        # where a kept chain copy is announced to the coordinator (the runtime's bulk
        # connection; None: not announced by this holder, only by its owner)
        self.announce = announce
        self._notices: set[asyncio.Future[None]] = set()  # those notices on their way
        # what this device holds for peers' backups at most: its model memory limit
        self.backup_budget_bytes = (
            peer_build_limit() if backup_budget_bytes is None else backup_budget_bytes
        )
        # the fetches the coordinator's newest plan makes from here (``link_peers``)
        self.fetch_grants: tuple[FetchGrant, ...] = ()
        # half-sent backups: within the budget per sender, dropped once stalled for two
        # of the deadlines each chunk's sender waits on its answer
        self._chunked_backups = ChunkedState(
            cap_bytes=self.backup_budget_bytes, stall_s=stall_after_s(timeout_s)
        )
        self._transfers = itertools.count()  # the streamed answers to fetches

    def snapshot_units(self, ranges: object) -> dict[str, torch.Tensor]:
        """The units of the snapshots kept here that ``ranges`` names:
        ``[{"owner", "run", "step", "start", "end"}]``."""
        if not isinstance(ranges, list):
            raise ProtocolError("a snapshot request lists ranges")
        state: dict[str, torch.Tensor] = {}
        for entry in ranges:
            if not isinstance(entry, dict):
                raise ProtocolError("a snapshot range must be a map")
            try:
                owner, run, step = str(entry["owner"]), int(entry["run"]), int(entry["step"])
                start, end = int(entry["start"]), int(entry["end"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ProtocolError(f"a malformed snapshot range: {exc!r}") from None
            state.update(self.held_units(owner, run, step, start, end))
        return state

    def held_units(
        self, owner: str, run: int, step: int, start: int, end: int
    ) -> dict[str, torch.Tensor]:
        """Units of a snapshot held here: a flush's (``replicas``), else a chain copy a
        peer made without draining (``live_copies``: what a fast recovery restores a dead
        owner's units from, asked for by owner, run and mini-batch)."""
        if (owner, run, step) not in self.replicas and (owner, run, step) in self.live_copies:
            return self.live_copies.units(owner, run, step, start, end)
        return self.replicas.units(owner, run, step, start, end)

    async def on_peer_request(
        self,
        message: WireMessage,
        trainer: TrainingExecutor | None = None,
        sender: PeerIdentity = UNAUTHENTICATED,
    ) -> WireMessage | Iterator[WireMessage]:
        """A peer's backup to keep (whole, or a chunk of it), or units of a snapshot a
        peer fetches (one message, or a stream of chunks for a requester that offered
        ``chunk_bytes``), judged by :mod:`zpipe.stage.peer_policy` against the running
        plan and the sender."""
        match message:
            case Backup():
                return self._keep_backup(message, trainer, sender)
            case StateChunk():
                return self._backup_chunk(message, trainer, sender)
            case FetchUnits():
                return self._serve_fetch(message, sender)
        raise ProtocolError(f"unexpected {message.KIND!r} from a peer")

    def _serve_fetch(
        self, message: FetchUnits, sender: PeerIdentity
    ) -> WireMessage | Iterator[WireMessage]:
        request = FetchRequest(
            owner=message.owner,
            run=message.run,
            step=message.step,
            start=message.start,
            end=message.end,
        )
        key = (request.owner, request.run, request.step)
        # a chain copy a peer made without draining is kept for a recovery to read by
        # owner, run and mini-batch, whatever run is newer here (the grant names it)
        live = key not in self.replicas and key in self.live_copies
        newest = None if live else self.replicas.newest_run()
        refusal = fetch_refusal(request, sender, newest_run=newest, grants=self.fetch_grants)
        if refusal is not None:
            log.warning("fetch_refused", stage=self.name, owner=request.owner,
                        peer=sender.describe(), error=refusal)  # fmt: skip
            return Units(keys=[], error=refusal)
        try:
            units = self.held_units(
                request.owner, request.run, request.step, request.start, request.end
            )
        except ConfigError as exc:
            return Units(keys=[], error=str(exc))
        log.info("units_served", stage=self.name, owner=request.owner, peer=sender.describe(),
                 start=request.start, end=request.end)  # fmt: skip
        answer = Units(keys=list(units), error="", tensors=tuple(units.values()))
        offered = message.chunk_bytes
        if offered is None:
            return answer
        chunk_bytes = min(max(int(offered), MIN_FETCH_CHUNK_BYTES), MAX_CHUNK_BYTES)
        frames, nbytes = encoded_size(answer)
        if nbytes <= chunk_bytes:
            return answer
        return state_chunks(
            frames, owner=request.owner, transfer=next(self._transfers), chunk_bytes=chunk_bytes
        )

    def _backup_chunk(
        self, chunk: StateChunk, trainer: TrainingExecutor | None, sender: PeerIdentity
    ) -> StateChunkOk | BackupOk:
        """One chunk of a big backup: acknowledged, or (the last) kept as a backup is."""
        owner, transfer, seq = chunk.owner, chunk.transfer, chunk.seq

        def refused(error: str) -> StateChunkOk:
            self._chunked_backups.drop(sender, owner)
            self._counters.dropped += 1
            log.warning("backup_refused", stage=self.name, owner=owner, peer=sender.describe(),
                        error=error)  # fmt: skip
            return StateChunkOk(transfer=transfer, seq=seq, error=error)

        if seq == 0:
            setup = trainer.setup if trainer is not None else None
            plan = BackupPlan(setup.run, setup.backup_from) if setup else BackupPlan(None)
            refusal = backup_owner_refusal(owner, sender, plan)
            if refusal is not None:
                return refused(refusal)
        try:
            whole = self._chunked_backups.add(
                sender, chunk, max_message_bytes=self.backup_budget_bytes, now=time.monotonic()
            )
        except ProtocolError as exc:
            return refused(str(exc))
        if whole is None:
            return StateChunkOk(transfer=transfer, seq=seq, error="")
        if not isinstance(whole, Backup) or whole.owner != owner:
            return refused(f"the chunks of {owner!r}'s backup made a {whole.KIND!r} of another")
        return self._keep_backup(whole, trainer, sender)

    def _keep_backup(
        self, message: Backup, trainer: TrainingExecutor | None, sender: PeerIdentity
    ) -> BackupOk:
        owner, run, step = message.owner, message.run, message.step
        keys = tuple(str(k) for k in message.keys)
        nbytes = sum(t.numel() * t.element_size() for t in message.tensors)
        setup = trainer.setup if trainer is not None else None
        plan = BackupPlan(setup.run, setup.backup_from) if setup else BackupPlan(None)
        # the copies made without draining and the flushes' snapshots share one budget
        store, other = (
            (self.live_copies, self.replicas) if message.live else (self.replicas, self.live_copies)
        )
        held_after = store.peer_bytes_if_put(owner, run, step, nbytes, me=self.name)
        held_after += other.peer_bytes(me=self.name)
        refusal = backup_refusal(
            BackupOffer(owner, run, keys, len(message.tensors), nbytes),
            sender,
            plan,
            held_after_bytes=held_after,
            budget_bytes=self.backup_budget_bytes,
        )
        if refusal is not None:
            self._counters.dropped += 1
            log.warning("backup_refused", stage=self.name, owner=owner, peer=sender.describe(),
                        error=refusal)  # fmt: skip
            return BackupOk(run=run, step=step, error=refusal)
        # Copies: the frames' memory belongs to the zmq message.
        state = {k: t.clone() for k, t in zip(keys, message.tensors, strict=True)}
        store.put(owner, run, step, state)
        if message.live:
            self._log_live_copy(owner, run, step, nbytes, state, list(keys))
            return BackupOk(run=run, step=step, error="")
        log.info("backup_kept", stage=self.name, owner=owner, run=run, step=step, bytes=nbytes)
        return BackupOk(run=run, step=step, error="")

    def _log_live_copy(
        self,
        owner: str,
        run: int,
        step: int,
        nbytes: int,
        state: dict[str, torch.Tensor],
        keys: list[str],
    ) -> None:
        """Log a kept copy with its digest (to compare it with the other copies of its
        mini-batch), hashed in a thread: the event loop goes on with the data; then
        tell the coordinator this stage holds it (``announce``)."""

        def logged(task: asyncio.Future[str]) -> None:
            self._digests.discard(task)
            if not task.cancelled() and task.exception() is None:
                log.info("live_copy_kept", stage=self.name, owner=owner, run=run, step=step,
                         bytes=nbytes, digest=task.result())  # fmt: skip
                notice = held_copy_notice(holder=self.name, owner=owner, run=run, step=step,
                                          keys=keys, digest=task.result())  # fmt: skip
                if self.announce is not None and notice is not None:
                    sent = asyncio.ensure_future(
                        announce_held(self.announce, notice, self._timeout_s)
                    )
                    self._notices.add(sent)  # held until done
                    sent.add_done_callback(self._notices.discard)

        task = asyncio.ensure_future(asyncio.to_thread(state_digest, state))
        self._digests.add(task)  # held until done: a task only weakly referenced may vanish
        task.add_done_callback(logged)
